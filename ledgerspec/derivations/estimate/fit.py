"""Does an estimate fit a device, and if not, which phase runs out first (pure arithmetic, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ledgerspec.contract.fields import AT_THE_EDGE, PHASE_OOM_WORDS

#: the protocol's phases in the order a training run goes through them
PHASES = (
    "after_load",
    "after_adapter_injection",
    "after_optimizer_init",
    "forward_peak",
    "backward_peak",
    "optimizer_step_peak",
    "steady_state_peak",
)
#: every phase a step may have, in order: online RL (GRPO) has a generation phase before its forward
ALL_PHASES = (*PHASES[:3], "generation_peak", *PHASES[3:])
#: the ``result.oom_phase`` word of each phase (the spec's vocabulary)
OOM_PHASE = PHASE_OOM_WORDS


@dataclass(frozen=True)
class Fit:
    """The verdict for one device: ``headroom`` is negative when it does not fit (but for a device verdict at the
    edge, :func:`~ledgerspec.derivations.shard.simulation.device_fit`)."""

    device_memory: int
    peak: int
    fits: bool
    headroom: int
    oom_phase: str | None  # the spec word (load, forward, backward, ...) of the first phase over the device
    oom_phase_key: str | None  # the ``phases`` key of that phase

    def sentence(self) -> str:
        from ledgerspec.contract.units import format_size

        if self.fits:
            return (
                f"fits: predicted peak {format_size(self.peak)} of {format_size(self.device_memory)}, "
                f"headroom {format_size(self.headroom)}"
            )
        if self.headroom >= 0:  # a device verdict at the edge (simulation.device_fit): it completes, yet does not fit
            return (
                f"does NOT fit, {AT_THE_EDGE}: predicted peak {format_size(self.peak)} of "
                f"{format_size(self.device_memory)} with the typical bytes outside the allocator, not with the high "
                "end of the catalogue's range"
            )
        return (
            f"does NOT fit: predicted peak {format_size(self.peak)} is {format_size(-self.headroom)} over "
            f"{format_size(self.device_memory)}; first out of memory in phase {self.oom_phase} "
            f"({self.oom_phase_key})"
        )


def fit(phases: Mapping[str, int], device_memory: int) -> Fit:
    """The verdict for ``device_memory`` bytes given predicted phase peaks (bytes allocated)."""
    if device_memory <= 0:
        raise ValueError("device memory must be positive")
    ordered = [(k, phases[k]) for k in ALL_PHASES if k in phases]
    if not ordered:
        raise ValueError("no phase peaks to compare")
    peak = max(v for _, v in ordered)
    first = next((k for k, v in ordered if v > device_memory), None)
    return Fit(device_memory, peak, first is None, device_memory - peak, OOM_PHASE[first] if first else None, first)
