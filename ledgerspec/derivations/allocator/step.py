"""The estimate's simulated training step as an allocation event stream, replayed through the allocator model.

:func:`step_events` traces the step exactly as :func:`ledgerspec.derivations.estimate.estimator.trace` does (same
workload, same modelling layers, same protocol), with a tracker that keeps its event log
(:class:`ledgerspec.derivations.engine.tracker.MemoryTracker` ``events=True``) and a phase marker at every window
of the protocol (each ``reset_peak``: load, adapter injection, optimizer init, forward and loss+backward of each
micro-step, optimizer step, then the steady-state step). :func:`replay_step` replays it and folds the windows
into the protocol's phases the way the protocol does (held bytes for ``after_*``, peaks for the others), so the
replay's allocated figures can be set beside the tracker's and its reserved figures read off.

:func:`step_events` gives the stream of a traced depth (``layers``; None: the model's own). The estimate traces
shallow probes and extrapolates its figures (:mod:`ledgerspec.derivations.estimate.extrapolate`), but reserved bytes
are not linear in the depth: the replay needs the whole step. :func:`full_depth_events` builds the full-depth stream
from three probes (the estimate's ``2p + r`` and ``3p + r`` layers and ``4p + r``) with
:mod:`ledgerspec.derivations.allocator.depth`, event by event as a full trace gives it, and traces the full depth
instead, saying why, when the probes' streams do not fit the pattern (or the model is too shallow or irregular for
probes). :func:`reserved_step` replays that stream: the entry point for reserved bytes, fragmentation and the first
out-of-memory at full depth.

What a diff of the probes' streams shows (tiny Llama, 2, 3 and 4 layers): in every forward and loss+backward window
the deeper stream is the shallower one with one contiguous block inserted per added layer (95 events forward, 181
backward; the backward copies free the forward copies last-in first-out); the optimizer windows interleave
per-parameter allocations (foreach kernels allocate one tensor per parameter inside each op) and a few buffers grow
with the parameter count: one block per kernel and a size that grows by the same bytes per layer, which
:mod:`.depth` models as slots and sizes in arithmetic progression.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.allocator.config import AllocatorConfig
from ledgerspec.derivations.allocator.depth import NotExtensible, retarget, template
from ledgerspec.derivations.allocator.replay import Event, ReplayOOM, ReplayResult, replay

#: the protocol's phases (:data:`ledgerspec.derivations.engine.protocol.PHASES`) whose figure is held at the end
HELD = ("after_load", "after_adapter_injection", "after_optimizer_init")


#: :func:`full_depth`'s ``pattern``: (depth pattern, where it was learned), a function giving it (or None) when it is
#: needed, or None
Pattern = tuple[Any, str] | Callable[[], tuple[Any, str] | None] | None


@dataclass
class StepEvents:
    """A step's event stream (traced, or built from probes), the window labels in order, the estimate's figures."""

    events: list[Event]
    windows: list[str]
    accumulation: int
    #: the estimate's figures of this trace (:func:`ledgerspec.derivations.estimate.estimator.trace`); for a stream
    #: built from probes, the probes' figures extended to the depth as the estimate extends them
    figures: dict[str, int]
    #: the tracker's peak and held bytes per window (its own bookkeeping, independent of the replay; traces only)
    tracker_windows: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the decoder layers of the stream (None: not recorded)
    layers: int | None = None
    #: how the stream was obtained, in words ("traced ..." or "built from the probes ...")
    method: str = ""
    #: why a stream that was to be built from probes was traced in full instead (one line; None: no fallback)
    fallback: str | None = None
    #: seconds spent tracing and building
    seconds: float = 0.0
    #: of those, seconds spent building the stream from the probes' streams (0 for a trace)
    build_seconds: float = 0.0
    #: the plain estimate's figures of this step (its probes extended as it extends them, or its full trace), when
    #: the traces behind this stream include the estimate's own (:func:`full_depth_from`); None: not traced here
    estimate_figures: dict[str, int] | None = None
    #: the depth pattern the stream was built with (:class:`~ledgerspec.derivations.allocator.depth.DepthTemplate`;
    #: None for a trace), for another step of the same structure (:func:`full_depth`'s ``pattern``); kept in this
    #: process only (not pickled: a step sent to a helper process travels without it)
    pattern: Any = field(default=None, repr=False, compare=False)
    #: a stream whose building from the probes was deferred (:func:`full_depth`'s ``defer``): what builds it; its
    #: ``events`` and ``pattern`` are empty until :meth:`finish`
    pending: Callable[[], StepEvents] | None = field(default=None, repr=False, compare=False)

    def finish(self) -> StepEvents:
        """Build a deferred stream now, in place (it may become the full trace, as :func:`full_depth` falls back);
        nothing to do for any other. Returns this step."""
        if self.pending is not None:
            done = self.pending()  # what it raises leaves the step to be built again
            self.__dict__.update({**done.__dict__, "pending": None})
        return self

    def __getstate__(self) -> dict[str, Any]:
        self.finish()  # a step sent elsewhere travels built
        return {**self.__dict__, "pattern": None, "pending": None}


@dataclass
class PhaseFigures:
    """One protocol phase of a replay: held bytes for ``after_*``, else the peak during the phase."""

    #: as the estimate's tracker counts: each live request rounded up to 512 B (the tracker's figure at this depth)
    allocated: int
    reserved: int  # peak reserved during the phase
    #: as the allocator counts (``torch.cuda.memory_allocated``): whole blocks, so a request served by a cached large
    #: block less than 1 MiB bigger (not split) counts that block; >= ``allocated``
    allocator_allocated: int = 0


@dataclass
class StepOOM:
    """The first out-of-memory of a replay, after the allocator's free-and-retry path."""

    phase: str  # the protocol phase (:data:`ledgerspec.derivations.engine.protocol.PHASES`)
    window: str  # the protocol window (``"4:temporary"``: the loss and backward of the first micro-step)
    requested: int  # bytes the failed allocation asked for
    alloc_size: int  # bytes the allocator tried to get from cudaMalloc
    allocated: int  # allocated by tensors then (the allocator's count)
    reserved: int  # reserved by the allocator then
    #: reserved bytes no tensor held and that could not serve the request (fragmentation)
    free_unusable: int


