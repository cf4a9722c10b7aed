"""A model of every figure of an estimate as a function of the microbatch, built from two traced estimates.

Every tensor of a training step that depends on the batch holds ``microbatch`` rows of the same shape: the token
ids and labels, the hidden states each layer saves, the logits and the loss in fp32, the attention kernel's saved
tensors and workspaces, the padded batch's mask. So what is alive at any moment of the step is an affine function
of the microbatch ``b``, and so is every figure of the estimate (each phase peak, each component alive at it) as
long as the same moment stays the peak of its phase:

    f(b) = f(b1) + (b - b1) * (f(b2) - f(b1)) / (b2 - b1)

This is the layer extrapolation of :mod:`ledgerspec.derivations.estimate.extrapolate` along another axis. A
phase's peak is the largest of such affine functions (one per moment), a convex function of ``b``: between two
traced microbatches the line lies on or above it (never an under-estimate), beyond them it is exact while the
same moment stays the peak. ``tests/derivations/estimate/test_fitmodel.py`` checks the model against full traces
(within 0.5 %; for the architectures tested it is exact to the byte beyond two rows).

One regime boundary is known in advance: a batch of one row is never padded (no attention mask, one sequence per
row: :attr:`ledgerspec.contract.config.Workload.pads_rows`), so with padded batches ``microbatch 1`` is a regime of
its own; it is only ever read from its own trace, never from the line through two padded batches.

Pure arithmetic over the figures of :class:`~ledgerspec.derivations.estimate.estimator.Estimate`; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ledgerspec.contract import fields as F
from ledgerspec.derivations.estimate.fit import ALL_PHASES

#: the components an estimate splits a phase's peak into (``at.PHASE.COMPONENT`` figures): the ledger's
AT_PEAK = F.COMPONENTS


@dataclass(frozen=True)
class Sample:
    """One traced estimate: its microbatch and every figure (:attr:`Estimate.figures`)."""

    microbatch: int
    figures: Mapping[str, int]


@dataclass
class BatchModel:
    """Every figure as an affine function of the microbatch, within a padding regime (see the module docstring).

    ``padded``: batches of more than one row are padded (microbatch 1 is then its own regime).
    """

    samples: list[Sample]
    padded: bool
    _by_b: dict[int, Sample] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_b = {s.microbatch: s for s in self.samples}

    def regime(self, b: int) -> int:
        """0 for a one-row batch of a padded workload, 1 otherwise."""
        return 0 if self.padded and b == 1 else 1

    def traced(self, b: int) -> bool:
        return b in self._by_b

    def can_predict(self, b: int) -> bool:
        return self.traced(b) or len(self._line(b)) == 2

    def _line(self, b: int) -> list[Sample]:
        """The two samples of ``b``'s regime nearest to it (fewer when the regime has fewer)."""
        same = [s for s in self.samples if self.regime(s.microbatch) == self.regime(b) and s.microbatch >= 1]
        same.sort(key=lambda s: (abs(s.microbatch - b), s.microbatch))
        if len(same) < 2:
            return same
        first = same[0]
        second = next((s for s in same[1:] if s.microbatch != first.microbatch), None)
        return [first, second] if second is not None else [first]

    def figures(self, b: int) -> dict[str, int]:
        """Every figure at microbatch ``b``: the trace when there is one, else the line through two of its regime."""
        if b < 1:
            raise ValueError("microbatch must be >= 1")
        if b in self._by_b:
            return dict(self._by_b[b].figures)
        line = self._line(b)
        if len(line) < 2:
            raise ValueError(f"no two traced microbatches in the regime of microbatch {b}: trace it")
        s1, s2 = line
        span = s2.microbatch - s1.microbatch
        keys = set(s1.figures) & set(s2.figures)
        return {
            k: _round(s1.figures[k] + Fraction((b - s1.microbatch) * (s2.figures[k] - s1.figures[k]), span))
            for k in sorted(keys)
        }

    def phases(self, b: int) -> dict[str, int]:
        figures = self.figures(b)
        return {k: figures[k] for k in ALL_PHASES if k in figures}

    def peak(self, b: int) -> int:
        return max(self.phases(b).values())

    def peak_phase(self, b: int) -> str:
        phases = self.phases(b)
        return max(phases, key=lambda k: phases[k])

    def at_peak(self, b: int) -> dict[str, int]:
        """What is alive at the peak of microbatch ``b``, by component (they add up to the peak)."""
        figures = self.figures(b)
        phase = self.peak_phase(b)
        return {c: figures.get(f"at.{phase}.{c}", 0) for c in AT_PEAK}

    def slope(self) -> Fraction | None:
        """Bytes of peak per extra row, in the padded (or only) regime: None without two samples there."""
        line = [s for s in self.samples if self.regime(s.microbatch) == 1]
        if len({s.microbatch for s in line}) < 2:
            return None
        line.sort(key=lambda s: s.microbatch)
        a, b = line[0], line[-1]
        return Fraction(_peak(b.figures) - _peak(a.figures), b.microbatch - a.microbatch)

    def largest_fitting(self, device_memory: int, limit: int = 1 << 20) -> int | None:
        """The largest microbatch whose peak (every phase) fits ``device_memory``, up to ``limit``; None when not even
        the smallest one it can predict fits. Microbatch 1 of a padded workload counts only when traced."""
        best: int | None = None
        if self.traced(1) and self.peak(1) <= device_memory:
            best = 1
        line = [s for s in self.samples if self.regime(s.microbatch) == 1]
        if len({s.microbatch for s in line}) < 2:
            fitting = [s.microbatch for s in line if _peak(s.figures) <= device_memory]
            return max([*fitting, *([best] if best else [])], default=None)
        start = 2 if self.padded else 1
        if self.peak(start) > device_memory:
            return best
        low, high = start, limit  # the peak grows with b: bisection on the model (arithmetic only, no trace)
        if self.peak(high) <= device_memory:
            return high
        while high - low > 1:
            mid = (low + high) // 2
            if self.peak(mid) <= device_memory:
                low = mid
            else:
                high = mid
        return low


