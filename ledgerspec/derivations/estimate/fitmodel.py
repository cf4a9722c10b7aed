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

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from ledgerspec.derivations.estimate.fit import PHASES

#: the components an estimate splits a phase's peak into (``at.PHASE.COMPONENT`` figures)
AT_PEAK = ("frozen_base", "adapter", "gradients", "optimizer", "activations", "temporary")


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
        return {k: figures[k] for k in PHASES if k in figures}

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


def _peak(figures: Mapping[str, int]) -> int:
    return max(figures[k] for k in PHASES if k in figures)


def _round(x: Fraction) -> int:
    """Nearest integer (halves up): a byte count."""
    return int(x + Fraction(1, 2)) if x >= 0 else -int(-x + Fraction(1, 2))


__all__ = ["AT_PEAK", "BatchModel", "Sample"]
