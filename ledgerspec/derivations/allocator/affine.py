"""A step's allocation stream at another microbatch or length, from streams traced at others, event by event.

Along the microbatch every tensor of a training step holds ``microbatch`` rows or none (token ids, hidden states,
logits, the attention kernel's workspaces, the padded batch's mask), so the bytes of each allocation are an affine
function of the microbatch ``b``, and the step itself (which allocations, in which order, which free releases
which, the phase markers) stays the same. Along ``max_length`` the bytes are a polynomial of degree at most 2
(``L x L`` masks and eager attention scores). Where either fails — a kernel that chooses by size, a batch of one row
that is not padded, a length the packing or padding changes the shape of — the streams do not fit and the point is
traced instead: nothing here is assumed, it is checked.

:func:`family` takes streams traced at ``degree + 1`` or more values of the input; it checks that their structure
is the same event by event (:func:`ledgerspec.derivations.allocator.depth.canonical` with the sizes left out) and
that every allocation's bytes lie on one polynomial of ``degree`` through all of them (the values beyond the first
``degree + 1`` check it, event by event, naming the first event off the polynomial). :meth:`StreamFamily.stream`
writes the stream at any other value: the same events with each size read off its polynomial (exact integers; a
size that would not be a whole number of bytes, or negative, is refused). :func:`polynomial_figures` does the same
for a dict of figures (the estimate's phase peaks are maxima of such polynomials, not one: they are never
synthesised this way for an answer, only checked).

Pure arithmetic on event lists; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ledgerspec.derivations.allocator.replay import Event


class NotPolynomial(ValueError):
    """The streams do not share one structure, or an allocation's bytes are not one polynomial (one line: why)."""


