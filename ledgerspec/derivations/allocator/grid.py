"""A probe's allocation stream at another point of a microbatch x length grid, from streams traced at a few points.

A sweep over ``microbatch`` and ``max_length`` asks for the estimate at every point of a grid. Along the microbatch
every allocation's bytes are an affine function of ``b`` (:mod:`.affine`); along the length a polynomial of degree
at most 2 of the length the allocation is made at: the first step runs at ``max_length`` (``L``) and the
steady-state step at the typical length ``T`` (``min(sequence_p50, max_length)``), so an allocation in a
steady-state window is a polynomial of ``T``, any other one of ``L`` (allocations before the first step do not
change). So within one padding regime (a batch of one row is not padded: a structure of its own) the bytes of event
``i`` are a polynomial in ``span{1, b} x span{1, l, l^2}`` of its own length ``l``, and the step's structure (which
allocations, in which order, which free releases which, the markers) stays the same.

:class:`GridFamily` takes probe streams traced on a tensor grid: one or two microbatches times up to three
``(L, T)`` pairs with distinct ``L`` and distinct ``T`` (so each allocation's polynomial has its own nodes, whichever
length it follows). :meth:`GridFamily.check` compares a stream traced at another point with the one the family
writes there, event by event (structure and bytes), and raises :class:`~.affine.NotPolynomial` naming the first
event that differs; :meth:`GridFamily.stream` writes the stream at any point inside the traced ranges
(interpolation only; a size that is not a whole, non-negative number of bytes is refused).

:func:`counted_phases` reads the estimate's phase figures off a stream the way the estimate's tracker counts them
(each live request rounded up to the granularity; held bytes at the end of ``after_*``, peaks otherwise), so the
figures of a written stream are computed exactly as those of a traced one. The caller checks that, on every traced
stream, these equal the tracker's own figures before it trusts them for a written one.

Pure arithmetic on event lists; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.derivations.allocator.affine import NotPolynomial, _same_structure, _structure, _weights, _window
from ledgerspec.derivations.allocator.replay import Event
from ledgerspec.derivations.allocator.step import HELD, protocol_windows
from ledgerspec.derivations.engine.tracker import LEDGER_COMPONENT


@dataclass(frozen=True, order=True)
class Point:
    """A grid point: microbatch, ``max_length`` and the typical length of the steady-state step."""

    b: int
    length: int
    typical: int

    def __str__(self) -> str:
        """As a note names it: ``microbatch 2 x 2048 tokens (typical 1210)``."""
        typical = f" (typical {self.typical})" if self.typical != self.length else ""
        return f"microbatch {self.b} x {self.length} tokens{typical}"


def steady_windows(windows: Sequence[str], accumulation: int) -> frozenset[str]:
    """The window labels of the steady-state step (their allocations follow the typical length)."""
    return frozenset(protocol_windows(list(windows), accumulation)["steady_state_peak"])


def follows(events: Sequence[Event], steady: frozenset[str]) -> list[str]:
    """Per event: ``"T"`` inside a steady-state window, else ``"L"``."""
    out: list[str] = []
    current = "L"
    for e in events:
        if e[0] == "phase":
            current = "T" if str(e[1]) in steady else "L"
        out.append(current)
    return out


def counted_phases(
    events: Sequence[Event], windows: Sequence[str], accumulation: int, granularity: int
) -> dict[str, int]:
    """The protocol's phase figures of a stream as the estimate's tracker counts them: per window the peak and the
    end of the live requests, each rounded up to ``granularity``; ``after_*`` the bytes held at the end of its
    window, every other phase its windows' highest peak."""
    live: dict[Any, int] = {}
    current = 0
    peak: dict[str, int] = {}
    end: dict[str, int] = {}
    label = "start"
    top = 0
    for e in events:
        kind = e[0]
        if kind == "alloc":
            n = -(-int(e[2]) // granularity) * granularity
            live[e[1]] = n
            current += n
            if current > top:
                top = current
        elif kind == "free":
            current -= live.pop(e[1], 0)
        elif kind == "phase":
            peak[label], end[label] = top, current
            label = str(e[1])
            top = current
    peak[label], end[label] = top, current
    out: dict[str, int] = {}
    for name, labels in protocol_windows(list(windows), accumulation).items():
        parts = [w for w in labels if w in peak]
        if not parts:
            continue
        out[name] = end[parts[-1]] if name in HELD else max(peak[w] for w in parts)
    return out


#: what a trace logs beside its stream for :func:`tracker_figures`: the category each allocation was made in
#: (``{event id: category}``), every later relabel (``(events so far, event id, category)``), and the moments the
#: protocol read the tracker's current bytes (events so far)
Side = tuple[dict[int, str], list[tuple[int, int, str]], list[int]]

#: the tracker's categories folded into ledger components (the tracker's own table), and the components a peak is
#: split into (the ledger's, as :attr:`ledgerspec.derivations.estimate.estimator.Estimate.at_peak` splits it)
COMPONENT = LEDGER_COMPONENT
AT_PEAK = F.COMPONENTS


def tracker_figures(
    events: Sequence[Event], windows: Sequence[str], accumulation: int, granularity: int, side: Side
) -> dict[str, int]:
    """The estimate's figures of a stream as the tracker and the protocol make them
    (:class:`ledgerspec.derivations.engine.tracker.MemoryTracker`, :func:`ledgerspec.derivations.engine.protocol.
    run_protocol`): each phase (held bytes at the end of ``after_*``, else the peak; of several windows the last
    highest, and for the steady state the first of forward, backward, step with the highest), what is alive at it
    by ledger component (the categories at the moment the window's peak was reached; a peak is reached when the
    total goes above it, a window starts at the total then), and ``activations`` (the bytes the first forward
    added, between the two reads of the tracker's total in its window). Raises ValueError for a protocol it does
    not follow (a generation window, not two reads in the first forward)."""
    categories, relabels, reads = side
    phases_of = protocol_windows(list(windows), accumulation)
    if phases_of.get("generation_peak"):
        raise ValueError("a generation window")
    live: dict[Any, tuple[int, str]] = {}
    totals: dict[str, int] = {}
    current = 0
    label = "start"
    top = 0
    top_cats: dict[str, int] = {}
    peak: dict[str, tuple[int, dict[str, int]]] = {}
    end: dict[str, int] = {}
    at_read: list[int] = []
    relabel_at: dict[int, list[tuple[int, str]]] = {}
    for pos, ident, cat in relabels:
        relabel_at.setdefault(pos, []).append((ident, cat))
    read_set = sorted(reads)
    read_i = 0
    n = len(events)
    for pos in range(n + 1):
        for ident, cat in relabel_at.get(pos, ()):
            entry = live.get(ident)
            if entry is not None and entry[1] != cat:
                totals[entry[1]] -= entry[0]
                totals[cat] = totals.get(cat, 0) + entry[0]
                live[ident] = (entry[0], cat)
        while read_i < len(read_set) and read_set[read_i] == pos:
            at_read.append(current)
            read_i += 1
        if pos == n:
            break
        e = events[pos]
        kind = e[0]
        if kind == "alloc":
            size = -(-int(e[2]) // granularity) * granularity
            cat = categories[e[1]]
            live[e[1]] = (size, cat)
            totals[cat] = totals.get(cat, 0) + size
            current += size
            if current > top:
                top = current
                top_cats = dict(totals)
        elif kind == "free":
            size, cat = live.pop(e[1], (0, ""))
            if cat:
                totals[cat] -= size
            current -= size
        elif kind == "phase":
            peak[label], end[label] = (top, top_cats), current
            label = str(e[1])
            top, top_cats = current, dict(totals)
    peak[label], end[label] = (top, top_cats), current
    out: dict[str, int] = {}

    def put(name: str, figure: int, cats: dict[str, int]) -> None:
        out[name] = figure
        folded: dict[str, int] = {}
        for cat, nbytes in cats.items():
            comp = COMPONENT.get(cat, cat)
            folded[comp] = folded.get(comp, 0) + nbytes
        for comp in AT_PEAK:
            out[f"at.{name}.{comp}"] = folded.get(comp, 0)

    for name, labels in phases_of.items():
        if not labels:
            continue
        if name in HELD:
            put(name, end[labels[-1]], peak[labels[-1]][1])
        elif name == "steady_state_peak":
            best: dict[str, tuple[int, dict[str, int]]] = {}
            for w in labels:
                key = {"activations": "forward", "temporary": "backward"}.get(w.split(":", 1)[1], "step")
                if key not in best or peak[w][0] >= best[key][0]:
                    best[key] = peak[w]
            top_key = max(best, key=lambda k: best[k][0])
            put(name, best[top_key][0], best[top_key][1])
        else:
            chosen = None
            for w in labels:
                if chosen is None or peak[w][0] >= chosen[0]:
                    chosen = peak[w]
            assert chosen is not None
            put(name, chosen[0], chosen[1])
    first_forward = phases_of["forward_peak"][0]
    start = next((i + 1 for i, e in enumerate(events) if e[0] == "phase" and e[1] == first_forward), None)
    if start is None:
        raise ValueError(f"no window {first_forward}")
    stop = next((i for i in range(start, len(events)) if events[i][0] == "phase"), len(events))
    inside = [i for i, pos in enumerate(read_set) if start <= pos <= stop]
    if len(inside) != 2:
        raise ValueError(f"{len(inside)} reads of the total in the first forward window, not 2")
    out["activations"] = at_read[inside[1]] - at_read[inside[0]]
    return out


def _round_exact(x: Fraction, what: str) -> int:
    if x.denominator != 1 or x < 0:
        raise NotPolynomial(f"{what}: {float(x):.1f} bytes is not a whole, non-negative number")
    return int(x)


@dataclass
class GridFamily:
    """Probe streams traced at :attr:`points` (a tensor grid, see the module docstring), one structure."""

    template: list[Event]
    kinds: list[str]  # per event: "L" or "T"
    bs: tuple[int, ...]  # the microbatch nodes (one or two)
    nodes: dict[str, tuple[int, ...]]  # "L"/"T" -> the length nodes
    #: (b, kind, length node) -> the point traced there
    at: dict[tuple[int, str, int], Point]
    streams: dict[Point, list[Event]]
    windows: list[str]
    accumulation: int
    checked_at: list[Point] = field(default_factory=list)

    @classmethod
    def build(cls, streams: Mapping[Point, Sequence[Event]], windows: Sequence[str], accumulation: int) -> GridFamily:
        """The family of ``streams`` (traced at the points of a tensor grid); raises :class:`NotPolynomial` when
        their structures differ or the points are not such a grid."""
        points = sorted(streams)
        if not points:
            raise ValueError("no traced streams")
        first = list(streams[points[0]])
        shape = _structure(first)
        for p in points[1:]:
            _same_structure(first, shape, streams[p], _show(points[0]), _show(p))
        bs = tuple(sorted({p.b for p in points}))
        pairs = sorted({(p.length, p.typical) for p in points})
        if len(bs) > 2 or len(pairs) > 3 or len(points) != len(bs) * len(pairs):
            raise NotPolynomial(f"the traced points {[_show(p) for p in points]} are not a tensor grid")
        nodes = {"L": tuple(sorted({L for L, _ in pairs})), "T": tuple(sorted({t for _, t in pairs}))}
        kinds = follows(first, steady_windows(windows, accumulation))
        kept = {p: list(streams[p]) for p in points}
        at: dict[tuple[int, str, int], Point] = {}
        for p in points:
            for kind, n in (("L", p.length), ("T", p.typical)):
                seen = at.setdefault((p.b, kind, n), p)
                if seen != p:  # two traces share this length: the allocations that follow it must agree
                    for i, k in enumerate(kinds):
                        if k == kind and first[i][0] == "alloc" and kept[seen][i][2] != kept[p][i][2]:
                            raise NotPolynomial(
                                f"event {i} ({_window(first, i)}): {kept[p][i][2]} bytes at {_show(p)}, "
                                f"{kept[seen][i][2]} at {_show(seen)} (the same {'typical' if kind == 'T' else 'max'}"
                                " length)"
                            )
        return cls(first, kinds, bs, nodes, at, kept, list(windows), accumulation)

    def _weights(self, p: Point) -> dict[str, list[tuple[Fraction, tuple[int, str, int]]]]:
        """Per length kind: the (weight, trace) pairs whose weighted sum gives an allocation's bytes at ``p``."""
        if len(self.bs) == 1 and p.b != self.bs[0]:
            raise NotPolynomial(f"microbatch {p.b}: only {self.bs[0]} traced in its regime")
        wb = _weights(self.bs, p.b) if len(self.bs) > 1 else [Fraction(1)]
        out: dict[str, list[tuple[Fraction, tuple[int, str, int]]]] = {}
        for kind, x in (("L", p.length), ("T", p.typical)):
            ls = self.nodes[kind]
            wl: list[Fraction]
            used: tuple[int, ...]
            if x in ls:
                wl, used = [Fraction(1)], (x,)
            elif len(ls) >= 3 and ls[0] < x < ls[-1]:
                wl, used = _weights(ls, x), ls
            else:
                out[kind] = []  # not writable: an allocation of this kind raises
                continue
            out[kind] = [
                (w1 * w2, (b, kind, n))
                for w1, b in zip(wb, self.bs, strict=True)
                for w2, n in zip(wl, used, strict=True)
            ]
        return out

    def stream(self, p: Point) -> list[Event]:
        """The events at ``p`` (the template's ids; each allocation's bytes off its polynomial)."""
        weights = self._weights(p)
        # integer weights over a common denominator, and the traced streams each term reads
        plans: dict[str, tuple[list[int], int, list[list[Event]]]] = {}
        for kind, terms in weights.items():
            if terms:
                den = math.lcm(*(w.denominator for w, _ in terms))
                nums = [int(w * den) for w, _ in terms]
                plans[kind] = (nums, den, [self.streams[self.at[key]] for _, key in terms])
        memo: dict[tuple[str, tuple[int, ...]], int] = {}
        out: list[Event] = []
        for i, e in enumerate(self.template):
            if e[0] != "alloc":
                out.append(e)
                continue
            plan = plans.get(self.kinds[i])
            if plan is None:
                raise NotPolynomial(f"{_show(p)}: outside the traced lengths (interpolation only)")
            nums, den, sources = plan
            values = tuple(int(src[i][2]) for src in sources)
            size = memo.get((self.kinds[i], values))
            if size is None:
                if values.count(values[0]) == len(values):
                    size = values[0]
                else:
                    total = sum(n * v for n, v in zip(nums, values, strict=True))
                    size = _round_exact(Fraction(total, den), f"event {i} ({_window(self.template, i)}) at {_show(p)}")
                memo[(self.kinds[i], values)] = size
            out.append((e[0], e[1], size, *e[3:]))
        return out

    def check(self, p: Point, events: Sequence[Event]) -> None:
        """Raise :class:`NotPolynomial` unless ``events`` (traced at ``p``) is the stream the family writes there."""
        if _structure(events) != _structure(self.template):
            raise NotPolynomial(f"the stream traced at {_show(p)} differs in structure from the traced grid")
        written = self.stream(p)
        for i, (got, want) in enumerate(zip(events, written, strict=True)):
            if got[0] == "alloc" and int(got[2]) != int(want[2]):
                raise NotPolynomial(
                    f"event {i} ({_window(self.template, i)}): {got[2]} bytes at {_show(p)}, not {want[2]} on the "
                    "polynomial through the traced grid"
                )
        self.checked_at.append(p)

    def figures(self, p: Point, traced: Mapping[Point, Mapping[str, int]], steady_key: Any) -> dict[str, int]:
        """Figures at ``p`` interpolated on the same grid from the traced points' ``traced`` figures (each one
        follows the typical length when ``steady_key(name)``, else ``max_length``); raises :class:`NotPolynomial`
        when one is not a whole, non-negative number."""
        weights = self._weights(p)
        keys = set.intersection(*(set(f) for f in traced.values()))
        out: dict[str, int] = {}
        for k in sorted(keys):
            terms = weights["T" if steady_key(k) else "L"]
            if not terms:
                raise NotPolynomial(f"{_show(p)}: outside the traced lengths (interpolation only)")
            exact = sum((w * traced[self.at[key]][k] for w, key in terms), Fraction(0))
            out[k] = _round_exact(exact, f"figure {k} at {_show(p)}")
        return out


def _show(p: Point) -> str:
    return f"microbatch {p.b}, max_length {p.length} (typical {p.typical})"


__all__ = ["GridFamily", "Point", "Side", "counted_phases", "follows", "steady_windows", "tracker_figures"]
