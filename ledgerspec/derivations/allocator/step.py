"""The estimate's simulated training step as an allocation event stream, replayed through the allocator model.

:func:`step_events` traces the step exactly as :func:`ledgerspec.derivations.estimate.estimator.trace` does (same
workload, same modelling layers, same protocol), with a tracker that keeps its event log
(:class:`ledgerspec.derivations.engine.tracker.MemoryTracker` ``events=True``) and a phase marker at every window
of the protocol (each ``reset_peak``: load, adapter injection, optimizer init, forward and loss+backward of each
micro-step, optimizer step, then the steady-state step). :func:`replay_step` replays it and folds the windows
into the protocol's phases the way the protocol does (held bytes for ``after_*``, peaks for the others), so the
replay's allocated figures can be set beside the tracker's and its reserved figures read off.

The stream is that of the traced depth: the estimate's probes have fewer decoder layers than the model
(:mod:`ledgerspec.derivations.estimate.extrapolate`); ``layers=None`` traces the model's own depth, an integer that
many layers. A full-depth stream from the two probes is not built yet. What a diff of the probes' streams shows
(tiny Llama, 2, 3 and 4 layers, signatures ``(alloc|free, bytes)``): in every forward and loss+backward window the
deeper stream is the shallower one with one contiguous block inserted, of the same length per added layer (95
events forward, 181 backward), so those windows extend by repeating the block with fresh ids (the backward
copies freeing the forward copies last-in first-out); the optimizer windows do not (foreach kernels allocate one
tensor per parameter inside each op, and a few buffers grow with the parameter count: four to six insertions and
replacements per window), and need a third probe or per-parameter tags to be extended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.allocator.config import AllocatorConfig
from ledgerspec.derivations.allocator.replay import Event, ReplayResult, replay

#: the protocol's phases (:data:`ledgerspec.derivations.engine.protocol.PHASES`) whose figure is held at the end
HELD = ("after_load", "after_adapter_injection", "after_optimizer_init")


@dataclass
class StepEvents:
    """A traced step: its event stream, the window labels in order, the tracker's own figures."""

    events: list[Event]
    windows: list[str]
    accumulation: int
    #: the estimate's figures of this trace (:func:`ledgerspec.derivations.estimate.estimator.trace`)
    figures: dict[str, int]
    #: the tracker's peak and held bytes per window (its own bookkeeping, independent of the replay)
    tracker_windows: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class PhaseFigures:
    allocated: int  # the protocol's figure: held bytes for after_*, else the peak
    reserved: int  # peak reserved during the phase


@dataclass
class StepReplay:
    step: StepEvents
    replay: ReplayResult
    phases: dict[str, PhaseFigures]


@cache
def _event_backend_class() -> Any:
    from ledgerspec.derivations.engine.backends import TrackerBackend
    from ledgerspec.derivations.engine.tracker import MemoryTracker

    class EventBackend(TrackerBackend):
        """A fake-tensor tracker backend that logs allocations and marks each protocol window."""

        def __init__(self, granularity: int) -> None:
            super().__init__(fake=True, granularity=granularity)
            self.tracker = MemoryTracker(granularity=granularity, events=True)
            self.context = "temporary"
            self.windows: list[str] = []
            self.window_figures: dict[str, tuple[int, int]] = {}

        def set_context(self, category: str) -> None:
            self.context = category
            super().set_context(category)

        def reset_peak(self) -> None:
            self.close_window()
            label = f"{len(self.windows)}:{self.context}"
            self.windows.append(label)
            self.tracker.mark(label)
            super().reset_peak()

        def close_window(self) -> None:
            if self.windows:
                self.window_figures[self.windows[-1]] = (self.tracker.peak, self.tracker.current)

    return EventBackend


def step_events(doc: Document, layers: int | None = None, target: str = "cuda", offline: bool = True) -> StepEvents:
    """Trace ``doc``'s step (``layers`` decoder layers; None: as many as the model has) with the event log on."""
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.estimate import estimator
    from ledgerspec.derivations.estimate.extrapolate import with_layers
    from ledgerspec.derivations.stack.build import ModelSource, load_config

    spec = WorkloadSpec.from_document(doc)
    source = load_config(doc, offline=offline)
    if layers is not None:
        source = ModelSource(with_layers(source.config, layers), source.config_file, source.sha256, source.architecture)
    backend = _event_backend_class()(estimator.granularity(target))
    keep = estimator._keeps_4bit_input(doc, spec)
    figures = estimator.trace(doc, spec, source, target, keep, backend=backend)
    backend.close_window()
    events = backend.tracker.events
    assert events is not None
    return StepEvents(list(events), list(backend.windows), min(spec.accumulation, 2), figures, backend.window_figures)


def protocol_windows(windows: list[str], accumulation: int, steps: int = 1) -> dict[str, list[str]]:
    """Which windows make up each protocol phase (the order :func:`ledgerspec.derivations.engine.protocol._phases`
    runs them in); raises ValueError when the windows are not that order."""
    micro = ["activations", "temporary"] * accumulation
    expected = ["frozen_params", "adapter", "optimizer", *micro, "optimizer", *([*micro, "optimizer"] * steps)]
    contexts = [w.split(":", 1)[1] for w in windows]
    if contexts != expected:
        raise ValueError(f"unexpected protocol windows {contexts} (expected {expected})")
    first = 3 + 2 * accumulation
    return {
        "after_load": [windows[0]],
        "after_adapter_injection": [windows[1]],
        "after_optimizer_init": [windows[2]],
        "forward_peak": windows[3:first:2],
        "backward_peak": windows[4:first:2],
        "optimizer_step_peak": [windows[first]],
        "steady_state_peak": windows[first + 1 :],
    }


def replay_step(
    doc: Document,
    layers: int | None = None,
    config: AllocatorConfig | str | None = None,
    capacity: int | None = None,
    device_total: int | None = None,
    target: str = "cuda",
    step: StepEvents | None = None,
) -> StepReplay:
    """The estimate's step (traced now, or ``step``) replayed through the allocator: per protocol phase the
    allocated figure (as the protocol defines it) and the peak reserved bytes, and the first OOM if any."""
    traced = step if step is not None else step_events(doc, layers, target)
    result = replay(traced.events, config, capacity, device_total)
    phases: dict[str, PhaseFigures] = {}
    for name, labels in protocol_windows(traced.windows, traced.accumulation).items():
        parts = [result.phases[label] for label in labels if label in result.phases]
        if not parts:
            continue
        allocated = parts[-1].end_allocated if name in HELD else max(p.peak_allocated for p in parts)
        phases[name] = PhaseFigures(allocated, max(p.peak_reserved for p in parts))
    return StepReplay(traced, result, phases)


__all__ = ["HELD", "PhaseFigures", "StepEvents", "StepReplay", "protocol_windows", "replay_step", "step_events"]