#: the phase a trace runs at the typical length (the steady-state step); every other figure is of the worst length
STEADY = "steady_state_peak"


def typical_key(key: str) -> bool:
    """Whether figure ``key`` belongs to the steady-state step, traced at the typical length
    (:func:`ledgerspec.derivations.engine.protocol.run_protocol`: the first step runs at ``max_length``, the
    repeated steps at ``min(sequence_p50, max_length)``)."""
    return key == STEADY or key.startswith(f"at.{STEADY}.")


@dataclass(frozen=True)
class GridSample:
    """One traced estimate of a grid: its microbatch, worst length, typical length and every figure."""

    microbatch: int
    length: int
    typical: int
    figures: Mapping[str, int]


class GridModel:
    """Every figure over (microbatch, max_length), from estimates traced at a few lengths (see the module docstring).

    Along the microbatch: one :class:`BatchModel` per traced (length, typical) pair. Along the length: each figure
    is a polynomial of its own length, the worst one (``max_length``: every phase of the first step) or the typical
    one (the steady-state step), of degree at most 2 (what is alive is in span{1, L, L^2} times {1, b}: hidden
    states, logits, attention workspaces, ``L x L`` masks and scores); it is read exactly at a traced length and
    through the (at most three) nearest traced lengths in between. A trace's typical length is chosen apart from its
    worst one (``sequence_p50`` of the traced variant), so a sweep's few traces can cover every typical length it
    needs exactly. Lengths outside the traced ones are refused (interpolation only).
    """

    def __init__(self, samples: Sequence[GridSample], padded: bool) -> None:
        self.samples = list(samples)
        self.padded = padded
        groups: dict[tuple[int, int], list[Sample]] = {}
        for s in self.samples:
            groups.setdefault((s.length, s.typical), []).append(Sample(s.microbatch, s.figures))
        self.models = {key: BatchModel(members, padded) for key, members in groups.items()}

    def traced(self, b: int, length: int, typical: int) -> bool:
        return any(s.microbatch == b and s.length == length and s.typical == typical for s in self.samples)

    def can_predict(self, b: int, length: int, typical: int) -> bool:
        try:
            self.figures(b, length, typical)
        except ValueError:
            return False
        return True

    def figures(self, b: int, length: int, typical: int) -> dict[str, int]:
        """Every figure at (``b``, ``length``, ``typical``)."""
        at = {key: model.figures(b) for key, model in self.models.items() if model.can_predict(b)}
        if not at:
            raise ValueError(f"no traced length can predict microbatch {b}")
        keys = set.intersection(*(set(f) for f in at.values()))
        worst = _nodes({L: f for (L, _), f in at.items()}, length, "max_length")
        steady = _nodes({t: f for (_, t), f in at.items()}, typical, "typical length")
        out = {}
        for k in sorted(keys):
            nodes = steady if typical_key(k) else worst
            out[k] = _round(sum((w * f[k] for w, f in nodes), Fraction(0)))
        return out

    def phases(self, b: int, length: int, typical: int) -> dict[str, int]:
        figures = self.figures(b, length, typical)
        return {k: figures[k] for k in ALL_PHASES if k in figures}

    def at_peak(self, b: int, length: int, typical: int) -> dict[str, int]:
        figures = self.figures(b, length, typical)
        phases = {k: figures[k] for k in ALL_PHASES if k in figures}
        phase = max(phases, key=lambda k: phases[k])
        return {c: figures.get(f"at.{phase}.{c}", 0) for c in AT_PEAK}


def _nodes(by_length: Mapping[int, Mapping[str, int]], x: int, what: str) -> list[tuple[Fraction, Mapping[str, int]]]:
    """Lagrange weights of the traced lengths nearest to ``x`` (``x`` itself when traced; else the three nearest,
    or two when only two were traced), with their figures."""
    if x in by_length:
        return [(Fraction(1), by_length[x])]
    known = sorted(by_length)
    if len(known) < 2 or not known[0] < x < known[-1]:
        raise ValueError(f"{what} {x} is outside the traced lengths {known}: trace it")
    chosen = sorted(sorted(known, key=lambda n: (abs(n - x), n))[:3])
    if not chosen[0] < x < chosen[-1]:  # keep x inside the chosen nodes: interpolation, never extrapolation
        below = max(n for n in known if n < x)
        above = min(n for n in known if n > x)
        third = [n for n in chosen if n not in (below, above)][:1]
        chosen = sorted({below, above, *third})
    weights = []
    for i, xi in enumerate(chosen):
        w = Fraction(1)
        for j, xj in enumerate(chosen):
            if i != j:
                w *= Fraction(x - xj, xi - xj)
        weights.append((w, by_length[xi]))
    return weights


def _peak(figures: Mapping[str, int]) -> int:
    return max(figures[k] for k in ALL_PHASES if k in figures)


def _round(x: Fraction) -> int:
    """Nearest integer (halves up): a byte count."""
    return int(x + Fraction(1, 2)) if x >= 0 else -int(-x + Fraction(1, 2))


__all__ = ["AT_PEAK", "STEADY", "BatchModel", "GridModel", "GridSample", "Sample", "typical_key"]
