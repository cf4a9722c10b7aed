"""The measurement protocol of the method article, as plain code over a small backend interface.

Steps (spec, "The measurement protocol"): fix the configuration (the :class:`Workload`), load the
base (``after_load``), add the exact adapters (``after_adapter_injection``), create the optimizer
(``after_optimizer_init``), one representative training step at the worst sequence shape with its
gradient-accumulation micro-steps (``forward_peak``, ``backward_peak`` = loss + backward,
``optimizer_step_peak``), then ``steps`` repeated steps at the typical shape
(``steady_state_peak``). Peak counters are reset at the start of every phase. ``after_*`` phases
report the memory held at the end of the phase (their transient peak is kept too); the others
report the peak during the phase (the maximum over the micro-steps).

Backends: :class:`TrackerBackend` (tensor-level tracking of real CPU tensors or of fake tensors,
with an optional simulated memory limit) and :class:`CudaBackend` (the PyTorch caching
allocator's counters, plus device-level memory sampled from NVML in a thread). An out-of-memory
error is caught and recorded with the phase it happened in; anything else propagates.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ledgerspec.derivations.engine.tracker import SIMULATED_OOM_MARKER, MemoryTracker, SimulatedOOM, census
from ledgerspec.derivations.engine.workload import Workload

PROTOCOL_VERSION = "ledgerspec-measure/1"
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


# -- backends -------------------------------------------------------------------------------------------------------


class Backend:
    """What the protocol needs from a memory counter. Methods without a figure return None."""

    name = "abstract"
    #: the census counts only tensors on this kind of device (None: all)
    census_device: str | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Active while the workload is materialised and trained (tracking modes, sampler threads)."""
        yield

    def reset_peak(self) -> None:
        raise NotImplementedError

    def peak(self) -> int:
        """Peak allocated bytes since the last :meth:`reset_peak`."""
        raise NotImplementedError

    def current(self) -> int:
        raise NotImplementedError

    def reserved_peak(self) -> int | None:
        return None

    def device_peak(self) -> int | None:
        return None

    def peak_categories(self) -> dict[str, int] | None:
        return None

    def set_context(self, category: str) -> None:
        """Provisional category of the allocations that follow (tracker backends only)."""

    def classify(self, workload: Workload, stale: tuple[str, ...] = ()) -> None:
        """Relabel the long-lived tensors after a phase (tracker backends only)."""

    def watch(self, workload: Workload) -> None:
        """Start following gradients as autograd stores them (tracker backends only)."""

    def oom_kind(self, exc: BaseException) -> str | None:
        """``"simulated"`` or ``"cuda"`` when ``exc`` is an out-of-memory error, else None."""
        return None

    def on_oom(self, snapshot_path: str | None) -> str | None:
        """Save diagnostics after an OOM; the path written, if any."""
        return None

    def device_info(self) -> dict[str, Any]:
        return {}


class TrackerBackend(Backend):
    """Tensor-level tracking on the CPU (real tensors) or of fake tensors (``fake=True``)."""

    def __init__(self, limit: int | None = None, fake: bool = False, granularity: int = 1) -> None:
        self.name = "fake" if fake else "cpu"
        self.fake = fake
        self.tracker = MemoryTracker(limit=limit, granularity=granularity)
        self.limit = limit

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(self.tracker)
            try:
                yield
            finally:
                self.tracker.unwatch()

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def peak(self) -> int:
        return self.tracker.peak

    def current(self) -> int:
        return self.tracker.current

    def peak_categories(self) -> dict[str, int] | None:
        return dict(self.tracker.peak_categories)

    def set_context(self, category: str) -> None:
        self.tracker.context = category

    def classify(self, workload: Workload, stale: tuple[str, ...] = ()) -> None:
        self.tracker.reclassify(workload.model, workload.optimizer, stale=stale)

    def watch(self, workload: Workload) -> None:
        self.tracker.watch_gradients(workload.model)

    def oom_kind(self, exc: BaseException) -> str | None:
        if isinstance(exc, SimulatedOOM) or SIMULATED_OOM_MARKER in str(exc):
            return "simulated"
        return None

    def device_info(self) -> dict[str, Any]:
        import platform

        return {"device": "cpu", "device_name": platform.processor() or platform.machine()}