@dataclass
class StepReplay:
    step: StepEvents
    replay: ReplayResult
    phases: dict[str, PhaseFigures]
    oom: StepOOM | None = None

    @property
    def fits(self) -> bool:
        return self.oom is None


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
    from ledgerspec.derivations.estimate.estimator import prepare

    return probe_events(prepare(doc, target, offline=offline), layers)


def probe_events(prepared: Any, layers: int | None = None) -> StepEvents:
    """:func:`step_events` of a prepared estimate (:class:`ledgerspec.derivations.estimate.estimator.Prepared`):
    its trace at ``layers`` decoder layers (None: all) with the event log on; its figures are the estimate's."""
    started = time.perf_counter()
    from ledgerspec.derivations.estimate.estimator import granularity

    backend = _event_backend_class()(granularity(prepared.target))
    figures = prepared.trace(layers, backend=backend)
    backend.close_window()
    events = backend.tracker.events
    assert events is not None
    depth = layers if layers is not None else _layer_count(prepared.source.config)
    return StepEvents(
        list(events),
        list(backend.windows),
        min(prepared.spec.accumulation, 2),
        figures,
        backend.window_figures,
        depth,
        f"traced with {depth} decoder layers",
        seconds=time.perf_counter() - started,
    )


def probe_of(doc: Document, target: str, layers: str, offline: bool, depth: int | None) -> StepEvents:
    """:func:`probe_events` of ``doc`` prepared as an estimate with ``target``, ``layers`` and ``offline`` prepares
    it: a task a :class:`~ledgerspec.derivations.engine.beside.Helper` can run (its arguments pickle)."""
    from ledgerspec.derivations.estimate.estimator import prepare

    return probe_events(prepare(doc, target, layers, offline=offline), depth)


def _layer_count(config: Any) -> int | None:
    from ledgerspec.derivations.estimate.extrapolate import layer_count

    return layer_count(config)


def full_depth_events(doc: Document, target: str = "cuda", offline: bool = True, parallel: bool = False) -> StepEvents:
    """The event stream of ``doc``'s step at the model's full depth: built from three probes' streams when the
    estimate would extrapolate (:mod:`.depth`), else (an irregular or shallow stack) traced in full; a stream the
    probes cannot give exactly is traced in full too, with the reason in :attr:`StepEvents.fallback`.
    ``parallel``: the deepest probe in a forked process while the other two run here
    (:func:`ledgerspec.derivations.engine.beside.both`; the same stream either way)."""
    from ledgerspec.derivations.estimate.estimator import prepare

    return full_depth_from(prepare(doc, target, offline=offline), parallel)


