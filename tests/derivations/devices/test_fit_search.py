"""Which values ``estimate --fit`` checks on the device (:func:`ledgerspec.derivations.devices.fit_check.
check_on_device`): whatever the device peak does between the values checked, the answer is the largest value whose
check fits, found by brute force over the same device peaks; a peak that grows about linearly takes few checks.

The verdicts come from a stand-in for the microbatch streams (each value's device peak a known function of the
microbatch): what is checked here is the search, not a replay (test_fit_check.py and test_along.py replay)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ledgerspec.derivations.devices.fit_check import TRIES, check_on_device
from ledgerspec.derivations.estimate.search import FitAnswer
from tests.support.predictions import fake_prediction

GiB = 2**30
TOTAL = 24 * GiB


class Device:
    """Device verdicts from ``peak(b)`` (bytes) against :data:`TOTAL`, counting what was asked."""

    def __init__(self, peak: Callable[[int], int]) -> None:
        self.peak = peak
        self.asked: list[int] = []

    def on_device(self, b: int, memory: int, from_flag: bool = False) -> Any:
        self.asked.append(b)
        peak = self.peak(b)
        return fake_prediction(peak <= TOTAL, peak, TOTAL - peak, capacity=TOTAL)

    def settle(self) -> bool:
        """Its verdicts are final (no line's check to wait for)."""
        return True


def _answer(largest: int) -> FitAnswer:
    """The allocated answer: ``largest`` fits the device's memory, from traces at 2 and ``largest`` (allocated
    bytes 0.76 GiB a row above 4 GiB)."""
    peaks = {b: int(4 * GiB + 0.76 * GiB * b) for b in (2, largest)}
    return FitAnswer("microbatch", TOTAL, largest, peaks[largest], None, None, traced=[2, largest], peaks=peaks)


PEAKS: dict[str, Callable[[int], int]] = {
    # the 7B QLoRA of benchmarks/estimate_fit.py: about 1.04 GiB a row on the device
    "linear": lambda b: int(3.2 * GiB + 1.04 * GiB * b),
    # fragmentation: a jump where a new segment is needed
    "jump": lambda b: int(3.2 * GiB + 1.0 * GiB * b + (1.5 * GiB if b >= 19 else 0)),
    "convex": lambda b: int(3 * GiB + 0.4 * GiB * b + 0.03 * GiB * b * b),
    "nothing fits": lambda b: int(30 * GiB + b),
    "all fit": lambda b: int(10 * GiB + b),
}


@pytest.mark.parametrize("name", list(PEAKS))
def test_the_answer_is_the_largest_value_whose_check_fits(name: str) -> None:
    device = Device(PEAKS[name])
    allocated = 26
    result = check_on_device(None, _answer(allocated), TOTAL, along=device)  # type: ignore[arg-type]
    fitting = [b for b in range(1, allocated + 1) if device.peak(b) <= TOTAL]
    truth = max(fitting, default=None)
    assert len(device.asked) <= TRIES and len(set(device.asked)) == len(device.asked)
    if result.exhausted:  # stopped after TRIES values: the answer is the largest checked that fits, below the truth
        assert name == "nothing fits" and result.largest is None
        return
    assert result.largest == truth, device.asked
    if truth is not None and truth < allocated:
        assert truth + 1 in device.asked  # the value above it was checked and does not fit


def test_a_linear_device_peak_takes_four_checks_or_fewer() -> None:
    """The allocated answer, one step down by what it lacked, the line through the two, and that guess's neighbour:
    26, 17, 20, 21 (the bisection it replaced checked 26, 17, 21, 19, 20)."""
    device = Device(PEAKS["linear"])
    check_on_device(None, _answer(26), TOTAL, along=device)  # type: ignore[arg-type]
    assert device.asked == [26, 17, 20, 21]


def test_a_value_between_two_checked_ones_is_strictly_between_them() -> None:
    """Whatever the step and the gap (a length step that does not divide it), the next value is above the fitting
    one and below the failing one."""
    from ledgerspec.derivations.devices.fit_check import _between

    for lo, hi, step in ((128, 300, 128), (17, 26, 1), (64, 192, 64), (100, 130, 16)):
        for peak_hi in (GiB, 30 * GiB):
            value = _between(lo, hi, 20 * GiB, max(peak_hi, 20 * GiB + 1), 24 * GiB, step)
            assert lo < value < hi and (value - lo) % step == 0, (lo, hi, step, value)


class EdgeDevice(Device):
    """:class:`Device` with the catalogue's range outside the allocator: ``peak(b)`` counts the typical figure, and a
    value fits only with ``spread`` more (the range's high end); one whose peak fits without it is at the edge."""

    def __init__(self, peak: Callable[[int], int], spread: int) -> None:
        super().__init__(peak)
        self.spread = spread

    def on_device(self, b: int, memory: int, from_flag: bool = False) -> Any:
        self.asked.append(b)
        peak = self.peak(b)
        completes, fits = peak <= TOTAL, peak + self.spread <= TOTAL
        p = fake_prediction(fits, peak, TOTAL - peak, "none" if fits else "outside" if completes else "allocated")
        p.completes, p.uncertain = completes, completes and not fits
        p.outside, p.replayed.outside_high = GiB, GiB + self.spread  # typical 1 GiB, high end 1 GiB + spread
        return p


@pytest.mark.parametrize("name", ["linear", "jump", "convex"])
def test_values_at_the_edge_do_not_fit_and_the_search_aims_below_them(name: str) -> None:
    """With 1.5 GiB of range above the typical figure outside the allocator, the answer is the largest value that fits
    with the range's high end, found as quickly: a value at the edge counts as lacking the range above its margin,
    and the line between two values aims 1.5 GiB below the device's total."""
    spread = int(1.5 * GiB)
    device = EdgeDevice(PEAKS[name], spread)
    result = check_on_device(None, _answer(26), TOTAL, along=device)  # type: ignore[arg-type]
    truth = max(b for b in range(1, 27) if device.peak(b) + spread <= TOTAL)
    assert not result.exhausted and result.largest == truth, device.asked
    assert len(device.asked) <= 4 and truth + 1 in device.asked, device.asked
    edge = [c for c in result.checked if c.uncertain]
    assert all(not c.fits and c.margin >= 0 and c.outside_range == spread for c in edge)
