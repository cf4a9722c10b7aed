"""The largest microbatch or sequence length that fits a device, in a few traced estimates.

- :func:`fit_microbatch`: two estimates. The first, at the declared microbatch's regime (2 rows when batches are
  padded, else 1), gives the bytes each row adds (its activations and temporaries); the second is traced at the
  microbatch that this first guess says fills the device. The line through the two
  (:class:`~ledgerspec.derivations.estimate.fitmodel.BatchModel`) then gives the largest microbatch that fits and
  the peak of the one above it. When the answer is the second trace itself (the usual case), its peak is traced,
  not modelled; ``exact=True`` traces the answer and the one above in any case.
- :func:`fit_length`: the peak grows with ``max_length`` (quadratic terms, the typical length capped at
  ``sequence_p50``), so the search brackets the answer with estimates, each next length the secant's guess, until
  the largest fitting length and the next one (``step`` tokens apart) are both traced.
- :func:`sweep_rows`: the Memory Sensitivity Matrix with the microbatch axis from a
  :class:`~ledgerspec.derivations.estimate.fitmodel.GridModel`: per combination of the other axes and per length,
  two microbatches (plus microbatch 1 when batches are padded), not one estimate per cell (the length axis from
  three traced lengths only on request: :func:`length_design`); the estimates run in parallel processes
  (:func:`run_estimates`).

Each estimate is :func:`ledgerspec.derivations.estimate.estimator.estimate` of a variant made with
:func:`ledgerspec.derivations.estimate.sweep.apply`; ``estimate_fn`` replaces it in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.derivations.estimate.fit import fit as fit_phases
from ledgerspec.derivations.estimate.fitmodel import BatchModel, GridModel, GridSample, Sample
from ledgerspec.derivations.estimate.sweep import apply
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

EstimateFn = Callable[[Document], Any]
#: the microbatch search stops here (a guess above it is clamped)
MAX_MICROBATCH = 4096
#: at most this many estimates for the length search
MAX_LENGTH_STEPS = 12


@dataclass
class FitAnswer:
    """The largest value of one input that fits ``device_memory``, and the peak at it and at the value above."""

    name: str
    device_memory: int
    largest: int | None
    peak: int | None  # at ``largest`` (None when nothing fits)
    above: int | None
    peak_above: int | None
    traced: list[int] = field(default_factory=list)  # the values an estimate was traced at
    peaks: dict[int, int] = field(default_factory=dict)  # every traced value's peak
    oom_phase_above: str | None = None  # where the value above runs out of memory
    at_peak: dict[str, int] = field(default_factory=dict)  # components alive at the peak of ``largest``
    seconds: float = 0.0
    note: str = ""

    def how(self, value: int | None) -> str:
        if value is None:
            return ""
        return "traced" if value in self.traced else "model"

    def sentence(self) -> str:
        from ledgerspec.contract.units import format_size

        mem = format_size(self.device_memory)
        if self.largest is None:
            smallest = min(self.peaks) if self.peaks else None
            at = f" ({self.name} {smallest}: {format_size(self.peaks[smallest])})" if smallest is not None else ""
            return f"no {self.name} fits {mem} (allocated tensors){at}"
        text = (
            f"largest {self.name} whose allocated tensors fit {mem}: {self.largest} "
            f"(peak {format_size(self.peak or 0)}, {self.how(self.largest)})"
        )
        if self.above is not None and self.peak_above is not None:
            where = f", out of memory in phase {self.oom_phase_above}" if self.oom_phase_above else ""
            text += f"; {self.above} does not fit (peak {format_size(self.peak_above)}, {self.how(self.above)}{where})"
        return text

    def to_extension(self) -> dict[str, Any]:
        """The ``x-fit.NAME`` block a ledger stores."""
        out: dict[str, Any] = {
            "device_memory": self.device_memory,
            "largest": self.largest,
            "peak": self.peak,
            "above": self.above,
            "peak_above": self.peak_above,
            "traced": sorted(self.traced),
        }
        if self.oom_phase_above:
            out["oom_phase_above"] = self.oom_phase_above
        if self.note:
            out["note"] = self.note
        return {k: v for k, v in out.items() if v is not None}


def padded(doc: Document) -> bool:
    """Whether batches of more than one row are padded (microbatch 1 is then its own regime)."""
    return config.read(doc).workload.pads_rows


def _sample(doc: Document, b: int, estimate_fn: EstimateFn, **values: Any) -> Sample:
    est = estimate_fn(apply(doc, {"microbatch": b, **values}))
    return Sample(b, dict(est.figures))


def batch_model(doc: Document, microbatches: Sequence[int], estimate_fn: EstimateFn, **values: Any) -> BatchModel:
    """A :class:`BatchModel` from estimates at ``microbatches`` (with ``values`` set too: other axes of a sweep)."""
    samples = [_sample(doc, b, estimate_fn, **values) for b in dict.fromkeys(microbatches)]
    return BatchModel(samples, padded(doc))


def refuse_chosen_microbatches(doc: Document, question: str) -> None:
    """A question that chooses microbatches itself (``question``: ``--fit microbatch``, ``--what-if``) tries 1, 2,
    4, ...: for GRPO/RLOO most of them are generation batches TRL refuses (not a multiple of ``num_generations``),
    so it is refused in one line at ``training.objective``; a sweep takes the values the user names."""
    objective = config.read(doc).training.objective
    if objective not in config.GENERATING:
        return
    line, col = doc.position("/training/objective")
    raise LedgerspecError(
        f"{question} chooses microbatches itself, and training.objective {objective} needs each generation batch "
        "(microbatch x steps per generation) to be a multiple of num_generations",
        doc.path,
        line,
        col,
        hint="ask `estimate --sweep microbatch=A,B,...` with microbatches TRL accepts, or `--fit max_length`",
        rule="usage",
        exit_code=EXIT_USAGE,
    )


def fit_microbatch(
    doc: Document, device_memory: int, estimate_fn: EstimateFn, exact: bool = False, **values: Any
) -> FitAnswer:
    """The largest microbatch that fits ``device_memory`` (other inputs as ``doc`` declares them, or ``values``)."""
    import time

    refuse_chosen_microbatches(doc, "--fit microbatch")

    started = time.perf_counter()
    pads = padded(doc)
    first = 2 if pads else 1
    samples = [_sample(doc, first, estimate_fn, **values)]
    model = BatchModel(samples, pads)
    answer = FitAnswer("microbatch", device_memory, None, None, None, None)
    if model.peak(first) > device_memory:
        if pads:  # one row is its own regime: trace it
            samples.append(_sample(doc, 1, estimate_fn, **values))
            model = BatchModel(samples, pads)
        return _answer(answer, model, device_memory, None, started)
    # the bytes one more row adds: what is alive at the peak and depends on the batch (activations, temporaries)
    at = model.at_peak(first)
    per_row = _per_row(at["activations"] + at["temporary"], first)
    guess = first + 1
    if per_row:
        guess = max(first + 1, first + math.floor((device_memory - model.peak(first)) / per_row))
    guess = min(guess, MAX_MICROBATCH)
    samples.append(_sample(doc, guess, estimate_fn, **values))
    model = BatchModel(samples, pads)
    best = model.largest_fitting(device_memory, MAX_MICROBATCH)
    if exact and best is not None:
        for b in (best, best + 1):
            if not model.traced(b):
                samples.append(_sample(doc, b, estimate_fn, **values))
        model = BatchModel(samples, pads)
        best = model.largest_fitting(device_memory, MAX_MICROBATCH)
    if pads and best is None and not model.traced(1):
        samples.append(_sample(doc, 1, estimate_fn, **values))
        model = BatchModel(samples, pads)
        best = model.largest_fitting(device_memory, MAX_MICROBATCH)
    return _answer(answer, model, device_memory, best, started)


def _per_row(total: int, rows: int) -> float | None:
    """Bytes per row (None when nothing grows with the batch)."""
    return total / rows if total > 0 and rows > 0 else None


def _answer(answer: FitAnswer, model: BatchModel, device_memory: int, best: int | None, started: float) -> FitAnswer:
    import time

    answer.traced = sorted(s.microbatch for s in model.samples)
    answer.peaks = {s.microbatch: model.peak(s.microbatch) for s in model.samples}
    if best is None:
        best = max((b for b, p in answer.peaks.items() if p <= device_memory), default=None)
    answer.largest = best
    if best is not None:
        answer.peak = model.peak(best)
        answer.at_peak = model.at_peak(best)
        above = best + 1
        if model.can_predict(above):
            answer.above = above
            answer.peak_above = model.peak(above)
            answer.oom_phase_above = fit_phases(model.phases(above), device_memory).oom_phase
    else:
        smallest = min(answer.peaks) if answer.peaks else None
        if smallest is not None:
            answer.above, answer.peak_above = smallest, answer.peaks[smallest]
            answer.oom_phase_above = fit_phases(model.phases(smallest), device_memory).oom_phase
    answer.seconds = time.perf_counter() - started
    answer.note = (
        f"traced at microbatch {', '.join(map(str, answer.traced))}; other values from the line through two traces "
        "(every figure is affine in the microbatch)"
    )
    return answer


def fit_length(doc: Document, device_memory: int, estimate_fn: EstimateFn, step: int = 64, **values: Any) -> FitAnswer:
    """The largest ``max_length`` (a multiple of ``step``) that fits ``device_memory``: the answer and the length
    ``step`` above it are both traced (the sequence profile is clipped to each length, as ``--sweep`` does)."""
    import time

    started = time.perf_counter()
    if step < 1:
        raise ValueError("step must be >= 1")
    declared = config.read(doc).workload.worst or 1024
    peaks: dict[int, int] = {}
    phases: dict[int, dict[str, int]] = {}
    at: dict[int, dict[str, int]] = {}

    def trace(length: int) -> int:
        if length not in peaks:
            est = estimate_fn(apply(doc, {"max_length": length, **values}))
            peaks[length] = est.peak_allocated
            phases[length] = dict(est.phases)
            at[length] = dict(est.at_peak)
        return peaks[length]

    def snap(length: float) -> int:
        return max(step, int(length // step) * step)

    length = snap(declared)
    trace(length)
    # the first guess: the bytes each token adds at the declared length (what is alive at its peak and grows with
    # the length: activations and temporaries), spread over what is left of the device
    grows = at[length].get("activations", 0) + at[length].get("temporary", 0)
    if grows > 0:
        length = snap(length + (device_memory - peaks[length]) * length / grows)
    else:
        length = snap(length * 2 if peaks[length] <= device_memory else length / 2)
    stale = ""  # which end of the bracket stayed put last time (Illinois: its residual is halved)
    for _ in range(MAX_LENGTH_STEPS - 1):
        if length in peaks:
            length = length + step if peaks[length] <= device_memory else max(step, length - step)
        trace(length)
        fitting = sorted(v for v, p in peaks.items() if p <= device_memory)
        failing = sorted(v for v, p in peaks.items() if p > device_memory)
        lo = fitting[-1] if fitting else None
        hi = failing[0] if failing else None
        if hi is not None and hi <= step and lo is None:
            break  # not even one step fits
        if lo is not None and hi is not None and hi - lo <= step:
            break
        moved = "lo" if peaks[length] <= device_memory else "hi"
        weight = 0.5 if stale and stale != moved else 1.0
        stale = "hi" if moved == "lo" else "lo"
        length = _next_length(lo, hi, peaks, device_memory, step, snap, weight, moved)
    fitting = sorted(v for v, p in peaks.items() if p <= device_memory)
    failing = sorted(v for v, p in peaks.items() if p > device_memory)
    best = fitting[-1] if fitting else None
    answer = FitAnswer("max_length", device_memory, best, peaks.get(best) if best else None, None, None)
    above = failing[0] if failing else None
    if above is not None:
        answer.above, answer.peak_above = above, peaks[above]
        answer.oom_phase_above = fit_phases(phases[above], device_memory).oom_phase
    if best is not None:
        answer.at_peak = at[best]
    answer.traced = sorted(peaks)
    answer.peaks = dict(peaks)
    answer.seconds = time.perf_counter() - started
    answer.note = f"every length traced (steps of {step} tokens): {', '.join(map(str, sorted(peaks)))}"
    if best is not None and above is not None and above - best > step:
        answer.note += f"; stopped after {MAX_LENGTH_STEPS} estimates, between {best} and {above}"
    return answer


def _next_length(
    lo: int | None,
    hi: int | None,
    peaks: dict[int, int],
    memory: int,
    step: int,
    snap: Callable[[float], int],
    weight: float = 1.0,
    moved: str = "",
) -> int:
    """The next length to trace: the secant's guess inside the bracket (Illinois: the residual of the end that did
    not move twice is weighted by ``weight``, so a convex peak does not creep up from one side); outside it, the
    secant through the two nearest lengths, at least one step beyond."""
    known = sorted(peaks)
    if hi is None:  # everything fits so far: extend the secant through the two longest
        a, b = known[-2], known[-1]
        if peaks[b] > peaks[a]:
            return max(snap(b + (memory - peaks[b]) * (b - a) / (peaks[b] - peaks[a])), b + step)
        return snap(b * 2)
    if lo is None:  # nothing fits so far: the secant below the two shortest, or halve
        a, b = known[0], known[1] if len(known) > 1 else known[0]
        if b != a and peaks[b] > peaks[a]:
            guess = a - (peaks[a] - memory) * (b - a) / (peaks[b] - peaks[a])
            return max(step, min(snap(guess), a - step))
        return max(step, snap(a / 2))
    under: float = memory - peaks[lo]  # > 0
    over: float = peaks[hi] - memory  # > 0
    if moved == "lo":
        over *= weight
    elif moved == "hi":
        under *= weight
    candidate = snap(lo + (hi - lo) * under / (under + over))
    if candidate <= lo or candidate >= hi:
        candidate = snap((lo + hi) / 2)
    if candidate <= lo or candidate >= hi:
        candidate = lo + step
    return candidate


# -- the sweep --------------------------------------------------------------------------------------------------
@dataclass
class SweepRow:
    point: dict[str, Any]
    phases: dict[str, int]
    at_peak: dict[str, int]
    traced: bool

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])


def design(microbatches: Sequence[int], pads: bool) -> list[int]:
    """The microbatches to trace for a sweep over ``microbatches``: two of the padded regime (the smallest and the
    largest) and 1 when it is swept and batches are padded; every value when there are only two or fewer."""
    values = sorted(set(microbatches))
    if len(values) <= 2:
        return values
    regime = [b for b in values if b >= 2] if pads else values
    out = [regime[0], regime[-1]] if len(regime) >= 2 else list(regime)
    if pads and 1 in values:
        out.insert(0, 1)
    return sorted(set(out))


def length_design(
    lengths: Sequence[int], typical: Callable[[int], int], decoupled: bool, interpolate: bool = False
) -> list[tuple[int, int]]:
    """The (max_length, typical length) pairs to trace for a sweep over ``lengths``; ``typical(L)`` is the typical
    length of a point at max_length ``L``.

    By default every length is traced with its own typical length: the length axis is exact, only the microbatch
    axis is modelled. With ``interpolate`` and more than three lengths: the shortest, the longest and the one
    nearest their geometric mean, every other length read from the quadratic through the three
    (:class:`GridModel`); when ``decoupled`` (the typical length can be set apart from the worst one: not packed)
    the typical lengths the sweep needs are spread over those traces, at most three of them, so the steady-state
    phase is traced rather than interpolated. Not the default: on the 7B QLoRA of ``benchmarks/estimate_fit.py``
    (padded, SDPA, checkpointing) the quadratic through 256, 1024 and 4096 tokens is 0.76 % under a full trace at
    microbatch 1 and 2048 tokens: the backward peak moves from a fixed-size workspace at short lengths to the
    per-token temporaries at long ones, a kink no quadratic through three lengths follows."""
    values = sorted(set(lengths))
    if len(values) <= 3 or not interpolate:
        return [(n, typical(n)) for n in values]
    lo, hi = values[0], values[-1]
    middle = min(values[1:-1], key=lambda n: (abs(math.log(n / math.sqrt(lo * hi))), n))
    traced = [lo, middle, hi]
    natural = {n: typical(n) for n in traced}
    if not decoupled:
        return [(n, natural[n]) for n in traced]
    needed = sorted({typical(n) for n in values})
    if len(needed) > 3:  # more typical lengths than traces: the shortest, the longest and one near their middle
        t_mid = min(needed[1:-1], key=lambda n: (abs(math.log(n / math.sqrt(needed[0] * needed[-1]))), n))
        needed = [needed[0], t_mid, needed[-1]]
    pairs: dict[int, int] = {}
    for n in traced:  # keep a trace's own typical length where the sweep needs it (once)
        if natural[n] in needed and natural[n] not in pairs.values():
            pairs[n] = natural[n]
    missing = [t for t in needed if t not in pairs.values()]
    free = [n for n in traced if n not in pairs]
    for t in missing:  # the shortest free trace that can hold it (a typical length is at most the worst)
        holder = next((n for n in free if n >= t), None)
        if holder is None:
            break
        pairs[holder] = t
        free.remove(holder)
    for n in free:
        pairs[n] = natural[n]
    return sorted(pairs.items())


def probe(doc: Document, b: int | None, length: int | None, typical: int | None, values: dict[str, Any]) -> Document:
    """The variant traced for one grid point: ``values`` (other axes), the microbatch and the max_length (None:
    as declared) and, when it differs from the one the max_length gives, the typical length
    (``workload.sequence_p50``)."""
    from ledgerspec.contract.edit import variant

    point = dict(values)
    if b is not None:
        point["microbatch"] = b
    if length is not None:
        point["max_length"] = length
    out = apply(doc, point)
    if typical is not None and config.read(out).workload.typical != typical:
        out = variant(out, {("workload", "sequence_p50"): typical})
        if config.read(out).workload.typical != typical:  # packed rows: the typical length is the worst
            raise ValueError(f"cannot trace typical length {typical} at max_length {length}")
    return out


#: bytes of the figures of one estimate, as the parallel runner returns them
Figures = dict[str, int]


def warm_stack(docs: Sequence[Document], store: Any = None, question: dict[str, Any] | None = None) -> None:
    """Import the stack the estimates of ``docs`` trace before workers are forked, so that each finds it imported
    instead of importing it itself (:meth:`ledgerspec.derivations.estimate.estimator.Prepared.warm`) — unless the
    estimate cache ``store`` holds every one of them under ``question`` (then nothing is traced, and importing the
    stack would cost a repeated sweep its whole answer). A document the estimate refuses is left to it to report."""
    from ledgerspec.derivations.estimate.cache import key
    from ledgerspec.derivations.estimate.estimator import prepare

    if not docs:
        return
    if store is not None and question is not None:
        names = [key(d, question) for d in docs]
        if all(n is not None and store.get(n) is not None for n in names):
            return
    try:
        prepare(docs[0]).warm()
    except (LedgerspecError, ValueError):
        return


def run_estimates(
    docs: Sequence[Document],
    estimate_fn: EstimateFn,
    jobs: int = 1,
    warm: Callable[[Sequence[Document]], None] | None = None,
) -> list[Figures]:
    """Every document's figures, in ``jobs`` processes when more than one.

    The workers are forked from this process (``multiprocessing``'s fork start method: they inherit the imported
    modules, the documents and ``estimate_fn``, nothing is pickled on the way in), after ``warm(docs)`` (e.g.
    :func:`warm_stack`: the stack imported here, which each worker would import again); only their figures come
    back.
    Forks only before this process has run any protocol (``protocol.RUNS_STARTED``; serial after): a process forked
    after a fake-tensor trace has been seen to hang here (torch 2.13). A sweep from the CLI is its process's first
    trace. An estimate that fails in
    a worker is run again here, so its error is reported as a serial run reports it.
    """
    import multiprocessing

    from ledgerspec.derivations.engine import protocol
    from ledgerspec.derivations.estimate.forked import forked_map

    serial = jobs <= 1 or len(docs) < 2 or "fork" not in multiprocessing.get_all_start_methods()
    if serial or protocol.RUNS_STARTED:  # never fork after a trace in this process (see the docstring)
        return [dict(estimate_fn(d).figures) for d in docs]
    if warm is not None:
        warm(docs)
    got = forked_map(lambda i: dict(estimate_fn(docs[i]).figures), len(docs), jobs)
    return [g if g is not None else dict(estimate_fn(d).figures) for g, d in zip(got, docs, strict=True)]


def sweep_rows(
    doc: Document,
    points: Sequence[dict[str, Any]],
    estimate_fn: EstimateFn,
    jobs: int = 1,
    interpolate_lengths: bool = False,
    warm: Callable[[Sequence[Document]], None] | None = None,
) -> tuple[list[SweepRow], int]:
    """Every point of a sweep from a :class:`GridModel` per combination of the other axes (the microbatch axis
    from two or three traced microbatches, :func:`design`; the lengths each traced unless
    ``interpolate_lengths``, :func:`length_design`); the rows in the points' order and how many estimates were
    traced (in ``jobs`` processes: :func:`run_estimates`, ``warm`` as it says)."""
    pads = padded(doc)
    declared = config.read(doc).workload.microbatch or 1

    def where(p: dict[str, Any]) -> tuple[int, int | None, int | None]:
        w = config.read(apply(doc, p)).workload
        return int(p.get("microbatch", declared)), w.worst, w.typical

    groups: dict[tuple[tuple[str, Any], ...], list[dict[str, Any]]] = {}
    for p in points:
        key = tuple((k, v) for k, v in p.items() if k not in ("microbatch", "max_length"))
        groups.setdefault(key, []).append(p)
    plans: list[tuple[dict[str, Any], list[tuple[int, int | None, int | None]]]] = []
    for key, members in groups.items():
        others = dict(key)
        at = [where(p) for p in members]
        bs = design([b for b, _, _ in at], pads)
        lengths = [n for _, n, _ in at if n is not None]
        pairs: list[tuple[int | None, int | None]]
        if any(n is None for _, n, _ in at):  # no length declared: the estimate says so itself
            pairs = sorted({(n, t) for _, n, t in at}, key=str)
        else:
            decoupled = not config.read(doc).workload.packing

            def typical_of(n: int, others: dict[str, Any] = others) -> int:
                return config.read(apply(doc, {**others, "max_length": n})).workload.typical or n

            pairs = list(length_design(lengths, typical_of, decoupled, interpolate_lengths))
        plans.append((others, [(b, n, t) for n, t in pairs for b in bs]))
    # an axis the sweep does not vary stays as declared (a microbatch set by a sweep drops the global batch)
    swept = [("microbatch" in ms[0], "max_length" in ms[0]) for ms in groups.values()]
    docs = [
        probe(doc, b if by_b else None, n if by_n else None, t, others)
        for (others, probes), (by_b, by_n) in zip(plans, swept, strict=True)
        for b, n, t in probes
    ]
    figures = iter(run_estimates(docs, estimate_fn, jobs, warm))
    rows: dict[int, SweepRow] = {}
    for (_, probes), members in zip(plans, groups.values(), strict=True):
        samples = [GridSample(b, n or 0, t or 0, next(figures)) for b, n, t in probes]
        model = GridModel(samples, pads)
        for p in members:
            b, n, t = where(p)
            n, t = n or 0, t or 0
            rows[id(p)] = SweepRow(p, model.phases(b, n, t), model.at_peak(b, n, t), model.traced(b, n, t))
    return [rows[id(p)] for p in points], len(docs)


__all__ = [
    "FitAnswer",
    "SweepRow",
    "batch_model",
    "design",
    "fit_length",
    "fit_microbatch",
    "length_design",
    "probe",
    "run_estimates",
    "sweep_rows",
    "warm_stack",
]