def full_depth_from(
    prepared: Any,
    parallel: bool = False,
    probes: dict[int | None, StepEvents] | None = None,
    elsewhere: Callable[[int], Callable[[], StepEvents]] | None = None,
    pattern: Pattern = None,
    defer: bool = False,
    idle: Callable[[], None] | None = None,
) -> StepEvents:
    """:func:`full_depth_events` of a prepared estimate (:func:`ledgerspec.derivations.estimate.estimator.prepare`;
    with ``layers="full"`` the full depth is traced). :attr:`StepEvents.estimate_figures` holds the figures the
    plain estimate gives (its two probes extended, or its full trace) whenever the probes traced here include its
    own, so one set of traces answers both. ``probes``: filled with every stream traced on the way, by depth (None:
    the full depth), e.g. for :mod:`ledgerspec.derivations.devices.along`; ``elsewhere``, ``pattern``, ``defer``,
    ``idle``: see :func:`full_depth`."""
    from ledgerspec.derivations.engine.beside import can_fork

    if parallel and elsewhere is None and can_fork():
        prepared.warm()  # the forked probe finds the model's modules imported
    return full_depth(
        lambda n: probe_events(prepared, n), prepared.plan, parallel, probes, elsewhere, pattern, defer, idle
    )


def full_depth(
    probe: Callable[[int | None], StepEvents],
    est_plan: Any,
    parallel: bool = False,
    probes: dict[int | None, StepEvents] | None = None,
    elsewhere: Callable[[int], Callable[[], StepEvents]] | None = None,
    pattern: Pattern = None,
    defer: bool = False,
    idle: Callable[[], None] | None = None,
) -> StepEvents:
    """The full-depth stream of a step whose traces ``probe(layers)`` gives (None: every layer), by the depth plan
    ``est_plan`` (:class:`ledgerspec.derivations.estimate.extrapolate.Plan`): the plan's two probes and a third one
    period deeper, extended event by event (:mod:`.depth`), or the full trace when the plan has no probes, a third
    probe would be as deep as the model, or the probes' streams do not extend (saying why). Used for the estimate's
    step (:func:`full_depth_from`) and for each rank of a sharded one
    (:func:`ledgerspec.derivations.shard.simulation.probe_runner`). ``probes``: filled with every stream traced, by
    depth (None: the full depth). ``elsewhere(n)``: starts the probe of ``n`` layers in another process (a
    :class:`~ledgerspec.derivations.engine.beside.Helper`) and returns the function that waits for its stream; the
    third probe goes there while the other two are traced here (instead of a child forked for it: ``parallel``).
    ``pattern``: ``(depth pattern, where it was learned)``, the :attr:`StepEvents.pattern` of a step of the same
    structure (another microbatch): the plan's two probes only (the second one elsewhere), the stream built with
    that pattern (:func:`~ledgerspec.derivations.allocator.depth.retarget`); where their streams do not fit it, the
    third probe is traced as without it. It may be a function that gives it (or None) when it is needed, after the
    two probes. ``defer``: the three probes traced, the stream built only when :meth:`StepEvents.finish` is called
    (its figures and the estimate's are there at once); ``idle``: called before the two probes of a step built with
    a pattern (with ``elsewhere``, while the helper traces the second: work that would otherwise wait for it)."""
    from ledgerspec.derivations.engine.beside import both
    from ledgerspec.derivations.estimate.extrapolate import extend_all

    started = time.perf_counter()
    if probes is not None:
        probe = _recording(probe, probes)
    if est_plan.probes is None:
        full = probe(None)
        full.method = f"traced with all {est_plan.layers} decoder layers ({est_plan.reason})"
        full.estimate_figures = full.figures
        return full
    n1, n2 = est_plan.probes
    n3 = n2 + est_plan.period
    if n3 >= est_plan.layers:
        full = probe(None)
        full.method = f"traced with all {est_plan.layers} decoder layers (a third probe would be as deep)"
        return full
    steps, rest = divmod(est_plan.layers - n1, est_plan.period)
    if rest:
        raise ValueError(f"{est_plan.layers} layers is not {n1} plus whole periods of {est_plan.period}")

    def built(
        shallow: StepEvents, events: list[Event], estimated: dict[str, int], learned: Any, how: str, building: float
    ) -> StepEvents:
        """The stream built from the probes (``how``: the method's words), the estimate's figures beside it."""
        return StepEvents(
            events,
            list(shallow.windows),
            shallow.accumulation,
            estimated,
            layers=est_plan.layers,
            method=f"built from the probes with {how}",
            seconds=time.perf_counter() - started,
            build_seconds=time.perf_counter() - building,
            estimate_figures=estimated,
            pattern=learned,
        )

    known: tuple[Any, str] | None = None
    if pattern is not None:
        if elsewhere is not None:
            waiting_second = elsewhere(n2)
            if idle is not None:
                idle()
            shallow = probe(n1)
            second = waiting_second()
        else:
            if idle is not None:
                idle()
            shallow, second = both(lambda: probe(n1), lambda: probe(n2), parallel)
        building = time.perf_counter()
        try:
            if shallow.windows != second.windows:
                raise NotExtensible("the probes ran different protocol windows")
            known = pattern() if callable(pattern) else pattern
            if known is None:
                raise NotExtensible("no depth pattern was learned")
            learned = retarget(known[0], shallow.events, second.events)
            events = learned.stream(steps)
        except NotExtensible as exc:
            refused = str(exc)  # the third probe, as without a pattern
        else:
            return built(
                shallow,
                events,
                extend_all(shallow.figures, second.figures, n1, n2, est_plan.layers),
                learned,
                f"{n1} and {n2} decoder layers and the depth pattern of the probes with {n1}, {n2} and {n3} at "
                f"{known[1]}, extended to {est_plan.layers}",
                building,
            )
        third = elsewhere(n3)() if elsewhere is not None else probe(n3)
    elif elsewhere is not None:
        waiting = elsewhere(n3)
        shallow, second = probe(n1), probe(n2)
        third = waiting()
    else:
        (shallow, second), third = both(lambda: (probe(n1), probe(n2)), lambda: probe(n3), parallel)
    estimated = extend_all(shallow.figures, second.figures, n1, n2, est_plan.layers)

    def build() -> StepEvents:
        building = time.perf_counter()
        try:
            if not shallow.windows == second.windows == third.windows:
                raise NotExtensible("the probes ran different protocol windows")
            learned = template(shallow.events, second.events, third.events)
            events = learned.stream(steps)
        except NotExtensible as exc:
            full = probe(None)
            full.fallback = (
                f"the probes' allocation streams ({n1}, {n2}, {n3} layers) do not extend to {est_plan.layers} "
                f"layers exactly ({exc}): traced all {est_plan.layers} layers instead"
            )
            full.method = f"traced with all {est_plan.layers} decoder layers (the probes did not extend)"
            full.seconds = time.perf_counter() - started
            full.estimate_figures = estimated
            return full
        why = ""
        if pattern is not None:
            why = f" (the depth pattern of {known[1]} did not fit: {refused})" if known is not None else f" ({refused})"
        return built(
            shallow,
            events,
            estimated,
            learned,
            f"{n1}, {n2} and {n3} decoder layers, extended to {est_plan.layers}{why}",
            building,
        )

    if not defer:
        return build()
    return StepEvents(
        [], list(shallow.windows), shallow.accumulation, estimated, layers=est_plan.layers,
        method="to be built from the probes", estimate_figures=estimated, pending=build,
    )  # fmt: skip


