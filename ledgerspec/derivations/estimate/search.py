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
- :func:`sweep_plan` / :func:`sweep_rows`: the Memory Sensitivity Matrix with the microbatch axis from the model:
  two estimates per combination of the other axes (plus microbatch 1 when batches are padded), not one per cell.

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
from ledgerspec.derivations.estimate.fitmodel import BatchModel, Sample
from ledgerspec.derivations.estimate.sweep import apply

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
            return f"no {self.name} fits {mem}{at}"
        text = (
            f"largest {self.name} that fits {mem}: {self.largest} (peak {format_size(self.peak or 0)}, "
            f"{self.how(self.largest)})"
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


def fit_microbatch(
    doc: Document, device_memory: int, estimate_fn: EstimateFn, exact: bool = False, **values: Any
) -> FitAnswer:
    """The largest microbatch that fits ``device_memory`` (other inputs as ``doc`` declares them, or ``values``)."""
    import time

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


def sweep_rows(doc: Document, points: Sequence[dict[str, Any]], estimate_fn: EstimateFn) -> tuple[list[SweepRow], int]:
    """Every point of a sweep, the microbatch axis from a :class:`BatchModel` per combination of the other axes;
    the rows in the points' order and how many estimates were traced."""
    groups: dict[tuple[tuple[str, Any], ...], list[dict[str, Any]]] = {}
    for p in points:
        key = tuple((k, v) for k, v in p.items() if k != "microbatch")
        groups.setdefault(key, []).append(p)
    pads = padded(doc)
    rows: dict[int, SweepRow] = {}
    traces = 0
    declared = config.read(doc).workload.microbatch or 1
    for key, members in groups.items():
        others = dict(key)
        bs = [int(p.get("microbatch", declared)) for p in members]
        if any("microbatch" not in p for p in members):  # microbatch is not an axis: one estimate per point
            for p in members:
                est = estimate_fn(apply(doc, p))
                traces += 1
                rows[id(p)] = SweepRow(p, dict(est.phases), dict(est.at_peak), True)
            continue
        model = batch_model(doc, design(bs, pads), estimate_fn, **others)
        traces += len(model.samples)
        for p, b in zip(members, bs, strict=True):
            rows[id(p)] = SweepRow(p, model.phases(b), model.at_peak(b), model.traced(b))
    return [rows[id(p)] for p in points], traces


__all__ = ["FitAnswer", "SweepRow", "batch_model", "design", "fit_length", "fit_microbatch", "sweep_rows"]
