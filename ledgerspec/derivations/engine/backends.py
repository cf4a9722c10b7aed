"""Memory backends of the measurement protocol: what it reads between phases.

- :class:`TrackerBackend`: tensor-level tracking of real CPU tensors or of fake tensors
  (:class:`ledgerspec.derivations.engine.tracker.MemoryTracker`), with an optional simulated memory limit;
- :class:`CudaBackend`: the PyTorch caching allocator's counters, plus device-level memory sampled from NVML
  (or ``cudaMemGetInfo``) in a thread (:class:`DeviceSampler`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ledgerspec.derivations.engine.tracker import SIMULATED_OOM_MARKER, MemoryTracker, SimulatedOOM
from ledgerspec.errors import described

if TYPE_CHECKING:
    from ledgerspec.derivations.engine.workload import Workload


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

    def outside_now(self) -> int | None:
        """Device bytes outside the caching allocator now (device-level used - reserved, read together); None
        where there is no device to read."""
        return None

    def context_reading(self) -> dict[str, Any] | None:
        """What the device held before the first allocation (the CUDA context): ``{"used", "reserved", "source"}``."""
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
                from ledgerspec.derivations.engine.fakemode import fake_mode

                stack.enter_context(fake_mode(allow_non_fake_inputs=True))
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
        self.tracker.reclassify(getattr(workload, "census_model", workload.model), workload.optimizer, stale=stale)

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


class DeviceSampler:
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

    def read(self) -> int | None:
        """One reading now (not kept as a peak); None when it fails."""
        try:
            value = self._read()
        except Exception:
            return None
        return None if value is None else int(value)

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
        self.sampler: DeviceSampler | None = None
        self.recording = False
        self.history_problem: str | None = None  # why no memory history is recorded (no OOM snapshot then)
        self.context: dict[str, Any] | None = None  # the device before the first allocation (session start)

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
                self.history_problem = described(exc, 200)
        try:
            self.sampler = DeviceSampler(cuda, self.index, self.sample_interval, self._nvml)
            # the sampler's synchronize created the CUDA context; nothing is allocated yet: what the device holds
            # for this process now is the context and the modules loaded with it
            self.context = self._read_context(self.sampler)
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

    def _reserved_now(self) -> int | None:
        try:
            return int(self.cuda.memory_reserved(self.index))
        except Exception:  # a stand-in without it
            return None

    def _read_context(self, sampler: DeviceSampler) -> dict[str, Any] | None:
        used = sampler.read()
        if used is None:
            return None
        return {"used": used, "reserved": self._reserved_now() or 0, "source": sampler.source}

    def context_reading(self) -> dict[str, Any] | None:
        return dict(self.context) if self.context is not None else None

    def outside_now(self) -> int | None:
        if self.sampler is None:
            return None
        cuda = self.cuda
        cuda.synchronize(self.index)
        reserved = self._reserved_now()
        used = self.sampler.read()
        if used is None or reserved is None:
            return None
        return max(used - reserved, 0)

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


__all__ = ["CUDA_OOM_MESSAGES", "Backend", "CudaBackend", "DeviceSampler", "TrackerBackend"]