def _recording(
    probe: Callable[[int | None], StepEvents], log: dict[int | None, StepEvents]
) -> Callable[[int | None], StepEvents]:
    """``probe`` that also keeps each stream it traces in ``log`` (in this process: a probe traced in a forked one
    is not kept)."""

    def run(n: int | None) -> StepEvents:
        log[n] = probe(n)
        return log[n]

    return run


def protocol_windows(windows: list[str], accumulation: int, steps: int = 1) -> dict[str, list[str]]:
    """Which windows make up each protocol phase (the order :func:`ledgerspec.derivations.engine.protocol._phases`
    runs them in); raises ValueError when the windows are not that order. A micro-step that generates (GRPO, RLOO)
    opens with a generation window ("temporary") before its forward window ("activations")."""
    contexts = [w.split(":", 1)[1] for w in windows]
    micro = ["activations", "temporary"] * accumulation
    expected = ["frozen_params", "adapter", "optimizer", *micro, "optimizer", *([*micro, "optimizer"] * steps)]
    phases: dict[str, list[str]] = {"forward_peak": [], "backward_peak": [], "generation_peak": []}
    pos = 3
    first_step: list[str] = []
    for step_index in range(1 + steps):
        for _ in range(accumulation):
            if pos < len(contexts) and contexts[pos] == "temporary":  # the micro-step's generation window
                if step_index == 0:
                    phases["generation_peak"].append(windows[pos])
                pos += 1
            if contexts[pos : pos + 2] != ["activations", "temporary"]:
                raise ValueError(f"unexpected protocol windows {contexts} (expected {expected})")
            if step_index == 0:
                phases["forward_peak"].append(windows[pos])
                phases["backward_peak"].append(windows[pos + 1])
            pos += 2
        if contexts[pos : pos + 1] != ["optimizer"]:
            raise ValueError(f"unexpected protocol windows {contexts} (expected {expected})")
        if step_index == 0:
            first_step.append(windows[pos])
            steady_from = pos + 1
        pos += 1
    if pos != len(contexts) or contexts[:3] != ["frozen_params", "adapter", "optimizer"]:
        raise ValueError(f"unexpected protocol windows {contexts} (expected {expected})")
    generation = {"generation_peak": phases["generation_peak"]} if phases["generation_peak"] else {}
    return {
        "after_load": [windows[0]],
        "after_adapter_injection": [windows[1]],
        "after_optimizer_init": [windows[2]],
        **generation,
        "forward_peak": phases["forward_peak"],
        "backward_peak": phases["backward_peak"],
        "optimizer_step_peak": first_step,
        "steady_state_peak": windows[steady_from:],
    }


