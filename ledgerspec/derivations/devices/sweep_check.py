"""The largest configuration of a sweep or a what-if, decided on the device (issue 23).

``estimate --sweep`` and ``estimate --what-if`` estimate every configuration's allocated peak (from a few traced
streams); the one they name is the configuration with the most tokens per micro-step whose allocated peak fits
(:func:`ledgerspec.derivations.estimate.sweep.fitting_in_order`). On a CUDA target :func:`check_configurations`
then replays those configurations, best first, through the caching-allocator model with what lies outside the
allocator (:func:`ledgerspec.derivations.devices.prediction.estimate_on_device`, each one estimate with a third probe,
through the estimate cache) until one fits on the device, at most :data:`TRIES` of them.

A configuration whose allocated peak does not fit cannot fit on the device (the allocator's reserve covers every
allocated block, and the capacity it can get is the device's total minus what lies outside it), so the first one
in that order that fits on the device is the answer on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.units import format_size
from ledgerspec.derivations.devices.fit_check import TRIES, Checked, checked_line, checked_of

#: a table's peak may come from the microbatch model rather than a trace (within 0.5 % of full traces in tests): a
#: configuration is ruled out without a replay only when its peak exceeds what the allocator can get by more than that
MODELLED = 0.005
#: configurations named in the line of those ruled out without a replay
SHOWN = 4


@dataclass
class ConfigurationsOnDevice:
    """The configurations whose allocated peak fits, checked on the device best first."""

    device_memory: int
    allocated_best: dict[str, Any] | None  # the table's answer: the best configuration whose allocated peak fits
    best: dict[str, Any] | None = None  # the best checked configuration that fits on the device
    checked: list[Checked] = field(default_factory=list)  # each value: a configuration (its point)
    left: int = 0  # configurations whose allocated peak fits, not checked (after TRIES without one that fits)
    #: configurations not replayed: their allocated peak exceeds what the allocator can get (the device's CUDA total
    #: minus what lies outside the allocator), so they cannot fit on the device
    beyond: list[tuple[dict[str, Any], int, int, int]] = field(default_factory=list)  # point, cuda total, outside, peak
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """What the sweep and the what-if print under their table."""
        from ledgerspec.derivations.estimate.sweep import describe

        out = []
        if self.beyond:
            _, total, outside, _ = self.beyond[0]
            capacity = total - outside
            why = (
                "their allocated tensors alone exceed what the allocator can get"
                if len({(t, o) for _, t, o, _ in self.beyond}) > 1
                else f"what lies outside the allocator, {format_size(outside)}, fills the device's {format_size(total)}"
                if capacity <= 0
                else f"their allocated tensors alone exceed what the allocator can get, {format_size(capacity)} "
                f"({format_size(total)} less {format_size(outside)} outside it)"
            )
            named = "; ".join(f"{describe(p)} ({format_size(peak)})" for p, _, _, peak in self.beyond[:SHOWN])
            more = f"; and {len(self.beyond) - SHOWN} more" if len(self.beyond) > SHOWN else ""
            out.append(f"on the device: does NOT fit, not replayed ({why}): {named}{more}")
        said_declared = False
        for c in self.checked:
            line, said_declared = checked_line(describe(c.value), c, self.device_memory, said_declared)
            out.append(line)
        if self.best is not None:
            chosen = next(c for c in self.checked if c.value is self.best)
            out.append(
                f"largest configuration that fits on the device: {describe(self.best)} "
                f"(device peak {format_size(chosen.device_peak)})"
            )
            with_setting = next((c for c in self.checked if not c.fits and c.setting), None)
            if with_setting is not None:  # checked before the answer: more tokens, if a setting is changed
                out.append(
                    f"  with PYTORCH_CUDA_ALLOC_CONF={with_setting.setting}: {describe(with_setting.value)} fits "
                    "instead (above)"
                )
        elif self.checked or self.beyond:
            counted = ", ".join(
                part
                for part in (
                    f"{len(self.checked)} replayed" if self.checked else "",
                    f"{len(self.beyond)} ruled out without a replay" if self.beyond else "",
                )
                if part
            )
            out.append(
                f"no configuration checked fits on the device ({counted}"
                + (
                    f"; {self.left} more whose allocated tensors fit not checked: narrow the sweep to them, or "
                    "`--fit microbatch` searches below on the device"
                    if self.left
                    else ""
                )
                + ")"
            )
        return out

    def to_extension(self) -> dict[str, Any]:
        """The answer on the device and each configuration checked (``x-what-if.device``)."""
        return (
            {
                "largest": dict(self.best) if self.best is not None else None,
                "compared": "x-estimate.device_peak of each checked configuration (allocator model + outside the "
                "allocator)",
                "checked": [
                    {"point": dict(c.value), "fits": c.fits, "device_peak": c.device_peak, "margin": c.margin}
                    | ({"fits_with": c.setting} if c.setting else {})
                    | ({"uncertain": True} if c.uncertain else {})
                    for c in self.checked
                ],
            }
            | (
                {
                    "not_replayed": [
                        {"point": dict(point), "peak_allocated": peak, "capacity": total - outside}
                        for point, total, outside, peak in self.beyond
                    ]
                }
                if self.beyond
                else {}
            )
            | ({"not_checked": self.left} if self.left else {})
        )


def check_configurations(
    doc: Document,
    rows: Sequence[tuple[dict[str, Any], int]],
    device_memory: int,
    from_flag: bool = False,
    store: Any = None,
    parallel: bool = False,
    layers: str = "auto",
) -> ConfigurationsOnDevice:
    """Check ``rows`` (each configuration of ``doc`` as :func:`ledgerspec.derivations.estimate.sweep.apply` makes
    it, with its allocated peak) on a device of ``device_memory`` bytes (``from_flag``: asked with
    ``--device-memory``, see :func:`~ledgerspec.derivations.devices.target.target_of`): those whose allocated peak
    fits, best first, until one fits on the device, at most :data:`TRIES` replayed (``layers``: as the estimate takes
    it). One whose allocated peak exceeds what the allocator can get there (the device's CUDA total less what lies
    outside the allocator, known without a trace) by more than :data:`MODELLED` cannot fit: it is said so and not
    replayed."""
    from ledgerspec.derivations.devices.prediction import device_question, estimate_on_device
    from ledgerspec.derivations.estimate.sweep import apply, fitting_in_order

    started = time.perf_counter()
    order = fitting_in_order(rows, doc, device_memory)
    result = ConfigurationsOnDevice(device_memory, order[0][0] if order else None)
    replayed = 0
    for i, (point, peak) in enumerate(order):
        if replayed == TRIES:
            result.left = len(order) - i
            break
        variant = apply(doc, point)
        named, figure, _, _ = device_question(variant, device_memory, from_flag, layers=layers)  # no trace
        if peak > (named.cuda_total - figure.bytes) * (1 + MODELLED):  # the tensors alone exceed what it can get
            result.beyond.append((point, named.cuda_total, figure.bytes, peak))
            continue
        replayed += 1
        _, p = estimate_on_device(variant, device_memory, from_flag, layers=layers, store=store, parallel=parallel)
        result.checked.append(checked_of(point, p))
        if p.fits:
            result.best = point
            break
    result.seconds = time.perf_counter() - started
    return result


__all__ = ["ConfigurationsOnDevice", "check_configurations"]
