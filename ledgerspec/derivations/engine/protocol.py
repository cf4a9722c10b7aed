"""The measurement protocol of the method article, as plain code over a small backend interface.

Steps (spec, "The measurement protocol"): fix the configuration (the :class:`Workload`), load the
base (``after_load``), add the exact adapters (``after_adapter_injection``), create the optimizer
(``after_optimizer_init``), one representative training step at the worst sequence shape with its
gradient-accumulation micro-steps (``forward_peak``, ``backward_peak`` = loss + backward,
``optimizer_step_peak``), then ``steps`` repeated steps at the typical shape
(``steady_state_peak``). Peak counters are reset at the start of every phase. ``after_*`` phases
report the memory held at the end of the phase (their transient peak is kept too); the others
report the peak during the phase (the maximum over the micro-steps).

The memory counters are backends (:mod:`ledgerspec.derivations.engine.backends`). An out-of-memory error is
caught and recorded with the phase it happened in; anything else propagates.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ledgerspec.derivations.engine.backends import Backend
from ledgerspec.derivations.engine.tracker import census
from ledgerspec.derivations.engine.workload import Workload
from ledgerspec.errors import first_line

PROTOCOL_VERSION = "ledgerspec-measure/1"
#: protocol runs (traces and measurements) started in this process: a process forked after a fake-tensor trace has
#: been seen to hang (torch 2.13), so parallel sweeps fork only before the first one
#: (:func:`ledgerspec.derivations.estimate.search.run_estimates`)
RUNS_STARTED = 0
PHASES = (
    "after_load",
    "after_adapter_injection",
    "after_optimizer_init",
    "forward_peak",
    "backward_peak",
    "optimizer_step_peak",
    "steady_state_peak",
)
#: the phases whose ledger figure is the memory held at the end (the others report the phase peak)
HELD_PHASES = frozenset(PHASES[:3])
#: phases only some steps have: ``generation_peak``, the peak of the first representative step's generation phase
#: (GRPO: the completions generated, scored and their reference log-probs computed before the training forward)
OPTIONAL_PHASES = ("generation_peak",)


def census_model(workload: Any) -> Any:
    """What the census of held tensors walks: ``workload.census_model`` (the model, and a separate reference model
    beside it) where the workload has one, else its model."""
    return getattr(workload, "census_model", workload.model)


# -- results --------------------------------------------------------------------------------------------------------


@dataclass
class PhaseRecord:
    """One phase: ``figure`` is what the ledger records (held bytes for ``after_*``, else the peak)."""

    name: str
    figure: int
    peak: int
    held: int
    reserved_peak: int | None = None
    device_peak: int | None = None
    categories_at_peak: dict[str, int] | None = None
    census: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: cuda: device bytes outside the caching allocator at the end of the phase (used - reserved, read together)
    outside: int | None = None


@dataclass
class ProtocolResult:
    """Everything a measurement saw; JSON-serialisable for the child-process boundary."""

    backend: str
    protocol: str = PROTOCOL_VERSION
    phases: dict[str, PhaseRecord] = field(default_factory=dict)
    steps: int = 0
    microbatch: int = 1
    accumulation: int = 1
    seq_worst: int = 0
    seq_typical: int = 0
    oom: bool = False
    oom_phase: str | None = None
    oom_message: str | None = None
    oom_during: str | None = None  # forward / loss / backward / optimizer_step within a later iteration
    simulated_oom: bool = False
    memory_limit: int | None = None
    failed_phase_peak: int | None = None
    failed_phase_reserved: int | None = None  # cuda: max_memory_reserved of the failed phase
    failed_phase_device: int | None = None  # cuda: device-level peak of the failed phase
    failed_categories: dict[str, int] | None = None  # tracker categories at the peak of the failed phase
    failed_census: dict[str, int] | None = None
    activations_saved: int | None = None
    step_time_s: float | None = None
    host_peak: int | None = None
    snapshot_path: str | None = None
    trainable_parameters: int | None = None
    device: dict[str, Any] = field(default_factory=dict)
    #: cuda: the device before the first allocation: {"used", "reserved", "source"} (the CUDA context)
    context: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return not self.oom and all(p in self.phases for p in PHASES)

    def peak_allocated(self) -> int | None:
        peaks = [r.peak for r in self.phases.values()]
        if self.failed_phase_peak is not None:
            peaks.append(self.failed_phase_peak)
        return max(peaks) if peaks else None

    def peak_reserved(self) -> int | None:
        """Maximum over the phases (the failed one included, as in :meth:`peak_allocated`: reserved >= allocated)."""
        vals = [r.reserved_peak for r in self.phases.values() if r.reserved_peak is not None]
        if self.failed_phase_reserved is not None:
            vals.append(self.failed_phase_reserved)
        return max(vals) if vals else None

    def device_peak(self) -> int | None:
        vals = [r.device_peak for r in self.phases.values() if r.device_peak is not None]
        if self.failed_phase_device is not None:
            vals.append(self.failed_phase_device)
        return max(vals) if vals else None

    def outside_at_peak(self) -> tuple[int, str] | None:
        """(device bytes outside the caching allocator at the device peak, the phase): ``device_peak -
        reserved_peak`` of the phase with the highest device peak. Both counters only grow within a phase (segments
        are kept; modules, NCCL buffers stay), so both peaks fall at its end and the difference is what lay outside
        the allocator then; a phase whose allocator released segments (an OOM's free-and-retry) reads low."""
        best: tuple[int, int, str] | None = None
        for name, rec in self.phases.items():
            if rec.device_peak is None or rec.reserved_peak is None:
                continue
            if best is None or rec.device_peak > best[0]:
                best = (rec.device_peak, max(rec.device_peak - rec.reserved_peak, 0), name)
        return (best[1], best[2]) if best is not None else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProtocolResult:
        data = dict(data)
        phases = {k: PhaseRecord(**v) for k, v in (data.pop("phases", None) or {}).items()}
        return cls(phases=phases, **data)


# -- the protocol ---------------------------------------------------------------------------------------------------


class ProtocolRun:
    """One run of the protocol in progress: the workload, the backend that counts, the result being filled, and
    where the work is (the article's OOM phase name)."""

    def __init__(self, workload: Workload, backend: Backend, device: str, result: ProtocolResult) -> None:
        self.workload = workload
        self.backend = backend
        self.device = device
        self.result = result
        self.where = "load"  # the article's OOM phase name of the work in progress
        self.later = False  # in the repeated steps: an OOM there is a "later_iteration" OOM

    def record(self, name: str, t0: float, held_figure: bool) -> PhaseRecord:
        peak = self.backend.peak()
        held = self.backend.current()
        rec = PhaseRecord(
            name,
            held if held_figure else peak,
            peak,
            held,
            self.backend.reserved_peak(),
            self.backend.device_peak(),
            self.backend.peak_categories(),
            census(census_model(self.workload), self.workload.optimizer, self.backend.census_device),
            time.perf_counter() - t0,
            self.backend.outside_now(),
        )
        self.result.phases[name] = rec
        return rec

    def start(self, where: str, context: str) -> float:
        self.where = where
        self.backend.set_context(context)
        self.backend.reset_peak()
        return time.perf_counter()

    def micro_step(
        self,
        seq: int,
        index: int,
        first: bool,
        peaks: dict[str, int],
        cats: dict[str, dict[str, int] | None],
        extra: dict[str, int | None],
    ) -> None:
        """Micro-step ``index`` of an optimizer step of the declared loop (``workload.step``): forward, then loss
        and backward; the first micro-step of a step starts it (the Trainer fetches the step's batches then)."""
        w, b = self.workload, self.backend
        step = w.step
        self.where = "forward"  # (also the spec's word for an out-of-memory error in the generation phase)
        due = getattr(step, "generation_due", None)
        generating = due is not None and due(index)  # a phase of its own, before the micro-step's forward
        b.set_context("temporary" if generating else "activations")
        b.reset_peak()
        if index == 0:
            step.start(seq, w.spec.prefetch or w.spec.accumulation)
        if generating:
            step.generate(index)
            self._keep(peaks, cats, extra, "generation")
            b.set_context("activations")
            b.reset_peak()
        before = b.current()
        saved_tensors = getattr(w, "saved_tensors", contextlib.nullcontext)  # a workload may not hook saved tensors
        with saved_tensors():
            out = step.forward(index)
            if first:
                self.result.activations_saved = b.current() - before
            self._keep(peaks, cats, extra, "forward")
            self.where = "loss"
            b.set_context("temporary")
            b.reset_peak()
            loss = step.loss(out, index)
            self.where = "backward"
            step.backward(loss)
            del out, loss
        step.release(index)
        self._keep(peaks, cats, extra, "backward")

    def _keep(
        self, peaks: dict[str, int], cats: dict[str, dict[str, int] | None], extra: dict[str, int | None], key: str
    ) -> None:
        p = self.backend.peak()
        if p >= peaks.get(key, -1):
            peaks[key] = p
            cats[key] = self.backend.peak_categories()
        for name, value in (
            (f"{key}:reserved", self.backend.reserved_peak()),
            (f"{key}:device", self.backend.device_peak()),
        ):
            if value is not None:
                extra[name] = max(value, extra.get(name) or 0)


def run_protocol(
    workload: Workload,
    backend: Backend,
    device: str = "cpu",
    steps: int = 2,
    snapshot_path: str | None = None,
    memory_limit: int | None = None,
) -> ProtocolResult:
    """Run the protocol; an out-of-memory error ends it early with ``oom``/``oom_phase`` set.

    ``device`` is where tensors are created (``"cpu"`` for the tracker backends, fake included).
    Configuration errors (an unbuildable model, a bad optimizer name) raise before any phase runs.
    """
    global RUNS_STARTED
    RUNS_STARTED += 1
    spec = workload.spec
    result = ProtocolResult(
        backend.name,
        steps=steps,
        microbatch=spec.microbatch,
        accumulation=spec.accumulation,
        seq_worst=spec.seq_worst,
        seq_typical=spec.seq_typical,
        memory_limit=memory_limit,
    )
    workload.prepare()
    run = ProtocolRun(workload, backend, device, result)
    with backend.session():
        try:
            _phases(run, steps)
        except Exception as exc:  # only out-of-memory errors are results; the rest propagates
            kind = backend.oom_kind(exc)
            if kind is None:
                raise
            result.oom = True
            result.oom_phase = "later_iteration" if run.later else run.where
            result.oom_during = run.where
            result.simulated_oom = kind == "simulated"
            result.oom_message = first_line(exc)
            del exc
            # after a device error a read can fail too: the OOM stays the result, the figure stays unknown
            result.failed_phase_peak = _read_after_oom(backend.peak)
            result.failed_phase_reserved = _read_after_oom(backend.reserved_peak)
            result.failed_phase_device = _read_after_oom(backend.device_peak)
            result.failed_categories = backend.peak_categories()
            result.failed_census = _read_after_oom(
                lambda: census(census_model(workload), workload.optimizer, backend.census_device)
            )
            result.snapshot_path = backend.on_oom(snapshot_path)
        result.device = backend.device_info()
        result.context = backend.context_reading()
    result.trainable_parameters = workload.trainable_parameters() if workload.model is not None else None
    result.host_peak = _host_peak()
    return result


def _read_after_oom(read: Any) -> Any:
    try:
        return read()
    except Exception:
        return None


def _phases(run: ProtocolRun, steps: int) -> None:
    w, b, spec = run.workload, run.backend, run.workload.spec
    t0 = run.start("load", "frozen_params")
    w.materialise_base(run.device)
    b.classify(w, stale=("frozen_params",))
    run.record("after_load", t0, True)

    t0 = run.start("adapter_injection", "adapter")
    w.materialise_adapters(run.device)
    b.classify(w, stale=("adapter",))
    run.record("after_adapter_injection", t0, True)

    t0 = run.start("optimizer_init", "optimizer")
    w.make_optimizer()
    b.classify(w, stale=("optimizer",))
    b.watch(w)
    run.record("after_optimizer_init", t0, True)

    # one representative step at the worst shape, micro-step by micro-step
    peaks: dict[str, int] = {}
    cats: dict[str, dict[str, int] | None] = {}
    extra: dict[str, int | None] = {}
    t0 = time.perf_counter()
    for i in range(spec.accumulation):
        run.micro_step(spec.seq_worst, i, i == 0, peaks, cats, extra)
    elapsed = time.perf_counter() - t0
    held_census = census(census_model(w), w.optimizer, b.census_device)
    outside = b.outside_now()
    for key, name in (("generation", "generation_peak"), ("forward", "forward_peak"), ("backward", "backward_peak")):
        if key not in peaks:
            continue
        run.result.phases[name] = PhaseRecord(
            name,
            peaks[key],
            peaks[key],
            b.current(),
            extra.get(f"{key}:reserved"),
            extra.get(f"{key}:device"),
            cats.get(key),
            held_census,
            elapsed,
            outside,
        )

    t0 = run.start("optimizer_step", "optimizer")
    w.step.optimizer_step()
    b.classify(w, stale=("optimizer",))
    w.step.zero_grad()
    run.record("optimizer_step_peak", t0, False)

    # repeated representative steps at the typical shape
    peaks, cats, extra = {}, {}, {}
    times: list[float] = []
    run.later = True
    t_all = time.perf_counter()
    for _ in range(steps):
        t_step = time.perf_counter()
        for i in range(spec.accumulation):
            run.micro_step(spec.seq_typical, i, False, peaks, cats, extra)
        run.where = "optimizer_step"
        b.set_context("optimizer")
        b.reset_peak()
        w.step.optimizer_step()
        b.classify(w, stale=("optimizer",))
        w.step.zero_grad()
        run._keep(peaks, cats, extra, "step")
        times.append(time.perf_counter() - t_step)
    best = max(peaks, key=lambda k: peaks[k]) if peaks else "step"
    reserved = [v for k, v in extra.items() if k.endswith(":reserved") and v is not None]
    device = [v for k, v in extra.items() if k.endswith(":device") and v is not None]
    top = max(peaks.values())
    run.result.phases["steady_state_peak"] = PhaseRecord(
        "steady_state_peak",
        top,
        top,
        b.current(),
        max(reserved) if reserved else None,
        max(device) if device else None,
        cats.get(best),
        census(census_model(w), w.optimizer, b.census_device),
        time.perf_counter() - t_all,
        b.outside_now(),
    )
    run.result.step_time_s = sum(times) / len(times) if times else None
    w.step.finish()


def _host_peak() -> int | None:
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except (ImportError, OSError):
        return None


__all__ = [
    "HELD_PHASES",
    "OPTIONAL_PHASES",
    "PHASES",
    "PROTOCOL_VERSION",
    "PhaseRecord",
    "ProtocolResult",
    "run_protocol",
]