def replay_step(
    doc: Document,
    layers: int | None = None,
    config: AllocatorConfig | str | None = None,
    capacity: int | None = None,
    device_total: int | None = None,
    target: str = "cuda",
    step: StepEvents | None = None,
    workspaces: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> StepReplay:
    """The estimate's step (traced now, or ``step``) replayed through the allocator: per protocol phase the
    allocated figure (as the protocol defines it) and the peak reserved bytes, and the first OOM if any.
    ``workspaces``: the cuBLAS workspaces of the Python thread's and the autograd thread's handles, bytes each
    (:func:`ledgerspec.derivations.allocator.workspaces.with_workspaces`; None: the stream as traced)."""
    from ledgerspec.derivations.estimate.estimator import granularity

    traced = step if step is not None else step_events(doc, layers, target)
    events = traced.events
    if workspaces is not None:
        from ledgerspec.derivations.allocator.workspaces import with_workspaces

        events = with_workspaces(events, traced.windows, *workspaces)
    # without the per-block counters (the replay reads allocated and reserved bytes only)
    result = replay(events, config, capacity, device_total, granularity=granularity(target), statistics=False)
    phases: dict[str, PhaseFigures] = {}
    windows = protocol_windows(traced.windows, traced.accumulation)
    for name, labels in windows.items():
        parts = [result.phases[label] for label in labels if label in result.phases]
        if not parts:
            continue
        if name in HELD:
            counted, allocated = parts[-1].end_counted, parts[-1].end_allocated
        else:
            counted, allocated = max(p.peak_counted for p in parts), max(p.peak_allocated for p in parts)
        phases[name] = PhaseFigures(counted, max(p.peak_reserved for p in parts), allocated)
    return StepReplay(traced, result, phases, _oom(result.oom, windows))


def _oom(oom: ReplayOOM | None, windows: dict[str, list[str]]) -> StepOOM | None:
    if oom is None:
        return None
    phase = next((name for name, labels in windows.items() if oom.phase in labels), oom.phase)
    return StepOOM(phase, oom.phase, oom.requested, oom.alloc_size, oom.allocated, oom.reserved, oom.free_unusable)


def reserved_step(
    doc: Document,
    target: str = "cuda",
    config: AllocatorConfig | str | None = None,
    capacity: int | None = None,
    device_total: int | None = None,
    offline: bool = True,
    parallel: bool = False,
    workspaces: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> StepReplay:
    """``doc``'s step at the model's full depth (:func:`full_depth_events`) replayed through the allocator model
    (``config``: an :class:`AllocatorConfig` or a ``PYTORCH_CUDA_ALLOC_CONF`` string): per protocol phase the
    allocated bytes (the estimate's count, and the allocator's), the peak reserved bytes, and with a ``capacity``
    (the bytes cudaMalloc can get) the first out-of-memory after the allocator's free-and-retry path (the step
    stops there: later phases have no figures). :attr:`StepEvents.fallback` says why the stream was traced in full
    where it was to be built from probes. ``workspaces``: as :func:`replay_step`'s."""
    step = full_depth_events(doc, target, offline, parallel)
    return replay_step(
        doc,
        config=config,
        capacity=capacity,
        device_total=device_total,
        target=target,
        step=step,
        workspaces=workspaces,
    )


__all__ = [
    "HELD",
    "PhaseFigures",
    "StepEvents",
    "StepOOM",
    "StepReplay",
    "full_depth",
    "full_depth_events",
    "full_depth_from",
    "probe_events",
    "probe_of",
    "protocol_windows",
    "replay_step",
    "reserved_step",
    "step_events",
]