#: what a CUDA out-of-memory looks like when it is not a ``torch.cuda.OutOfMemoryError`` (case-insensitive):
#: ``CUDA error: out of memory`` from a kernel launch or NCCL, cuBLAS failing to allocate its workspace
CUDA_OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation")


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def _import_nvml() -> Any:
    """The ``pynvml`` module of nvidia-ml-py, or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _nvml_handle(nvml: Any, cuda: Any, index: int) -> Any:
    """The NVML handle of torch's device ``index``: by UUID (right under CUDA_VISIBLE_DEVICES), else by index."""
    with contextlib.suppress(Exception):
        uuid = str(cuda.get_device_properties(index).uuid)
        for candidate in (uuid,) if uuid.startswith(("GPU-", "MIG-")) else ("GPU-" + uuid, "MIG-" + uuid):
            with contextlib.suppress(Exception):
                return nvml.nvmlDeviceGetHandleByUUID(candidate)
    nvml_index = index
    with contextlib.suppress(Exception):  # torch's own mapping through CUDA_VISIBLE_DEVICES
        nvml_index = int(cuda._get_nvml_device_index(index))
    return nvml.nvmlDeviceGetHandleByIndex(nvml_index)


def _driver_from_proc() -> str | None:
    """The NVIDIA kernel driver version from /proc (Linux), when NVML is not available."""
    import re
    from pathlib import Path

    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


class _DeviceSampler:
    """Device-level used memory, sampled in a thread between :meth:`reset` and :meth:`peak`.

    Sources, best first: NVML's used memory of THIS process on the device
    (``nvmlDeviceGetComputeRunningProcesses``; the process must be listed with a known
    ``usedGpuMemory``: in a container with its own PID namespace NVML reports host PIDs and the
    process is not found, and some drivers report N/A = None); else NVML's device-wide used memory
    (``nvmlDeviceGetMemoryInfo``: other processes on the device count too); else, without
    nvidia-ml-py, the driver's device-wide figure (``cudaMemGetInfo``). :attr:`source` says which.
    A peak is None until one sample succeeded (never a made-up 0).
    """

    def __init__(self, cuda: Any, device_index: int, interval: float = 0.005, nvml: Any = None) -> None:
        self.cuda = cuda
        self.index = device_index
        self.interval = interval
        self.source = "none"
        self.driver: str | None = None
        self._nvml: Any = None  # set when nvmlInit succeeded (nvmlShutdown at stop)
        self._lock = threading.Lock()
        self._epoch = 0  # a sample read before a reset must not land after it
        self._peak: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = self._make_reader(_import_nvml() if nvml is None else nvml)

    def _make_reader(self, nvml: Any) -> Any:
        cuda, index, pid = self.cuda, self.index, os.getpid()
        cuda.synchronize(index)  # creates the CUDA context: from here on the process is listed by NVML
        if nvml is not None:
            try:
                nvml.nvmlInit()
                self._nvml = nvml
                handle = _nvml_handle(nvml, cuda, index)
                self.driver = _text(nvml.nvmlSystemGetDriverVersion())

                def per_process() -> int | None:
                    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        if int(proc.pid) == pid:
                            used = proc.usedGpuMemory
                            return None if used is None else int(used)
                    return None

                if per_process() is not None:
                    self.source = "NVML per-process used memory (nvmlDeviceGetComputeRunningProcesses)"
                    return per_process
                self.source = (
                    "NVML device-wide used memory (nvmlDeviceGetMemoryInfo; this process was not listed "
                    "with its own figure, so other processes on the device count too)"
                )
                return lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # NVML present but not usable (no driver library, permissions): the CUDA figure
                pass
        self.driver = self.driver or _driver_from_proc()
        self.source = "cudaMemGetInfo device-wide used memory (total - free; nvidia-ml-py not available)"

        def device_wide() -> int:
            free, total = cuda.mem_get_info(index)
            return int(total - free)

        return device_wide

    def sample(self) -> None:
        with self._lock:
            epoch = self._epoch
        try:
            value = self._read()
        except Exception:
            return
        if value is None:
            return
        with self._lock:
            self.samples += 1
            if epoch == self._epoch and (self._peak is None or value > self._peak):
                self._peak = int(value)

    def reset(self) -> None:
        with self._lock:
            self._epoch += 1
            self._peak = None
        self.sample()

    def peak(self) -> int | None:
        self.sample()
        with self._lock:
            return self._peak

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="ledgerspec-device-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


