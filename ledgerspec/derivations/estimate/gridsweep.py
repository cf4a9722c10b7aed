"""The sweep over microbatch x max_length at the cost of a few traces: the others written from their streams, checked.

:func:`grid_sweep_rows` answers :func:`ledgerspec.derivations.estimate.search.sweep_rows`'s question (every point of
a sweep, in the points' order) with fewer traces. Per combination of the other axes and per padding regime (a batch
of one row is not padded: its own regime, as in :mod:`.fitmodel`):

1. a tensor grid is traced with the estimate's depth probes, their allocation streams kept: the smallest and
   the largest microbatch of the regime times up to three ``(max_length, typical length)`` pairs
   (:func:`ledgerspec.derivations.estimate.search.length_design` with ``interpolate``: the shortest, the longest
   and one near their geometric mean, the typical lengths the sweep needs spread over them);
2. one more point of the regime (another microbatch and another length where there is one) is traced at the
   shallowest probe only, and its stream must be, event by event, the one the grid writes there
   (:meth:`ledgerspec.derivations.allocator.grid.GridFamily.check`: every allocation affine in the microbatch and
   a polynomial of degree at most 2 of its length), and its figures those the grid gives;
3. every other point's probe streams are written from the grid (:meth:`GridFamily.stream`) and its phase figures
   counted off them as the estimate's tracker counts (:func:`~ledgerspec.derivations.allocator.grid.counted_phases`;
   on every traced stream these must equal the tracker's own figures), the figures that split a peak into
   components read off the same grid (they must add up to the counted peak wherever the traced ones do), then
   extended over the depth exactly as the estimate extends its probes.

Whatever does not hold (structures that differ, a size off its polynomial, a split that does not add up, a point
outside the traced lengths) is traced instead, as a plain estimate: nothing is assumed. The rows say which points
were traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.derivations.allocator.affine import NotPolynomial
from ledgerspec.derivations.allocator.grid import GridFamily, Point, Side, tracker_figures
from ledgerspec.derivations.estimate.fit import ALL_PHASES
from ledgerspec.derivations.estimate.fitmodel import AT_PEAK
from ledgerspec.derivations.estimate.search import SweepRow, length_design, padded, probe
from ledgerspec.derivations.estimate.sweep import apply

#: one traced probe: (events, windows, accumulation, figures, what the tracker logged beside the events)
Probe = tuple[list[Any], list[str], int, dict[str, int], Side]
#: a job's probes by depth (None: every layer)
Probes = dict[int | None, Probe]


@dataclass
class GridSweep:
    """The rows of a sweep, how many traces it took, and why any point was traced rather than written."""

    rows: list[SweepRow]
    estimates: int  # points traced with every depth probe
    checks: int  # points traced at the shallowest probe only, to check the grid
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: answered from the estimate cache: the seconds the sweep took when it was traced (None: traced now)
    cached_from: float | None = None


@dataclass
class _Regime:
    others: dict[str, Any]
    members: list[dict[str, Any]]
    at: dict[int, Point]  # id(point) -> its grid point
    grid: list[Point]
    check: Point | None


def _pick_check(untraced: Sequence[Point], bs: Sequence[int], lengths: Sequence[int]) -> Point | None:
    """The point that checks the grid: another microbatch and another length where there is one (the largest)."""
    if not untraced:
        return None
    return max(untraced, key=lambda p: (p.b not in bs, p.length not in lengths, p.length, p.b))


def plan(doc: Document, points: Sequence[dict[str, Any]]) -> list[_Regime] | None:
    """The regimes of a sweep and what each traces; None when a point has no max_length (the estimate reports it)."""
    pads = padded(doc)
    declared = config.read(doc).workload.microbatch or 1
    decoupled = not config.read(doc).workload.packing
    groups: dict[tuple[tuple[str, Any], ...], list[dict[str, Any]]] = {}
    for p in points:
        key = tuple((k, v) for k, v in p.items() if k not in ("microbatch", "max_length"))
        groups.setdefault(key, []).append(p)
    out: list[_Regime] = []
    for key, members in groups.items():
        others = dict(key)
        at: dict[int, Point] = {}
        for p in members:
            w = config.read(apply(doc, p)).workload
            if w.worst is None or w.typical is None:
                return None
            at[id(p)] = Point(int(p.get("microbatch", declared)), int(w.worst), int(w.typical))

        def typical_of(n: int, others: dict[str, Any] = others) -> int:
            return config.read(apply(doc, {**others, "max_length": n})).workload.typical or n

        for regime in (0, 1) if pads else (1,):
            mine = [p for p in members if (0 if pads and at[id(p)].b == 1 else 1) == regime]
            if not mine:
                continue
            bs_all = sorted({at[id(p)].b for p in mine})
            bs = [bs_all[0], bs_all[-1]] if len(bs_all) > 1 else bs_all
            lengths = sorted({at[id(p)].length for p in mine})
            pairs = length_design(lengths, typical_of, decoupled, interpolate=True)
            grid = [Point(b, n, t) for b in bs for n, t in pairs]
            untraced = [at[id(p)] for p in mine if at[id(p)] not in grid]
            check = _pick_check(untraced, bs, [n for n, _ in pairs])
            out.append(_Regime(others, mine, {id(p): at[id(p)] for p in mine}, grid, check))
    return out


def _variant(doc: Document, regime: _Regime, p: Point, swept: tuple[bool, bool]) -> Document:
    by_b, by_n = swept
    return probe(doc, p.b if by_b else None, p.length if by_n else None, p.typical, regime.others)


@cache
def _side_backend_class() -> Any:
    """The event backend of :mod:`ledgerspec.derivations.allocator.step` whose tracker also logs what
    :func:`ledgerspec.derivations.allocator.grid.tracker_figures` needs: each allocation's category, every relabel,
    and when the protocol reads the total."""
    from ledgerspec.derivations.allocator.step import _event_backend_class
    from ledgerspec.derivations.engine.tracker import MemoryTracker

    class SideTracker(MemoryTracker):
        def __init__(self, granularity: int) -> None:
            super().__init__(granularity=granularity, events=True)
            self.alloc_categories: dict[int, str] = {}
            self.relabels: list[tuple[int, int, str]] = []

        def _log_alloc(self, key: int, nbytes: int) -> None:
            super()._log_alloc(key, nbytes)
            live = self._event_ids.get(key)
            if live is not None and live[0] not in self.alloc_categories:
                self.alloc_categories[live[0]] = self.context

        def _relabelled(self, before: dict[int, str]) -> None:
            assert self.events is not None
            for key, entry in self._live.items():
                old = before.get(key)
                if old is not None and old != entry.category:
                    live = self._event_ids.get(key)
                    if live is not None:
                        self.relabels.append((len(self.events), live[0], entry.category))

        def reclassify(self, model: Any, optimizer: Any = None, stale: Any = ()) -> None:
            before = {k: e.category for k, e in self._live.items()}
            super().reclassify(model, optimizer, stale)
            self._relabelled(before)

        def label(self, tensor: Any, category: str) -> None:
            before = {k: e.category for k, e in self._live.items()}
            super().label(tensor, category)
            self._relabelled(before)

    class SideBackend(_event_backend_class()):  # type: ignore[misc]
        def __init__(self, granularity: int) -> None:
            super().__init__(granularity)
            self.tracker = SideTracker(granularity)
            self.reads: list[int] = []

        def current(self) -> int:
            assert self.tracker.events is not None
            self.reads.append(len(self.tracker.events))
            return int(super().current())

    return SideBackend


def trace_probes(doc: Document, depths: tuple[int | None, ...], target: str, layers: str) -> Probes:
    """``doc``'s step traced at ``depths`` decoder layers (None: all), each stream, what the tracker logged beside
    it, and the figures kept."""
    from ledgerspec.derivations.estimate.estimator import granularity, prepare

    prepared = prepare(doc, target, layers)
    out: Probes = {}
    for d in depths:
        backend = _side_backend_class()(granularity(target))
        figures = prepared.trace(d, backend=backend)
        backend.close_window()
        tracker = backend.tracker
        side: Side = (dict(tracker.alloc_categories), list(tracker.relabels), list(backend.reads))
        out[d] = (list(tracker.events), list(backend.windows), min(prepared.spec.accumulation, 2), figures, side)
    return out


def run_jobs(
    jobs: Sequence[tuple[Document, tuple[int | None, ...]]],
    fn: Callable[..., Probes],
    processes: int,
    warm: Callable[[], None] | None = None,
) -> list[Probes]:
    """Every job's probes, in ``processes`` forked workers (as :func:`.search.run_estimates` forks: only before this
    process has traced anything; a job that fails there is run again here)."""
    import multiprocessing

    from ledgerspec.derivations.engine import protocol
    from ledgerspec.derivations.estimate.forked import forked_map

    serial = processes <= 1 or len(jobs) < 2 or "fork" not in multiprocessing.get_all_start_methods()
    if serial or protocol.RUNS_STARTED:
        return [fn(d, depths) for d, depths in jobs]
    if warm is not None:
        warm()
    # the longest jobs first: the workers finish together
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][1]))
    got = forked_map(lambda k: fn(*jobs[order[k]]), len(jobs), processes)
    out: list[Probes | None] = [None] * len(jobs)
    for i, g in zip(order, got, strict=True):
        out[i] = g if g is not None else fn(*jobs[i])
    return [o for o in out if o is not None]


def _phases_of(figures: dict[str, int]) -> dict[str, int]:
    return {k: figures[k] for k in ALL_PHASES if k in figures}


def _row(point: dict[str, Any], figures: dict[str, int], traced: bool) -> SweepRow:
    phases = _phases_of(figures)
    phase = max(phases, key=lambda k: phases[k])
    return SweepRow(point, phases, {c: figures.get(f"at.{phase}.{c}", 0) for c in AT_PEAK}, traced)


def _constants(figures: dict[str, int]) -> dict[str, int]:
    """The figures that are not read off the stream (what the model and optimizer hold, the stack's notes)."""
    return {k: v for k, v in figures.items() if k.startswith(("component.", "stack."))}


def _figures(probe_: Probe, grain: int, events: list[Any] | None = None) -> dict[str, int]:
    """A probe's figures read off its stream (or ``events``, the stream written at another point) with what its
    tracker logged beside it, and its constant figures; ValueError for a step :func:`tracker_figures` does not
    follow."""
    stream, windows, accumulation, figures, side = probe_
    if any(k.startswith("host.") for k in figures):
        raise ValueError("activation offloading (host memory is not in the stream)")
    out = tracker_figures(stream if events is None else events, windows, accumulation, grain, side)
    out.update(_constants(figures))
    return out


def grid_sweep_rows(
    doc: Document,
    points: Sequence[dict[str, Any]],
    target: str,
    layers: str,
    estimate_fn: Callable[[Document], Any],
    jobs: int = 1,
    warm: Callable[[], None] | None = None,
    tracer: Callable[..., Probes] | None = None,
) -> GridSweep | None:
    """Every point of a microbatch x max_length sweep (see the module docstring); None when the sweep has no
    length to follow (the caller runs :func:`.search.sweep_rows`). ``estimate_fn``: the plain estimate a point
    that cannot be written is traced with; ``tracer(doc, depths)``: the probes' streams (tests replace it)."""
    from ledgerspec.derivations.estimate.estimator import granularity, prepare
    from ledgerspec.derivations.estimate.extrapolate import extend_all

    regimes = plan(doc, points)
    if regimes is None:
        return None
    base = prepare(doc, target, layers)
    depths: tuple[int | None, ...] = tuple(base.plan.probes) if base.plan.probes is not None else (None,)
    shallow = depths[0]
    grain = granularity(target)
    fn = tracer or (lambda d, ds: trace_probes(d, ds, target, layers))
    swept = ("microbatch" in points[0], "max_length" in points[0]) if points else (False, False)
    job_list: list[tuple[Document, tuple[int | None, ...]]] = []
    where: list[tuple[int, Point]] = []  # job -> (regime, point)
    for i, r in enumerate(regimes):
        for g in r.grid:
            job_list.append((_variant(doc, r, g, swept), depths))
            where.append((i, g))
        if r.check is not None:
            job_list.append((_variant(doc, r, r.check, swept), (shallow,)))
            where.append((i, r.check))
    results = run_jobs(job_list, fn, jobs, warm)
    got: dict[tuple[int, Point], Probes] = {w: res for w, res in zip(where, results, strict=True)}
    rows: dict[int, SweepRow] = {}
    notes: list[str] = []
    retrace: list[tuple[dict[str, Any], _Regime]] = []
    for i, r in enumerate(regimes):
        full = {g: _extend(got[(i, g)], depths, base.plan, extend_all) for g in r.grid}
        for p in r.members:
            q = r.at[id(p)]
            if q in full:
                rows[id(p)] = _row(p, full[q], True)
        pending = [p for p in r.members if id(p) not in rows]
        if not pending:
            continue
        try:
            families = _families(r, got, i, depths, grain)
            if r.check is not None:
                probes = got[(i, r.check)][shallow]
                families[shallow][0].check(r.check, probes[0])
        except NotPolynomial as exc:
            notes.append(f"traced {len(pending)} more point(s): {exc}")
            retrace.extend((p, r) for p in pending)
            continue
        for p in pending:
            q = r.at[id(p)]
            try:
                per_depth = {d: _figures(families[d][1], grain, families[d][0].stream(q)) for d in depths}
            except (NotPolynomial, ValueError) as exc:
                notes.append(f"traced {q.b} x {q.length}: {exc}")
                retrace.append((p, r))
                continue
            rows[id(p)] = _row(p, _extend_figures(per_depth, depths, base.plan, extend_all), False)
    if retrace:
        from ledgerspec.derivations.estimate.search import run_estimates

        docs = [_variant(doc, r, r.at[id(p)], swept) for p, r in retrace]
        for (p, _), figures in zip(retrace, run_estimates(docs, estimate_fn, jobs), strict=True):
            rows[id(p)] = _row(p, figures, True)
    estimates = sum(len(r.grid) for r in regimes) + len(retrace)
    checks = sum(1 for r in regimes if r.check is not None)
    return GridSweep([rows[id(p)] for p in points], estimates, checks, notes)


def _extend(probes: Probes, depths: tuple[int | None, ...], est_plan: Any, extend_all: Any) -> dict[str, int]:
    return _extend_figures({d: probes[d][3] for d in depths}, depths, est_plan, extend_all)


def _extend_figures(
    per_depth: dict[int | None, dict[str, int]], depths: tuple[int | None, ...], est_plan: Any, extend_all: Any
) -> dict[str, int]:
    """The full-depth figures, as the estimate extends its probes (:func:`.extrapolate.extend_all`)."""
    if depths == (None,):
        figures = dict(per_depth[None])
    else:
        n1, n2 = depths
        assert n1 is not None and n2 is not None
        figures = extend_all(per_depth[n1], per_depth[n2], n1, n2, est_plan.layers)
    return {k: v for k, v in figures.items() if not k.startswith("stack.")}


def _families(
    r: _Regime, got: dict[tuple[int, Point], Probes], i: int, depths: tuple[int | None, ...], grain: int
) -> dict[int | None, tuple[GridFamily, Probe]]:
    """Per depth: the grid's family and one traced probe (its windows, constants and side log are every point's);
    raises :class:`NotPolynomial` when a traced stream's figures read off it are not the tracker's, or the traced
    points differ in what the stream does not hold."""
    out: dict[int | None, tuple[GridFamily, Probe]] = {}
    checked = [(p, d, got[(i, p)][d]) for p in r.grid for d in depths]
    if r.check is not None:
        checked.append((r.check, depths[0], got[(i, r.check)][depths[0]]))
    for p, _, probe_ in checked:
        try:
            read = _figures(probe_, grain)
        except ValueError as exc:
            raise NotPolynomial(f"the figures cannot be read off the stream: {exc}") from None
        if read != probe_[3]:
            bad = next(k for k in sorted(set(read) | set(probe_[3])) if read.get(k) != probe_[3].get(k))
            raise NotPolynomial(
                f"the stream at {p} gives {bad} {read.get(bad)}, the tracker {probe_[3].get(bad)} (not followed)"
            )
    for d in depths:
        first = got[(i, r.grid[0])][d]
        for p, depth, probe_ in checked:
            if depth != d:
                continue
            if probe_[1:3] != first[1:3] or probe_[4] != first[4] or _constants(probe_[3]) != _constants(first[3]):
                raise NotPolynomial(
                    f"the traces at {r.grid[0]} and {p} differ in more than their allocations (windows or the "
                    "tracker's other figures)"
                )
        family = GridFamily.build({p: got[(i, p)][d][0] for p in r.grid}, first[1], first[2])
        out[d] = (family, first)
    return out


__all__ = ["GridSweep", "grid_sweep_rows", "plan", "run_jobs", "trace_probes"]