def _structure(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    """The stream without ids and sizes: kinds, streams, which allocation (by order) each free releases, markers."""
    order: dict[Any, int] = {}
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e[0] == "alloc":
            order[e[1]] = len(order)
            out.append(("alloc", int(e[3]) if len(e) > 3 else 0))
        elif e[0] == "free":
            out.append(("free", order.get(e[1], -1), *e[2:]))
        else:
            out.append(tuple(e))
    return out


def _same_structure(
    first: Sequence[Event], shape: list[tuple[Any, ...]], other: Sequence[Event], a: str, b: str
) -> None:
    """Raise :class:`NotPolynomial` unless ``other`` has the structure ``shape`` of ``first`` (``a`` and ``b`` name
    the two streams): the first event that differs, with its window."""
    theirs = _structure(other)
    if theirs != shape:
        at = next(
            (i for i, (x, y) in enumerate(zip(shape, theirs, strict=False)) if x != y), min(len(shape), len(theirs))
        )
        raise NotPolynomial(
            f"the streams at {a} and {b} differ in structure from event {at} "
            f"({_window(first, min(at, len(first) - 1))}; {len(shape)} and {len(theirs)} events)"
        )


def _weights(points: Sequence[int], x: int) -> list[Fraction]:
    """Lagrange weights of ``points`` at ``x``."""
    out = []
    for i, xi in enumerate(points):
        w = Fraction(1)
        for j, xj in enumerate(points):
            if i != j:
                w *= Fraction(x - xj, xi - xj)
        out.append(w)
    return out


def _window(events: Sequence[Event], index: int) -> str:
    """The protocol window event ``index`` falls in (the last phase marker before it)."""
    return next((str(events[i][1]) for i in range(index, -1, -1) if events[i][0] == "phase"), "start")


@dataclass
class StreamFamily:
    """Streams traced at :attr:`points` (they define each size's polynomial) and :attr:`checked_at` (checked it)."""

    template: list[Event]
    points: tuple[int, ...]
    degree: int
    #: per allocation (index in :attr:`template`): its bytes at the defining points
    sizes: dict[int, tuple[int, ...]]
    #: the values that checked the polynomials (beyond the defining ones)
    checked_at: tuple[int, ...] = ()
    _memo: dict[tuple[int, tuple[int, ...]], int] = field(default_factory=dict, repr=False)

    def size(self, index: int, x: int) -> int:
        values = self.sizes[index]
        if len(set(values)) == 1:
            return values[0]
        hit = self._memo.get((x, values))
        if hit is None:
            exact = sum((w * v for w, v in zip(_weights(self.points, x), values, strict=True)), Fraction(0))
            if exact.denominator != 1 or exact < 0:
                raise NotPolynomial(
                    f"event {index} ({_window(self.template, index)}): {float(exact):.1f} bytes at {x} "
                    f"(sizes {list(values)} at {list(self.points)})"
                )
            hit = self._memo[(x, values)] = int(exact)
        return hit

    def stream(self, x: int) -> list[Event]:
        """The events at value ``x`` (the template's ids; each allocation's size off its polynomial)."""
        if x in self.points and x == self.points[0]:
            return list(self.template)
        out: list[Event] = []
        for i, e in enumerate(self.template):
            if e[0] == "alloc":
                out.append((e[0], e[1], self.size(i, x), *e[3:]))
            else:
                out.append(e)
        return out


def family(streams: Mapping[int, Sequence[Event]], degree: int = 1, what: str = "value") -> StreamFamily:
    """The :class:`StreamFamily` of ``streams`` ``{value: events}`` (at least ``degree + 1`` values; the smallest
    ``degree + 1`` define, every other checks). Raises :class:`NotPolynomial` (one line: the first event that
    differs or is off the polynomial, with its window)."""
    values = sorted(streams)
    if len(values) < degree + 1:
        raise ValueError(f"{degree + 1} traced {what}s are needed, not {values}")
    defining, checking = values[: degree + 1], values[degree + 1 :]
    first = list(streams[values[0]])
    shape = _structure(first)
    for v in values[1:]:
        _same_structure(first, shape, streams[v], f"{what} {values[0]}", str(v))
    allocs = [i for i, e in enumerate(first) if e[0] == "alloc"]
    by_value = {v: list(streams[v]) for v in values}
    sizes = {i: tuple(int(by_value[v][i][2]) for v in defining) for i in allocs}
    out = StreamFamily(first, tuple(defining), degree, sizes, tuple(checking))
    for v in checking:
        events = by_value[v]
        for i in allocs:
            got = int(events[i][2])
            try:
                want = out.size(i, v)
            except NotPolynomial:
                want = -1
            if got != want:
                raise NotPolynomial(
                    f"event {i} ({_window(first, i)}): {got} bytes at {what} {v}, not on the degree-{degree} "
                    f"polynomial through {list(sizes[i])} at {list(defining)}"
                )
    return out


def polynomial_figures(figures: Mapping[int, Mapping[str, int]], x: int, degree: int = 1) -> dict[str, int]:
    """Every figure at ``x`` on the polynomial of ``degree`` through the values' figures (the smallest ``degree +
    1`` values define it, the rest must lie on it); raises :class:`NotPolynomial` when a figure does not."""
    values = sorted(figures)
    if len(values) < degree + 1:
        raise ValueError(f"{degree + 1} traced values are needed, not {values}")
    defining = values[: degree + 1]
    keys = set.intersection(*(set(figures[v]) for v in values))
    out: dict[str, int] = {}
    for k in sorted(keys):
        ys = [figures[v][k] for v in defining]

        def at(point: int, ys: list[int] = ys) -> Fraction:
            return sum((w * y for w, y in zip(_weights(defining, point), ys, strict=True)), Fraction(0))

        for v in values[degree + 1 :]:
            if at(v) != figures[v][k]:
                raise NotPolynomial(f"figure {k}: {figures[v][k]} at {v}, not on the polynomial through {ys}")
        exact = at(x)
        if exact.denominator != 1:
            raise NotPolynomial(f"figure {k}: {float(exact):.1f} at {x} is not a whole number of bytes")
        out[k] = int(exact)
    return out


__all__ = ["NotPolynomial", "StreamFamily", "family", "polynomial_figures"]