class CudaBackend(Backend):
    """``torch.cuda`` caching-allocator counters per phase; device-level memory sampled in a thread.

    ``cuda`` is the ``torch.cuda`` module (default) or a stand-in with the same functions, ``nvml``
    the ``pynvml`` module (default: imported when the session starts; None when absent): the tests
    inject fakes to check the plumbing without a GPU.
    """

    name = "cuda"
    census_device = "cuda"

    def __init__(
        self,
        device_index: int = 0,
        record_history: bool = True,
        *,
        cuda: Any = None,
        nvml: Any = None,
        sample_interval: float = 0.005,
    ) -> None:
        self.index = device_index
        self.record_history = record_history
        self._cuda = cuda
        self._nvml = nvml
        self.sample_interval = sample_interval
        self.sampler: _DeviceSampler | None = None
        self.recording = False
        self.history_problem: str | None = None  # why no memory history is recorded (no OOM snapshot then)

    @property
    def cuda(self) -> Any:
        return self._cuda if self._cuda is not None else _torch_cuda()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        cuda = self.cuda
        cuda.set_device(self.index)
        cuda.init()
        if self.record_history:
            # before the first allocation, so an OOM snapshot has the whole history; python stacks only:
            # C++ stack capture on every allocation would slow the step down
            try:
                cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=200_000)
                self.recording = True
            except Exception as exc:  # a private API: an older torch has another signature; measure without it
                self.history_problem = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        try:
            self.sampler = _DeviceSampler(cuda, self.index, self.sample_interval, self._nvml)
            self.sampler.start()
            yield
        finally:
            if self.sampler is not None:
                self.sampler.stop()
            if self.recording:
                with contextlib.suppress(Exception):  # an OOM snapshot was taken before this
                    cuda.memory._record_memory_history(enabled=None)
                self.recording = False

    def reset_peak(self) -> None:
        cuda = self.cuda
        cuda.synchronize(self.index)
        cuda.reset_peak_memory_stats(self.index)
        if self.sampler is not None:
            self.sampler.reset()

    def peak(self) -> int:
        cuda = self.cuda
        cuda.synchronize(self.index)
        return int(cuda.max_memory_allocated(self.index))

    def current(self) -> int:
        cuda = self.cuda
        cuda.synchronize(self.index)
        return int(cuda.memory_allocated(self.index))

    def reserved_peak(self) -> int | None:
        return int(self.cuda.max_memory_reserved(self.index))

    def device_peak(self) -> int | None:
        return self.sampler.peak() if self.sampler is not None else None

    def oom_kind(self, exc: BaseException) -> str | None:
        oom_type = getattr(self.cuda, "OutOfMemoryError", None)  # torch.cuda's exists in every torch >= 1.13
        if isinstance(oom_type, type) and isinstance(exc, oom_type):
            return "cuda"
        text = str(exc).lower()
        return "cuda" if any(m in text for m in CUDA_OOM_MESSAGES) else None

    def on_oom(self, snapshot_path: str | None) -> str | None:
        if not snapshot_path or not self.recording:
            return None
        try:
            self.cuda.memory._dump_snapshot(snapshot_path)
        except Exception:
            return None
        return snapshot_path

    def device_info(self) -> dict[str, Any]:
        import torch

        cuda = self.cuda
        props = cuda.get_device_properties(self.index)
        sampler = self.sampler
        return {
            "device": "cuda",
            "device_name": str(props.name),
            "device_memory": int(props.total_memory),
            "cuda": torch.version.cuda,
            "driver": sampler.driver if sampler is not None else _driver_from_proc(),
            "device_memory_source": sampler.source if sampler is not None else None,
            "memory_history": (
                "recorded (an OOM saves a snapshot)"
                if self.recording
                else f"not recorded: {self.history_problem}"
                if self.history_problem
                else "not recorded"
            ),
        }


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProtocolResult:
        data = dict(data)
        phases = {k: PhaseRecord(**v) for k, v in (data.pop("phases", None) or {}).items()}
        return cls(phases=phases, **data)


# -- the protocol ---------------------------------------------------------------------------------------------------


class _OOM(Exception):
    pass


