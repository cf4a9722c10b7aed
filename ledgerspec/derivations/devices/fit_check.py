"""The largest microbatch or length that fits, decided on the device (issue 23): ``estimate --fit`` finds the largest
value whose allocated peak fits (:mod:`ledgerspec.derivations.estimate.search`, from two or more traced estimates and
the microbatch model); :func:`check_on_device` then replays that value's step through the caching-allocator model
with what lies outside the allocator (:func:`ledgerspec.derivations.devices.prediction.estimate_on_device`) and, while
it does not fit, lower values (:func:`check_on_device`), at most :data:`TRIES` of them.

What the device holds is never less than the tensors it holds (the allocator's reserve covers every allocated block,
and the capacity it can get is the device's total minus what lies outside it), so the answer on the device is never
above the allocated one: searching below it finds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.fields import AT_THE_EDGE
from ledgerspec.contract.units import format_size

#: values a check replays at most (each: one estimate with a third probe, and the allocator replays)
TRIES = 5
#: why a check that completes with the typical bytes outside the allocator does not fit (:attr:`Checked.uncertain`)
UNCERTAIN_WHY = (
    "it completes with the typical bytes outside the allocator, not with the high end of the catalogue's range"
)


@dataclass(frozen=True)
class Checked:
    """One value's step on the device (``--fit``: a microbatch or a length; ``--sweep``/``--what-if``: a
    configuration, its point)."""

    value: Any
    fits: bool
    device_peak: int
    margin: int  # the device's total minus the device-level peak (negative: over)
    decided_by: str  # none, allocated, fragmentation or outside (at the edge)
    setting: str | None = None  # when fragmentation decides: the allocator setting that makes it fit by the most
    cached: bool = False
    #: at the edge (so it does not fit): it completes with the outside-allocator catalogue's typical figure, not with
    #: its high one
    uncertain: bool = False
    #: the device the replay decided on, and how it was named (``catalogue``: the card nearest to the memory asked)
    device: str | None = None
    named_by: str = ""
    #: it fits only once the allocator has freed its cached blocks and retried: the cache fills the device
    at_limit: bool = False
    #: the high end of the outside-allocator catalogue's range above the typical figure (0: no range was checked):
    #: what a value at the edge lacks beyond its margin, and what the search aims below the device's total by
    outside_range: int = 0


def checked_of(value: Any, p: Any) -> Checked:
    """The :class:`Checked` of ``value`` from its :class:`~ledgerspec.derivations.devices.prediction.DevicePrediction`
    ``p``."""
    best = p.best_try
    setting = best.conf if best is not None and not p.fits else None
    at_limit = bool(p.completes and p.replayed.free_peak_reserved > p.capacity)
    outside_range = max(0, p.replayed.outside_high - p.outside) if p.replayed.outside_high else 0
    return Checked(
        value, p.fits, p.device_peak, p.margin, p.decided_by, setting, p.cached, p.uncertain,
        p.target.name, p.target.named_by, at_limit, outside_range,
    )  # fmt: skip


def checked_line(subject: str, c: Checked, device_memory: int, said_declared: bool) -> tuple[str, bool]:
    """``on the device: SUBJECT fits|does NOT fit ...`` for one check ``c`` (its ``fits``, ``uncertain``,
    ``decided_by``, ``device_peak``, ``margin`` and ``setting``), and whether the CUDA total has been said beside the
    declared size by now (``said_declared``: said by an earlier line)."""
    # the margin is taken from the device total the replay decided against (CUDA's own for a catalogue card declared
    # by its nominal size: an RTX 4090 declared 24 GiB has 23.64 GiB), so that total is printed
    total = c.device_peak + c.margin
    of = format_size(total)
    device = c.device
    if not said_declared and (total != device_memory or c.named_by == "catalogue"):
        card = f"{device}'s" if device else "its"
        nearest = f", the catalogue's card nearest to {format_size(device_memory)}" if c.named_by == "catalogue" else ""
        of += f" ({card} CUDA total{nearest}; {format_size(device_memory)} declared)"
        said_declared = True
    if c.fits:
        verdict = "fits"
        if c.at_limit:
            verdict += (
                " only at the limit (the allocator's cache fills the device: it frees its cached blocks and retries)"
            )
    elif c.uncertain:
        verdict = f"does NOT fit, {AT_THE_EDGE} ({UNCERTAIN_WHY})"
    elif c.decided_by == "fragmentation":
        verdict = "does NOT fit (fragmentation decides)"
    else:
        verdict = "does NOT fit (its tensors alone exceed what the allocator can get beside what lies outside it)"
    over = f"margin {format_size(c.margin)}" if c.margin >= 0 else f"{format_size(-c.margin)} over"
    line = f"on the device: {subject} {verdict}, device peak {format_size(c.device_peak)} of {of}, {over}" + (
        f"; with PYTORCH_CUDA_ALLOC_CONF={c.setting} it fits" if c.setting else ""
    )
    return line, said_declared


@dataclass
class DeviceFit:
    """The allocated answer of ``--fit NAME`` checked on the device."""

    name: str  # microbatch or max_length
    device_memory: int
    allocated_largest: int | None
    largest: int | None  # the largest checked value that fits on the device (None: none checked does)
    checked: list[Checked] = field(default_factory=list)
    exhausted: bool = False  # stopped after TRIES values without one that fits
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """What ``estimate --fit`` prints under the allocated answer."""
        out = []
        said_declared = False
        for c in self.checked:
            line, said_declared = checked_line(f"{self.name} {c.value}", c, self.device_memory, said_declared)
            out.append(line)
        # the largest checked value above the answer that an allocator setting makes fit (fragmentation decided it)
        rescued = max(
            (c for c in self.checked if not c.fits and c.setting and c.value > (self.largest or 0)),
            key=lambda c: c.value,
            default=None,
        )
        with_setting = (
            f"; {rescued.value} with PYTORCH_CUDA_ALLOC_CONF={rescued.setting}" if rescued is not None else ""
        )
        if self.largest is not None and self.largest != self.allocated_largest:
            failing = [c.value for c in self.checked if not c.fits and c.value > (self.largest or 0)]
            between = (
                f"; not checked between {self.largest} and {min(failing)} after {TRIES} values"
                if self.exhausted and failing
                else ""
            )
            out.append(
                f"largest {self.name} that fits on the device: {self.largest} (the "
                f"allocated tensors alone allow {self.allocated_largest}{with_setting}{between})"
            )
        elif self.largest is not None:
            out.append(f"largest {self.name} that fits on the device: {self.largest} (as the allocated tensors allow)")
        elif self.largest is None and self.checked:
            lowest = self.checked[-1].value
            out.append(
                f"no {self.name} checked fits on the device (down to {lowest}"
                + (f", after {TRIES} values" if self.exhausted else "")
                + with_setting
                + ")"
            )
        return out

    def to_extension(self) -> dict[str, Any]:
        """``x-fit.NAME.device``: the answer on the device and each value checked."""
        first = self.checked[0] if self.checked else None
        return {
            "largest": self.largest,
            "compared": "x-estimate.device_peak of each checked value (allocator model + outside the allocator)",
            **({"card": first.device} if first is not None and first.device else {}),
            **({"cuda_total": first.device_peak + first.margin} if first is not None else {}),
            "checked": {
                str(c.value): {"fits": c.fits, "device_peak": c.device_peak, "margin": c.margin}
                | ({"fits_with": c.setting} if c.setting else {})
                | ({"uncertain": True} if c.uncertain else {})
                for c in self.checked
            },
        }


def check_on_device(
    doc: Document,
    answer: Any,
    device_memory: int,
    step: int = 1,
    store: Any = None,
    parallel: bool = False,
    along: Any = None,
    from_flag: bool = False,
    layers: str = "auto",
) -> DeviceFit:
    """Check ``answer`` (a :class:`~ledgerspec.derivations.estimate.search.FitAnswer` for ``doc``) on a device of
    ``device_memory`` bytes, in multiples of ``step`` (1 for the microbatch, the length step for ``max_length``).

    The first value is the allocated answer. While none checked fits, the next is lower by what the last one lacked
    divided by the bytes one step adds (the slope between the answer's two farthest traced values; at least one
    step); once one fits below one that does not, the next is where the line through their device peaks meets the
    device's total (the nearest value strictly between them), and that guess is followed by its neighbour (the value
    above it when it fits, below it when it does not): the answer is usually found in these two values. At most
    :data:`TRIES` values. Where the bytes outside the allocator are the catalogue's range, a value fits only with its
    high end (else it is at the edge): what a value lacks counts that range above the typical figure
    (:attr:`Checked.outside_range`), and the line aims that much below the device's total.
    ``along``: a :class:`~ledgerspec.derivations.devices.along.MicrobatchSteps` of ``doc`` (microbatch only): each
    value's stream from it, synthesised from the microbatches the search traced where that is exact (else traced).
    ``from_flag``: the device memory was asked with ``--device-memory`` (it names the device as the plain estimate
    does: :func:`~ledgerspec.derivations.devices.target.target_of`); ``layers``: as the estimate takes it."""
    import math

    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.estimate.sweep import apply

    started = time.perf_counter()
    result = DeviceFit(answer.name, device_memory, answer.largest, None)
    peaks = {int(v): int(p) for v, p in answer.peaks.items()}
    slope = (peaks[max(peaks)] - peaks[min(peaks)]) / (max(peaks) - min(peaks)) if len(peaks) > 1 else None
    lowest = max(1, step)
    lo: int | None = None  # the largest value checked that fits
    hi: int | None = None  # the smallest value checked that does not
    total: int | None = None  # the device's total the margins are taken from
    guessed = False  # whether the last value checked was a guess between lo and hi (then its neighbour is next)
    value = answer.largest
    while value is not None and len(result.checked) < TRIES:
        if along is not None and answer.name == "microbatch":
            p = along.on_device(value, device_memory, from_flag)
        else:
            _, p = estimate_on_device(
                apply(doc, {answer.name: value}),
                device_memory,
                from_flag,
                layers=layers,
                store=store,
                parallel=parallel,
            )
        checked = checked_of(value, p)
        result.checked.append(checked)
        if p.fits:
            lo = value
            total = p.device_peak + p.margin - checked.outside_range  # the line aims at the range's high end
        else:
            hi = value
        if lo is None:  # nothing fits yet: down by what it lacked (at the edge: the range above its margin)
            lacked = checked.outside_range - p.margin if checked.uncertain else -p.margin
            steps = math.ceil(lacked / slope / step) if slope and slope > 0 else 1
            value = value - max(1, steps) * step
            if value < lowest:
                value = lowest if hi != lowest else None
        elif hi is not None and hi - lo > step:  # one fits, one above it does not: between them
            if guessed:  # the guess's neighbour, on the side the answer lies
                value = value + step if p.fits else value - step
                guessed = False
            else:
                peak = {c.value: c.device_peak for c in result.checked}
                value = _between(lo, hi, peak[lo], peak[hi], total, step)
                guessed = True
        else:
            value = None
    if along is not None and not along.settle():
        # a line's check failed after verdicts written from it were used: asked again, those values traced
        again = check_on_device(doc, answer, device_memory, step, store, parallel, along, from_flag, layers)
        again.seconds = time.perf_counter() - started
        return again
    result.largest = lo
    result.exhausted = value is not None
    result.seconds = time.perf_counter() - started
    return result


def _between(lo: int, hi: int, peak_lo: int, peak_hi: int, total: int | None, step: int) -> int:
    """The next value strictly between ``lo`` (fits) and ``hi`` (does not), in multiples of ``step`` from ``lo``:
    the nearest to where the line through their device peaks meets ``total`` (the middle when the peaks give no
    line)."""
    gaps = (hi - lo) // step
    if total is None or peak_hi <= peak_lo:
        k = gaps // 2
    else:
        k = round((total - peak_lo) * gaps / (peak_hi - peak_lo))
    return lo + min(max(k, 1), (hi - lo - 1) // step) * step  # strictly below hi, whatever hi - lo is


__all__ = ["TRIES", "UNCERTAIN_WHY", "Checked", "DeviceFit", "check_on_device", "checked_line", "checked_of"]
