"""A stand-in for :class:`ledgerspec.derivations.devices.prediction.DevicePrediction` in tests of what is built on
its verdicts (``fit_check``, ``sweep_check``): the attributes :func:`~ledgerspec.derivations.devices.fit_check.
checked_of` reads, nothing traced or replayed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def fake_prediction(
    fits: bool,
    device_peak: int = 1,
    margin: int | None = None,
    decided_by: str | None = None,
    capacity: int | None = None,
    reserved: int | None = None,
) -> Any:
    """A verdict that ``fits`` or not, ``device_peak`` bytes with ``margin`` to spare (default 0 when it fits, -1
    when not), decided by ``decided_by`` (default ``none`` / ``allocated``), no allocator setting tried, not cached,
    not uncertain, on an unnamed device whose allocator can get ``capacity`` bytes (default the device peak) and
    reserved ``reserved`` without a limit (default the device peak: not at the limit)."""
    return SimpleNamespace(
        fits=fits,
        completes=fits,
        device_peak=device_peak,
        margin=(0 if fits else -1) if margin is None else margin,
        decided_by=decided_by or ("none" if fits else "allocated"),
        best_try=None,
        cached=False,
        uncertain=False,
        capacity=device_peak if capacity is None else capacity,
        outside=0,
        replayed=SimpleNamespace(free_peak_reserved=device_peak if reserved is None else reserved, outside_high=0),
        target=SimpleNamespace(name=None, named_by="none"),
    )