class _Run:
    def __init__(self, workload: Workload, backend: Backend, device: str, result: ProtocolResult) -> None:
        self.w = workload
        self.b = backend
        self.device = device
        self.r = result
        self.where = "load"  # the article's OOM phase name of the work in progress
        self.later = False  # in the repeated steps: an OOM there is a "later_iteration" OOM

    def record(self, name: str, t0: float, held_figure: bool) -> PhaseRecord:
        peak = self.b.peak()
        held = self.b.current()
        rec = PhaseRecord(
            name,
            held if held_figure else peak,
            peak,
            held,
            self.b.reserved_peak(),
            self.b.device_peak(),
            self.b.peak_categories(),
            census(self.w.model, self.w.optimizer, self.b.census_device),
            time.perf_counter() - t0,
        )
        self.r.phases[name] = rec
        return rec

    def start(self, where: str, context: str) -> float:
        self.where = where
        self.b.set_context(context)
        self.b.reset_peak()
        return time.perf_counter()

    def micro_step(
        self,
        seq: int,
        first: bool,
        peaks: dict[str, int],
        cats: dict[str, dict[str, int] | None],
        extra: dict[str, int | None],
    ) -> None:
        w, b = self.w, self.b
        self.where = "forward"
        b.set_context("activations")
        b.reset_peak()
        before = b.current()
        ids, labels = w.batch(seq)
        logits = w.forward(ids)
        if first:
            self.r.activations_saved = b.current() - before
        self._keep(peaks, cats, extra, "forward")
        self.where = "loss"
        b.set_context("temporary")
        b.reset_peak()
        loss = w.loss(logits, labels)
        self.where = "backward"
        w.backward(loss)
        del logits, loss, ids, labels
        self._keep(peaks, cats, extra, "backward")

    def _keep(
        self, peaks: dict[str, int], cats: dict[str, dict[str, int] | None], extra: dict[str, int | None], key: str
    ) -> None:
        p = self.b.peak()
        if p >= peaks.get(key, -1):
            peaks[key] = p
            cats[key] = self.b.peak_categories()
        for name, value in ((f"{key}:reserved", self.b.reserved_peak()), (f"{key}:device", self.b.device_peak())):
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
    run = _Run(workload, backend, device, result)
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
            result.oom_message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            del exc
            # after a device error a read can fail too: the OOM stays the result, the figure stays unknown
            result.failed_phase_peak = _read_after_oom(backend.peak)
            result.failed_phase_reserved = _read_after_oom(backend.reserved_peak)
            result.failed_phase_device = _read_after_oom(backend.device_peak)
            result.failed_categories = backend.peak_categories()
            result.failed_census = _read_after_oom(
                lambda: census(workload.model, workload.optimizer, backend.census_device)
            )
            result.snapshot_path = backend.on_oom(snapshot_path)
        result.device = backend.device_info()
    result.trainable_parameters = workload.trainable_parameters() if workload.model is not None else None
    result.host_peak = _host_peak()
    return result


def _read_after_oom(read: Any) -> Any:
    try:
        return read()
    except Exception:
        return None


def _phases(run: _Run, steps: int) -> None:
    w, b, spec = run.w, run.b, run.w.spec
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
        run.micro_step(spec.seq_worst, i == 0, peaks, cats, extra)
    elapsed = time.perf_counter() - t0
    held_census = census(w.model, w.optimizer, b.census_device)
    for key, name in (("forward", "forward_peak"), ("backward", "backward_peak")):
        run.r.phases[name] = PhaseRecord(
            name,
            peaks[key],
            peaks[key],
            b.current(),
            extra.get(f"{key}:reserved"),
            extra.get(f"{key}:device"),
            cats.get(key),
            held_census,
            elapsed,
        )

    t0 = run.start("optimizer_step", "optimizer")
    w.optimizer_step()
    b.classify(w, stale=("optimizer",))
    w.zero_grad()
    run.record("optimizer_step_peak", t0, False)

    # repeated representative steps at the typical shape
    peaks, cats, extra = {}, {}, {}
    times: list[float] = []
    run.later = True
    t_all = time.perf_counter()
    for _ in range(steps):
        t_step = time.perf_counter()
        for _i in range(spec.accumulation):
            run.micro_step(spec.seq_typical, False, peaks, cats, extra)
        run.where = "optimizer_step"
        b.set_context("optimizer")
        b.reset_peak()
        w.optimizer_step()
        b.classify(w, stale=("optimizer",))
        w.zero_grad()
        run._keep(peaks, cats, extra, "step")
        times.append(time.perf_counter() - t_step)
    best = max(peaks, key=lambda k: peaks[k]) if peaks else "step"
    reserved = [v for k, v in extra.items() if k.endswith(":reserved") and v is not None]
    device = [v for k, v in extra.items() if k.endswith(":device") and v is not None]
    top = max(peaks.values())
    run.r.phases["steady_state_peak"] = PhaseRecord(
        "steady_state_peak",
        top,
        top,
        b.current(),
        max(reserved) if reserved else None,
        max(device) if device else None,
        cats.get(best),
        census(w.model, w.optimizer, b.census_device),
        time.perf_counter() - t_all,
    )
    run.r.step_time_s = sum(times) / len(times) if times else None


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
    "PHASES",
    "PROTOCOL_VERSION",
    "Backend",
    "CudaBackend",
    "PhaseRecord",
    "ProtocolResult",
    "TrackerBackend",
    "run_protocol",
]
