"""LOGIC TESTS WITH FAKES of the cuda backend of ``ledgerspec measure`` (no GPU is needed, none is used).

What these tests prove: the PLUMBING of :class:`ledgerspec.derivations.engine.backends.CudaBackend`,
:func:`run_protocol` and the cuda write-back of :mod:`ledgerspec.derivations.measure.measurer`, driven by explicit
fakes: :class:`FakeCuda` stands in for the ``torch.cuda`` module (caching-allocator counters whose
values the fake workload below drives: allocated bytes, reserved bytes rounded up to 2 MiB segments that
the cache never gives back, their peaks), :class:`FakeNVML` stands in for nvidia-ml-py's ``pynvml``
(installed into ``sys.modules``; the process list and device memory are the test's numbers). They check
that the peak counters are reset at each phase start and that every phase records the peaks the fake
counters reached in THAT phase; that the NVML sampler thread catches values between phase boundaries,
reads this process's memory (not another's), falls back to device-wide figures when NVML cannot, and
stops; that an out-of-memory error in phase X is recorded as ``oom_phase`` X with a snapshot written
beside the ledger; and that the write-back turns a complete cuda result into MEASURED figures with
which the validator reaches VALIDATED.

What they CANNOT prove: that the real ``torch.cuda`` / NVML return the figures we expect on a GPU, that
device memory is sampled often enough to catch a real transient, or any real number. Expected figures
here are the fake workload's own bytes, added up by hand in the tests; nothing here is a GPU measurement.
``scripts/gpu-check`` on a real GPU is the check for that.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.derivations.engine import backends as B
from ledgerspec.derivations.engine.backends import CudaBackend
from ledgerspec.derivations.engine.protocol import ProtocolResult, run_protocol

MiB = 2**20
SEG = 2 * MiB  # the fake allocator's segment: reserved grows in these steps and is never released
CONTEXT = 500 * MiB  # what the fake driver reports for the CUDA context, outside the allocator
TOTAL = 141 * 10**9
DEVICE_NAME = "Fake H200 (test double)"
DRIVER = "550.54.15"
UUID = "6f1c1b2a-0000-4000-8000-00000000c0de"

# the fake workload's bytes (odd sizes on purpose: segment rounding must show)
BASE = 300 * MiB + 12_345
ADAPTER = 8 * MiB
MICROBATCH, ACCUMULATION, WORST, TYPICAL = 2, 2, 1024, 256


def ids_bytes(seq: int) -> int:
    return MICROBATCH * seq * 8


def act_bytes(seq: int) -> int:  # saved activations of one forward
    return MICROBATCH * seq * 4096


def logits_bytes(seq: int) -> int:
    return MICROBATCH * seq * 2048


def fwd_tmp_bytes(seq: int) -> int:  # a transient inside the forward
    return MICROBATCH * seq * 1024


def roundup(n: int) -> int:
    return -(-n // SEG) * SEG


# -- fakes ------------------------------------------------------------------------------------------------------------


class FakeOOM(RuntimeError):
    """Stands in for ``torch.cuda.OutOfMemoryError``."""


class FakeCuda:
    """A stand-in for the ``torch.cuda`` module: allocator counters driven by :meth:`alloc` / :meth:`free`."""

    OutOfMemoryError = FakeOOM

    def __init__(self, limit: int | None = None) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.limit = limit  # reserved bytes beyond this raise FakeOOM
        self.events: list[tuple[str, Any]] = []
        self.resets = 0
        self.memory = types.SimpleNamespace(_record_memory_history=self._record, _dump_snapshot=self._dump)
        self.recording: str | None = None

    # what the workload does
    def alloc(self, n: int) -> None:
        if self.limit is not None and roundup(self.allocated + n) > self.limit:
            self.events.append(("oom", n))
            raise FakeOOM(f"CUDA out of memory. Tried to allocate {n} bytes (fake)")
        self.allocated += n
        self.reserved = max(self.reserved, roundup(self.allocated))
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.events.append(("alloc", n))

    def free(self, n: int) -> None:
        self.allocated -= n
        assert self.allocated >= 0

    # the torch.cuda API the backend uses
    def set_device(self, index: int) -> None:
        self.events.append(("set_device", index))

    def init(self) -> None:
        self.events.append(("init", None))

    def synchronize(self, index: int | None = None) -> None:
        pass

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.events.append(("reset", index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return self.peak_allocated

    def memory_allocated(self, index: int | None = None) -> int:
        return self.allocated

    def max_memory_reserved(self, index: int | None = None) -> int:
        return self.peak_reserved

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return TOTAL - (CONTEXT + self.reserved), TOTAL

    def get_device_properties(self, index: int) -> Any:
        return types.SimpleNamespace(name=DEVICE_NAME, total_memory=TOTAL, uuid=UUID, major=9, minor=0)

    def _record(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self.recording = enabled
        self.events.append(("record_history", enabled))

    def _dump(self, filename: str) -> None:
        Path(filename).write_bytes(b"fake snapshot")
        self.events.append(("dump_snapshot", filename))


class FakeNVML(types.ModuleType):
    """A stand-in for nvidia-ml-py's ``pynvml``: this process uses CONTEXT + the fake allocator's reserved bytes.

    ``mode``: ``"listed"`` (this process listed with its memory), ``"na"`` (listed, usedGpuMemory None as in
    some containers and on WDDM), ``"host_pid"`` (only a foreign PID is listed: a container's PID namespace).
    ``other`` bytes belong to another process on the same device.
    """

    def __init__(self, cuda: FakeCuda, mode: str = "listed", other: int = 7 * 2**30) -> None:
        super().__init__("pynvml")
        self.cuda, self.mode, self.other = cuda, mode, other
        self.calls: list[str] = []
        self.initialised = 0
        self.value: int | None = None  # when set, the per-process figure the test wants sampled

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.calls.append(f"uuid:{uuid}")
        if uuid != "GPU-" + UUID:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle0"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.calls.append(f"index:{index}")
        return "handle0"

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return DRIVER.encode()  # old nvidia-ml-py returns bytes

    def ours(self) -> int:
        return self.value if self.value is not None else CONTEXT + self.cuda.reserved

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        assert handle == "handle0"
        procs = [types.SimpleNamespace(pid=1, usedGpuMemory=self.other)]
        if self.mode == "listed":
            procs.append(types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.ours()))
        elif self.mode == "na":
            procs.append(types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None))
        return procs

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        used = self.ours() + self.other
        return types.SimpleNamespace(used=used, total=TOTAL, free=TOTAL - used)


@dataclass
class FakeSpec:
    microbatch: int = MICROBATCH
    accumulation: int = ACCUMULATION
    seq_worst: int = WORST
    seq_typical: int = TYPICAL


@dataclass
class FakeWorkload:
    """Duck-types :class:`ledgerspec.derivations.engine.workload.Workload`; every step allocates known bytes.

    ``fail_at = (stage, n)``: the n-th call (1-based) of that stage raises the fake OOM. ``log`` holds
    (stage, resets seen so far) so a test can check that a reset preceded the stage.
    """

    cuda: FakeCuda
    spec: FakeSpec = field(default_factory=FakeSpec)
    fail_at: tuple[str, int] | None = None
    model: Any = None
    optimizer: Any = None
    log: list[tuple[str, int]] = field(default_factory=list)
    grads_held: bool = False
    state_held: bool = False
    _live: dict[str, int] = field(default_factory=dict)

    def _enter(self, stage: str) -> None:
        self.log.append((stage, self.cuda.resets))
        if self.fail_at is not None and self.fail_at[0] == stage:
            if sum(1 for s, _ in self.log if s == stage) == self.fail_at[1]:
                raise FakeOOM(f"CUDA out of memory. Tried to allocate 20.00 GiB (fake, in {stage})")

    def prepare(self) -> None:
        pass

    def materialise_base(self, device: Any) -> None:
        self._enter("materialise_base")
        self.cuda.alloc(BASE)

    def materialise_adapters(self, device: Any) -> None:
        self._enter("materialise_adapters")
        self.cuda.alloc(ADAPTER)

    def make_optimizer(self) -> None:
        self._enter("make_optimizer")  # torch optimizers create their state lazily, at the first step

    def batch(self, seq: int) -> tuple[int, int]:
        self._enter("batch")
        self.cuda.alloc(ids_bytes(seq))
        self._live["seq"] = seq
        return seq, seq

    def forward(self, ids: int) -> int:
        self._enter("forward")
        seq = self._live["seq"]
        self.cuda.alloc(act_bytes(seq))
        self.cuda.alloc(logits_bytes(seq))
        self.cuda.alloc(fwd_tmp_bytes(seq))
        self.cuda.free(fwd_tmp_bytes(seq))
        return seq

    def loss(self, logits: int, labels: int) -> int:
        self._enter("loss")
        self.cuda.alloc(logits_bytes(logits))  # the fp32 upcast of the logits, transient
        self.cuda.free(logits_bytes(logits))
        return logits

    def backward(self, loss: int) -> None:
        self._enter("backward")
        seq = loss
        if not self.grads_held:
            self.cuda.alloc(ADAPTER)
            self.grads_held = True
        self.cuda.alloc(2 * act_bytes(seq))  # transient gradients of activations
        self.cuda.free(2 * act_bytes(seq))
        self.cuda.free(act_bytes(seq) + logits_bytes(seq) + ids_bytes(seq))

    def optimizer_step(self) -> None:
        self._enter("optimizer_step")
        if not self.state_held:
            self.cuda.alloc(2 * ADAPTER)  # AdamW's two moments
            self.state_held = True
        self.cuda.alloc(ADAPTER)  # a transient
        self.cuda.free(ADAPTER)

    def zero_grad(self) -> None:
        self._enter("zero_grad")
        if self.grads_held:
            self.cuda.free(ADAPTER)
            self.grads_held = False

    def trainable_parameters(self) -> int:
        return ADAPTER // 4


@pytest.fixture
def fake_cuda() -> FakeCuda:
    return FakeCuda()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> FakeNVML:
    nvml = FakeNVML(fake_cuda)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def _run(
    cuda: FakeCuda, snapshot: str | None = None, **workload: Any
) -> tuple[ProtocolResult, CudaBackend, FakeWorkload]:
    backend = CudaBackend(cuda=cuda, sample_interval=0.001)
    w = FakeWorkload(cuda, **workload)
    result = run_protocol(w, backend, device="cuda", steps=2, snapshot_path=snapshot)  # type: ignore[arg-type]
    return result, backend, w


# -- peaks per phase ---------------------------------------------------------------------------------------------------


def expected_phases() -> dict[str, int]:
    """The phase figures of the fake workload, added up by hand (held bytes for after_*, else the phase peak)."""
    held = BASE + ADAPTER
    step = BASE + ADAPTER + ADAPTER + 2 * ADAPTER + ADAPTER  # base, adapter, grads, new state, a transient
    steady_forward = (
        BASE + 4 * ADAPTER + ids_bytes(TYPICAL) + act_bytes(TYPICAL) + logits_bytes(TYPICAL) + fwd_tmp_bytes(TYPICAL)
    )
    steady_backward = BASE + 4 * ADAPTER + ids_bytes(TYPICAL) + 3 * act_bytes(TYPICAL) + logits_bytes(TYPICAL)
    return {
        "after_load": BASE,
        "after_adapter_injection": held,
        "after_optimizer_init": held,
        # the 2nd micro-step is the larger: the 1st one's gradients are held while it runs
        "forward_peak": held
        + ADAPTER
        + ids_bytes(WORST)
        + act_bytes(WORST)
        + logits_bytes(WORST)
        + fwd_tmp_bytes(WORST),
        "backward_peak": held + ADAPTER + ids_bytes(WORST) + 3 * act_bytes(WORST) + logits_bytes(WORST),
        "optimizer_step_peak": step,
        "steady_state_peak": max(steady_forward, steady_backward, step),
    }


def test_every_phase_records_the_peak_the_counters_reached_in_that_phase(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML
) -> None:
    result, _, _ = _run(fake_cuda)
    assert result.complete and not result.oom
    assert {k: r.figure for k, r in result.phases.items()} == expected_phases()
    # without the resets the steady state (typical shape) would report the worst shape's backward peak
    assert result.phases["steady_state_peak"].figure < result.phases["backward_peak"].figure
    assert result.peak_allocated() == max(expected_phases().values())
    assert result.activations_saved == ids_bytes(WORST) + act_bytes(WORST) + logits_bytes(WORST)
    assert result.phases["after_optimizer_init"].held == BASE + ADAPTER


def test_peak_counters_are_reset_at_the_start_of_every_phase(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    _, _, w = _run(fake_cuda)
    starts = ("materialise_base", "materialise_adapters", "make_optimizer", "batch", "loss", "optimizer_step")
    previous = -1
    for stage, resets in w.log:
        if stage in starts:
            assert resets > previous, f"{stage} ran without a reset of the peak counters since the last stage"
        previous = resets
    # one reset per phase start: 3 after_* phases, per micro-step forward + loss (2 x 2 worst, 2 x 2 x 2 typical),
    # one optimizer step at the worst shape and one per steady step
    assert fake_cuda.resets == 3 + 2 * ACCUMULATION + 1 + 2 * (2 * ACCUMULATION + 1)


def test_reserved_is_recorded_per_phase_and_never_below_allocated(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    result, _, _ = _run(fake_cuda)
    exp = expected_phases()
    top = roundup(exp["backward_peak"])  # the largest allocation of the run: the cache keeps its segments
    assert top == roundup(max(exp.values()))
    expected_reserved = {
        "after_load": roundup(BASE),
        "after_adapter_injection": roundup(BASE + ADAPTER),
        "after_optimizer_init": roundup(BASE + ADAPTER),
        # the 2nd micro-step's forward runs on a cache the 1st micro-step's backward already grew
        "forward_peak": top,
        "backward_peak": top,
        "optimizer_step_peak": top,
        "steady_state_peak": top,
    }
    assert {k: r.reserved_peak for k, r in result.phases.items()} == expected_reserved
    for rec in result.phases.values():
        assert (rec.reserved_peak or 0) >= rec.peak
    assert result.peak_reserved() == top
    assert (result.peak_reserved() or 0) >= (result.peak_allocated() or 0)


# -- device-level memory (NVML) -----------------------------------------------------------------------------------


def test_device_peak_is_this_process_from_nvml_per_process(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    result, _, _ = _run(fake_cuda)
    for name, rec in result.phases.items():
        # this process: the context plus what its allocator reserved (never the other process's 7 GiB)
        assert rec.device_peak == CONTEXT + (rec.reserved_peak or 0), name
    assert result.device["device_memory_source"].startswith("NVML per-process")
    assert result.device["driver"] == DRIVER
    assert fake_nvml.calls[0] == "uuid:GPU-" + UUID  # the handle of torch's device, found by UUID
    assert (result.device_peak() or 0) >= (result.peak_reserved() or 0)


@pytest.mark.parametrize("mode", ["na", "host_pid"])
def test_device_wide_nvml_when_the_process_has_no_figure_of_its_own(
    mode: str, fake_cuda: FakeCuda, fake_nvml: FakeNVML
) -> None:
    fake_nvml.mode = mode
    result, _, _ = _run(fake_cuda)
    assert "device-wide" in result.device["device_memory_source"]
    for rec in result.phases.values():  # the other process counts too: the source says so
        assert rec.device_peak == CONTEXT + (rec.reserved_peak or 0) + fake_nvml.other


def test_cuda_mem_get_info_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    result, _, _ = _run(fake_cuda)
    assert result.device["device_memory_source"].startswith("cudaMemGetInfo")
    for rec in result.phases.values():
        assert rec.device_peak == CONTEXT + (rec.reserved_peak or 0)


def test_the_real_nvidia_ml_py_without_a_driver_falls_back_cleanly(fake_cuda: FakeCuda) -> None:
    """nvmlInit of the REAL nvidia-ml-py fails on a machine without the NVIDIA driver: no crash, cudaMemGetInfo."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    except pynvml.NVMLError:
        pass
    sampler = B.DeviceSampler(fake_cuda, 0)
    assert sampler.source.startswith("cudaMemGetInfo")
    fake_cuda.alloc(3 * MiB)
    assert sampler.peak() == CONTEXT + 4 * MiB


def _wait_for(condition: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the sampler thread did not sample"
        time.sleep(0.001)


def test_the_sampler_thread_catches_a_spike_between_phase_boundaries(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    sampler = B.DeviceSampler(fake_cuda, 0, interval=0.001, nvml=fake_nvml)
    sampler.start()
    try:
        fake_nvml.value = 1 * MiB
        sampler.reset()
        seen = sampler.samples
        fake_nvml.value = 900 * MiB  # a transient inside the phase...
        _wait_for(lambda: sampler.samples >= seen + 3)
        fake_nvml.value = 2 * MiB  # ...gone before the phase ends
        assert sampler.peak() == 900 * MiB  # an end-of-phase read alone would say 2 MiB
        sampler.reset()
        assert sampler.peak() == 2 * MiB  # a reset forgets the previous phase
    finally:
        sampler.stop()
    assert not sampler.running and fake_nvml.initialised == 0


def test_a_sample_read_before_a_reset_never_lands_after_it(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    sampler = B.DeviceSampler(fake_cuda, 0, nvml=fake_nvml)
    reading, release = threading.Event(), threading.Event()
    main = threading.current_thread()

    def read() -> int:
        if threading.current_thread() is main:
            return 1 * MiB
        reading.set()
        release.wait(5)
        return 900 * MiB  # a figure of the previous phase, delivered late

    sampler._read = read
    late = threading.Thread(target=sampler.sample)
    late.start()
    assert reading.wait(5)
    sampler.reset()  # the next phase starts while the slow read is in flight
    release.set()
    late.join(5)
    assert sampler.peak() == 1 * MiB
    sampler.stop()


def test_no_sample_means_no_device_figure(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    sampler = B.DeviceSampler(fake_cuda, 0, nvml=fake_nvml)

    def broken() -> int:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    sampler._read = broken
    sampler.reset()
    assert sampler.peak() is None  # unknown, never a made-up 0
    sampler.stop()


def test_the_sampler_stops_and_history_recording_ends_when_a_run_fails(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML
) -> None:
    class Broken(FakeWorkload):
        def make_optimizer(self) -> None:
            raise KeyError("not an out-of-memory error")

    backend = CudaBackend(cuda=fake_cuda, sample_interval=0.001)
    with pytest.raises(KeyError):
        run_protocol(Broken(fake_cuda), backend, device="cuda")  # type: ignore[arg-type]
    assert backend.sampler is not None and not backend.sampler.running
    assert fake_nvml.initialised == 0  # nvmlShutdown matched nvmlInit
    assert fake_cuda.recording is None and not backend.recording
    assert not [t for t in threading.enumerate() if t.name == "ledgerspec-device-sampler"]


# -- out of memory ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "nth", "phase"),
    [
        ("materialise_base", 1, "load"),
        ("materialise_adapters", 1, "adapter_injection"),
        ("make_optimizer", 1, "optimizer_init"),
        ("forward", 2, "forward"),  # the 2nd micro-step of the representative step
        ("loss", 1, "loss"),
        ("backward", 1, "backward"),
        ("optimizer_step", 1, "optimizer_step"),
        ("forward", 3, "later_iteration"),  # in the repeated steady-state steps
    ],
)
def test_an_oom_in_phase_x_is_recorded_as_x_with_a_snapshot_beside_the_ledger(
    stage: str, nth: int, phase: str, fake_cuda: FakeCuda, fake_nvml: FakeNVML, tmp_path: Path
) -> None:
    snapshot = str(tmp_path / "ledger.oom-snapshot.pickle")
    result, backend, _ = _run(fake_cuda, snapshot, fail_at=(stage, nth))
    assert result.oom and not result.simulated_oom
    assert result.oom_phase == phase
    assert "CUDA out of memory" in (result.oom_message or "")
    assert result.snapshot_path == snapshot and Path(snapshot).read_bytes() == b"fake snapshot"
    names = [e[0] for e in fake_cuda.events]
    # history recording was on before the first allocation, the dump came after the OOM, recording ended after it
    first_allocation = min((i for i, n in enumerate(names) if n in ("alloc", "oom")), default=len(names))
    assert names.index("record_history") < first_allocation
    assert fake_cuda.events[names.index("record_history")][1] == "all"
    dump = names.index("dump_snapshot")
    assert ("record_history", None) in fake_cuda.events[dump:]
    assert backend.sampler is not None and not backend.sampler.running
    assert (result.peak_reserved() or 0) >= (result.peak_allocated() or 0)


def test_an_oom_raised_by_the_allocator_keeps_reserved_above_allocated(fake_nvml: FakeNVML, tmp_path: Path) -> None:
    """The failed phase is the peak phase: its reserved and device figures must be kept too (else LS040)."""
    # enough for everything up to the first backward's transient at the worst shape, not for the transient
    first_backward = BASE + ADAPTER + ids_bytes(WORST) + act_bytes(WORST) + logits_bytes(WORST) + ADAPTER
    cuda = FakeCuda(limit=roundup(first_backward) + SEG)
    fake_nvml.cuda = cuda
    result, _, _ = _run(cuda, str(tmp_path / "ledger.oom-snapshot.pickle"))
    assert result.oom and result.oom_phase == "backward"
    assert result.failed_phase_peak == first_backward
    assert result.failed_phase_reserved == roundup(first_backward)
    assert result.failed_phase_device == CONTEXT + roundup(first_backward)
    assert result.peak_allocated() == first_backward
    assert (result.peak_reserved() or 0) >= first_backward
    assert result.device_peak() == CONTEXT + roundup(first_backward)


def test_an_older_torch_without_this_history_api_still_measures_without_a_snapshot(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML, tmp_path: Path
) -> None:
    def old_signature(enabled: bool = True, record_context: bool = True) -> None:  # torch 2.0's private API
        raise AssertionError("not reached: the keyword arguments do not match")

    fake_cuda.memory = types.SimpleNamespace(
        _record_memory_history=old_signature, _dump_snapshot=fake_cuda.memory._dump_snapshot
    )
    result, _, _ = _run(fake_cuda, str(tmp_path / "ledger.oom-snapshot.pickle"), fail_at=("forward", 1))
    assert result.oom and result.oom_phase == "forward"
    assert result.snapshot_path is None and not (tmp_path / "ledger.oom-snapshot.pickle").exists()
    assert result.device["memory_history"].startswith("not recorded: TypeError")


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (FakeOOM("anything"), "cuda"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda"),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "cuda"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "cuda"),
        (RuntimeError("NCCL error in: ... Cuda failure 'out of memory'"), "cuda"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
        (ValueError("shape mismatch"), None),
    ],
)
def test_out_of_memory_errors_are_recognised(exc: BaseException, kind: str | None, fake_cuda: FakeCuda) -> None:
    assert CudaBackend(cuda=fake_cuda).oom_kind(exc) == kind


def test_the_real_torch_cuda_oom_type_is_recognised_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    backend = CudaBackend()  # the real torch.cuda module: oom_kind needs no device
    assert backend.oom_kind(torch.cuda.OutOfMemoryError("Tried to allocate 2.00 GiB")) == "cuda"


class RealSignatures:
    """:class:`FakeCuda` behind the INSTALLED torch.cuda's own signatures: every call the backend makes is first
    bound to the real function (a keyword the real torch does not take fails here, as it would on a GPU)."""

    def __init__(self, fake: FakeCuda) -> None:
        import torch

        self._fake, self._real = fake, torch.cuda
        self.calls: set[str] = set()
        history = getattr(torch.cuda.memory, "_record_memory_history_impl", torch.cuda.memory._record_memory_history)
        self.memory = types.SimpleNamespace(
            _record_memory_history=self._checked(
                "memory._record_memory_history", history, fake.memory._record_memory_history
            ),
            _dump_snapshot=self._checked(
                "memory._dump_snapshot", torch.cuda.memory._dump_snapshot, fake.memory._dump_snapshot
            ),
        )
        self.OutOfMemoryError = torch.cuda.OutOfMemoryError

    def _checked(self, name: str, real: Any, fake: Any) -> Any:
        import inspect

        def call(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(real).bind(*args, **kwargs)  # TypeError if the real torch would refuse the call
            self.calls.add(name)
            return fake(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        return self._checked(name, getattr(self._real, name), getattr(self._fake, name))


def test_every_torch_cuda_call_binds_to_the_installed_torch_signatures(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML, tmp_path: Path
) -> None:
    """The private history API changed signature before (torch 2.0 -> 2.1); the device runs torch 2.11, whose
    signatures of these functions are the same as 2.13's (checked against its wheel's sources)."""
    pytest.importorskip("torch")
    cuda = RealSignatures(fake_cuda)
    backend = CudaBackend(cuda=cuda, sample_interval=0.001)
    fake_nvml.cuda = fake_cuda
    workload: Any = FakeWorkload(fake_cuda, fail_at=("backward", 1))
    result = run_protocol(workload, backend, device="cuda", steps=2, snapshot_path=str(tmp_path / "x.pickle"))
    assert result.oom and result.snapshot_path and backend.history_problem is None
    assert result.device["memory_history"].startswith("recorded")
    assert {
        "set_device",
        "init",
        "synchronize",
        "reset_peak_memory_stats",
        "max_memory_allocated",
        "memory_allocated",
        "max_memory_reserved",
        "get_device_properties",
        "memory._record_memory_history",
        "memory._dump_snapshot",
    } <= cuda.calls


def test_constructing_the_backend_touches_no_device() -> None:
    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"torch.cuda.{name} used before the session")

    CudaBackend(cuda=Exploding(), record_history=True)  # the child builds it before anything else


# -- write-back and the status ladder ---------------------------------------------------------------------------------

DATA = Path(__file__).parent / "data" / "measure"


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The tiny Llama ledger, resolved (CPU), with a target device and an activation estimate."""
    import shutil

    pytest.importorskip("peft")
    from ledgerspec import resolve
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render

    shutil.copytree(DATA / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / "tiny-llama-lora.yaml"
    shutil.copy(DATA / "tiny-llama-lora.yaml", path)
    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture: stands in for estimate")
    atomic_write(path, render(doc.data, doc.text))
    return path


def _stack() -> dict[str, str]:
    from importlib import metadata

    return {name: metadata.version(name) for name in ("torch", "transformers", "peft")}


def _cuda_output(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, snapshot: str | None = None, **workload: Any
) -> Any:
    import torch

    from ledgerspec.derivations.measure.measurer import ChildOutput

    monkeypatch.setattr(torch.version, "cuda", "12.8")  # what a CUDA build reports; device_info reads it
    result, _, _ = _run(fake_cuda, snapshot, **workload)
    # across the child-process boundary, as in `measure`
    return ChildOutput(ProtocolResult.from_json(result.to_json()), _stack())


def test_write_back_records_measured_cuda_figures_and_the_ladder_reaches_validated(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_plain
    from ledgerspec.derivations.measure.measurer import write_back

    out = _cuda_output(fake_cuda, monkeypatch)
    doc = load(ledger)
    notes = write_back(doc, out, "ledgerspec measure tiny-llama-lora.yaml --device cuda --steps 2")
    assert not any("cpu backend" in n for n in notes)
    exp = expected_phases()
    for name, figure in exp.items():
        v = doc.get("phases", name)
        assert v.source == "MEASURED" and v.size() == figure, name
    top = roundup(max(exp.values()))
    figures = {k: doc.get("metrics", k) for k in ("peak_allocated", "peak_reserved", "device_peak")}
    assert {k: (v.source, v.size()) for k, v in figures.items()} == {
        "peak_allocated": ("MEASURED", max(exp.values())),
        "peak_reserved": ("MEASURED", top),
        "device_peak": ("MEASURED", CONTEXT + top),
    }
    assert "max_memory_reserved" in str(figures["peak_reserved"].method)
    assert "NVML per-process" in str(figures["device_peak"].method)
    assert doc.get("ledger", "activations").source == "MEASURED"
    software = {k: doc.get("software", k).value for k in ("cuda", "driver", "gpu_name", "torch", "peft")}
    assert software == {
        "cuda": "12.8",
        "driver": DRIVER,
        "gpu_name": DEVICE_NAME,
        "torch": _stack()["torch"],
        "peft": _stack()["peft"],
    }
    assert doc.get("measurement", "device").value == "cuda"
    assert doc.get("measurement", "device_name").value == DEVICE_NAME
    assert doc.get("measurement", "device_memory").size() == TOTAL
    assert doc.get("result", "oom").switch() is False
    report = validate(doc)
    assert not [f for f in report.findings if f.severity == "error"], report.findings
    # the fake run holds no real tensors, so the census cannot explain the difference: the one gap left is the
    # human's known_explanation (the spec leaves it to the human unless the measured categories explain it)
    assert report.supported_status == "CANDIDATE"
    assert report.reasons == ["VALIDATED needs comparison filled, with known_explanation"]
    set_plain(doc, ("comparison", "known_explanation"), "activations and temporaries (reviewed by a human)")
    report = validate(doc)
    assert report.supported_status == "VALIDATED", report.reasons
    assert not [f for f in report.findings if f.severity == "error"], report.findings


def test_measure_on_cuda_asks_for_a_snapshot_beside_the_ledger_and_writes_an_oom(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.measure import measurer as M

    seen: list[Any] = []

    def child(req: Any, timeout: float | None = None) -> Any:  # the child process, replaced by the fakes
        seen.append(req)
        return _cuda_output(fake_cuda, monkeypatch, req.snapshot_path, fail_at=("backward", 1))

    monkeypatch.setattr(M, "run_child", child)
    before = ledger.read_bytes()
    target = ledger.with_name("measured.yaml")
    from ledgerspec.contract.document import load_ledger
    from ledgerspec.contract.writer import save
    from ledgerspec.faces.status import settle

    measured = load_ledger(str(ledger), "measure")
    outcome = M.measure(measured, device="cuda", snapshot_path=M.snapshot_path_for(str(target)))
    settle(measured)
    save(measured, str(target))
    assert seen[0].device == "cuda" and seen[0].memory_limit is None
    assert seen[0].snapshot_path == str(target.with_name("measured.oom-snapshot.pickle"))
    assert Path(seen[0].snapshot_path).exists()
    assert ledger.read_bytes() == before
    doc = load(target)
    assert doc.get("result", "oom").switch() is True and doc.get("result", "oom_phase").value == "backward"
    assert doc.get("x-measure", "oom", "snapshot").value == seen[0].snapshot_path
    assert any("memory_viz" in n for n in outcome.notes)
    assert validate(doc).supported_status != "VALIDATED"
    findings = {f.rule for f in validate(doc).findings if f.severity == "error"}
    assert not findings & {"LS040", "LS070", "LS080"}, findings


# -- nccl --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "count", "local_rank", "nproc", "needle"),
    [
        (False, 0, 0, 2, "no CUDA device"),
        (True, 1, 0, 2, "one GPU per rank"),  # two ranks on one GPU: nccl refuses; every rank says so
        (True, 1, 1, 2, "one GPU per rank"),
        (True, 8, 1, 2, None),
    ],
)
def test_each_nccl_rank_needs_its_own_gpu(
    available: bool, count: int, local_rank: int, nproc: int, needle: str | None
) -> None:
    from ledgerspec.derivations.measure.dist import cuda_rank_problem

    problem = cuda_rank_problem(available, count, local_rank, nproc)
    assert (problem is None) if needle is None else (needle in (problem or ""))


# -- scripts/gpu-check -------------------------------------------------------------------------------------------------

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


def _load_script(path: Path, name: str) -> Any:
    """A script without a .py suffix, imported as a module."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _script() -> Any:
    return _load_script(SCRIPT, "gpu_check_under_test")


def test_gpu_check_dry_run_needs_neither_torch_nor_cuda(tmp_path: Path) -> None:
    import subprocess

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('the dry run must not import torch')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in ("lora-gc-off.yaml", "lora-gc-on.yaml", "qlora-gc-off-eager.yaml", "qlora-gc-on.yaml"):
        assert f"  {name}:" in out
        assert (
            f"ledgerspec measure {SCRIPT.parent.parent}/benchmarks/results/gpu-check/{name} --device cuda "
            f"--steps 3" in out
        )
    assert "needs bitsandbytes: QLoRA" in out
    assert "Traceback" not in proc.stderr


def test_gpu_check_dry_run_says_which_rows_it_would_skip_without_bitsandbytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    monkeypatch.setattr(mod, "WHEELS", tmp_path / "no-wheels")
    plan = mod.plan(sorted(mod.CASES.glob("*.yaml")))
    lines = {
        line.split(":")[0].strip(): line for line in plan.splitlines() if line.startswith("  ") and ".yaml:" in line
    }
    assert lines["qlora-gc-on.yaml"].split(": ", 1)[1].startswith("SKIP: needs bitsandbytes")
    assert lines["lora-gc-on.yaml"].endswith(": run")
    assert "bitsandbytes: MISSING (optional)" in plan


def test_gpu_check_skips_the_bitsandbytes_rows_with_a_note_and_writes_one_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plumbing of the script's main loop, every GPU-touching step faked: no real measurement happens here."""
    import torch

    mod = _script()
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "ensure_packages", lambda: {"bitsandbytes"})
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mod, "WORK", tmp_path / "results" / "gpu-check")
    monkeypatch.setattr(mod, "header", lambda missing: f"# gpu-check (faked header; missing {sorted(missing)})")
    monkeypatch.setattr(mod, "estimated_activations", lambda path: None)

    def cli(*args: str) -> tuple[int, str]:
        ran.append(args)
        return 0, ""

    def row(path: Path, est: int | None) -> dict[str, Any]:
        comps = {k: (MiB, MiB) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")}
        return {
            "name": path.stem,
            "comps": comps,
            "phases": dict.fromkeys(mod.PHASES, MiB),
            "allocated": 3 * MiB,
            "reserved": 4 * MiB,
            "device": 5 * MiB,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": 2 * MiB,
            "device_source": "fake",
        }

    monkeypatch.setattr(mod, "cli", cli)
    monkeypatch.setattr(mod, "row", row)
    assert mod.main([]) == 0
    measured = {Path(a[1]).name for a in ran if a[0] == "measure"}
    assert measured == {"lora-gc-off.yaml", "lora-gc-on.yaml"}
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert report.strip() == capsys.readouterr().out.strip()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert table[0] == "| MiB (calculated / measured) | lora-gc-off | lora-gc-on |"
    assert len([line for line in report.splitlines() if line.startswith("| MiB")]) == 1  # one table
    assert any(line.startswith("| **peak reserved** | 4.0 | 4.0 |") for line in table)
    assert "qlora-gc-on.yaml: skipped, it needs bitsandbytes for QLoRA" in report


def _script_main_faked(mod: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake every GPU-touching step of the script's main loop (the plumbing tests below)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "ensure_packages", lambda: set())
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mod, "WORK", tmp_path / "results" / "gpu-check")
    monkeypatch.setattr(mod, "header", lambda missing: "# gpu-check (faked header)")
    monkeypatch.setattr(mod, "estimated_activations", lambda path: None)


def test_gpu_check_reads_its_table_column_from_a_ledger_measured_on_cuda(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script's row() on what `measure --device cuda` writes (the fake run, written back and saved)."""
    from ledgerspec.contract.document import load
    from ledgerspec.contract.writer import save
    from ledgerspec.derivations.measure.measurer import write_back

    mod = _script()
    doc = load(ledger)
    calculated = {k: doc.get("ledger", k).size() for k in ("frozen_base", "adapter", "gradients", "optimizer")}
    write_back(doc, _cuda_output(fake_cuda, monkeypatch), "ledgerspec measure --device cuda")
    save(doc, str(ledger))
    r = mod.row(ledger, 1_000_000)
    exp = expected_phases()
    top = roundup(max(exp.values()))
    assert r["phases"] == exp
    assert (r["allocated"], r["reserved"], r["device"]) == (max(exp.values()), top, CONTEXT + top)
    assert r["oom"] is False and r["status"] == "CANDIDATE"
    assert {k: r["comps"][k][0] for k in calculated} == calculated  # the calculated side: the resolver's figures
    assert r["comps"]["activations"] == (1_000_000, ids_bytes(WORST) + act_bytes(WORST) + logits_bytes(WORST))
    assert r["device_source"].startswith("NVML per-process")
    table = mod.table([r])
    assert f"| **device peak** | {(CONTEXT + top) / MiB:,.1f} |" in table
    assert f"| phase backward_peak | {exp['backward_peak'] / MiB:,.1f} |" in table


def test_gpu_check_installs_carried_wheels_exactly_as_the_device_readme_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    for name in ("ruamel_yaml-0.19.1-py3-none-any.whl", "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"):
        (wheels / name).write_bytes(b"")
    monkeypatch.setattr(mod, "WHEELS", wheels)
    monkeypatch.setattr(mod, "ROOT", Path("/repo"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/repo")
    installed: set[str] = set()
    ran: list[list[str]] = []

    def run(cmd: list[str], check: bool = False) -> Any:
        ran.append(cmd)
        installed.update({"ruamel.yaml", "bitsandbytes"})
        return types.SimpleNamespace(returncode=0)

    present = {"jsonschema", "transformers", "peft", "accelerate", "pynvml"}
    monkeypatch.setattr(mod, "importable", lambda module: module in present | installed)
    monkeypatch.setattr(mod.subprocess, "run", run)
    assert mod.ensure_packages() == set()
    assert ran == [
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            "/tmp/site",
            *sorted(map(str, wheels.glob("*.whl"))),
        ]
    ]
    # the measure children find the project first, then the carried packages
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/repo", "/tmp/site"])
    assert "/tmp/site" in sys.path


def test_gpu_check_without_wheels_fails_on_a_required_package_and_skips_an_optional_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    monkeypatch.setattr(mod, "WHEELS", tmp_path / "none")
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: pytest.fail("nothing to install"))
    monkeypatch.setattr(mod, "importable", lambda module: module != "bitsandbytes")
    assert mod.ensure_packages() == {"bitsandbytes"}
    monkeypatch.setattr(mod, "importable", lambda module: module != "jsonschema")
    with pytest.raises(SystemExit) as exc:
        mod.ensure_packages()
    assert exc.value.code == 2


def test_gpu_check_keeps_measuring_when_a_command_raises_and_logs_its_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With LEDGERSPEC_DEBUG=1 the CLI re-raises: one configuration's failure must not lose the others."""
    import ledgerspec.faces.cli as cli_module

    mod = _script()
    _script_main_faked(mod, monkeypatch, tmp_path)

    def main(args: list[str]) -> int:
        if args[0] == "measure" and Path(args[1]).name == "lora-gc-off.yaml":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 0

    monkeypatch.setattr(cli_module, "main", main)
    monkeypatch.setattr(
        mod,
        "row",
        lambda path, est: {
            "name": path.stem,
            "comps": {k: (MiB, MiB) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")},
            "phases": dict.fromkeys(mod.PHASES, MiB),
            "allocated": MiB,
            "reserved": MiB,
            "device": MiB,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": MiB,
            "device_source": None,
        },
    )
    assert mod.main([str(mod.CASES / "lora-gc-off.yaml"), str(mod.CASES / "lora-gc-on.yaml")]) == 1
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert "| MiB (calculated / measured) | lora-gc-on |" in report  # the second configuration still ran
    assert "lora-gc-off.yaml: `ledgerspec measure" in report and "exited 3" in report
    log = (tmp_path / "results" / "gpu-check" / "lora-gc-off.log").read_text()
    assert "Traceback" in log and "illegal memory access" in log and "$ ledgerspec resolve" in log
    assert "Not run yet" not in report


def test_gpu_check_rewrites_its_report_after_each_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run cut short (a device-time limit) keeps the rows measured so far, and says what did not run."""
    mod = _script()
    _script_main_faked(mod, monkeypatch, tmp_path)
    monkeypatch.setattr(mod, "cli", lambda *args: (0, ""))
    seen: list[str] = []

    def row(path: Path, est: int | None) -> dict[str, Any]:
        report = tmp_path / "results" / "gpu-check.md"
        seen.append(report.read_text() if report.exists() else "")
        if path.stem == "lora-gc-on":
            raise KeyboardInterrupt  # cut short while the second configuration is read
        return {
            "name": path.stem,
            "comps": {k: (None, None) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")},
            "phases": dict.fromkeys(mod.PHASES),
            "allocated": 7 * MiB,
            "reserved": None,
            "device": None,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": None,
            "device_source": None,
        }

    monkeypatch.setattr(mod, "row", row)
    with pytest.raises(KeyboardInterrupt):
        mod.main([str(mod.CASES / "lora-gc-off.yaml"), str(mod.CASES / "lora-gc-on.yaml")])
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert "| **peak allocated** | 7.0 |" in report
    assert "Not run yet (the run was cut short if this stays): lora-gc-on.yaml" in report


def test_gpu_check_prepared_ledger_points_at_the_config_from_any_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The repository may sit anywhere on the GPU machine: a path with a space or ': ' must stay one YAML string."""
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.stack.build import config_file

    mod = _script()
    monkeypatch.setattr(mod, "WORK", tmp_path / "work")
    repo = tmp_path / "a repo: copy"
    shutil.copytree(mod.CASES.parent, repo / "qwen")
    path = mod.prepare(repo / "qwen" / "gpu-check" / "lora-gc-on.yaml")
    doc = load(path)
    found = config_file(doc)
    assert found is not None and found[0] == (repo / "qwen" / "config.json").resolve()


# -- scripts/gpu-wheels ------------------------------------------------------------------------------------------------

WHEELS_SCRIPT = SCRIPT.parent / "gpu-wheels"


def _wheels_script() -> Any:
    return _load_script(WHEELS_SCRIPT, "gpu_wheels_under_test")


def _wheel(folder: Path, filename: str, requires: list[str], size: int = 0) -> Path:
    import zipfile

    dist, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{dist}-{version}.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
        z.writestr("pad.bin", b"\0" * size)
    return path


def test_gpu_wheels_downloads_with_the_device_readme_flags() -> None:
    mod = _wheels_script()
    cmd = mod.download_command("bitsandbytes", "0.50.2", Path("/r/.whl"), "3.12")
    assert cmd[1:] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_27_x86_64",
        "--platform",
        "manylinux_2_24_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux1_x86_64",
        "-d",
        "/r/.whl",
        "bitsandbytes==0.50.2",
    ]
    assert set(mod.WANTED) == {
        "ruamel.yaml",
        "jsonschema",
        "referencing",
        "jsonschema-specifications",
        "rpds-py",
        "bitsandbytes",
    }


@pytest.mark.parametrize(
    ("python", "expected"), [("3.12", ["attrs", "rpds-py", "typing-extensions"]), ("3.13", ["attrs", "rpds-py"])]
)
def test_gpu_wheels_reads_requirements_with_markers_for_the_device_python(python: str, expected: list[str]) -> None:
    mod = _wheels_script()
    meta = (
        "Name: referencing\nRequires-Dist: attrs>=22.2.0\nRequires-Dist: rpds-py>=0.7.0\n"
        "Requires-Dist: typing-extensions>=4.4.0; python_version < '3.13'\n"
        "Requires-Dist: pytest; extra == 'test'\n"
    )
    assert mod.requirements(meta, python) == expected


def test_gpu_wheels_flags_a_requirement_neither_carried_nor_on_the_device(tmp_path: Path) -> None:
    mod = _wheels_script()
    ok = [
        _wheel(tmp_path, "jsonschema-4.26.0-py3-none-any.whl", ["attrs>=22", "referencing>=0.28", "rpds-py"]),
        _wheel(tmp_path, "referencing-0.37.0-py3-none-any.whl", ["attrs", "rpds_py>=0.7"]),
        _wheel(tmp_path, "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl", []),
    ]
    assert mod.missing_requirements(ok, "3.12") == []  # attrs is on the device, the rest travels
    bad = [*ok, _wheel(tmp_path, "ruamel_yaml-0.19.1-py3-none-any.whl", ["ruamel.yaml.clib>=0.2.7"])]
    assert mod.missing_requirements(bad, "3.12") == [
        "ruamel-yaml-clib (required by ruamel_yaml-0.19.1-py3-none-any.whl)"
    ]


def test_gpu_wheels_keeps_one_version_of_each_for_the_device_python() -> None:
    mod = _wheels_script()
    names = [
        "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "rpds_py-2026.9.1-cp311-cp311-manylinux_2_17_x86_64.whl",  # another Python
        "jsonschema-4.25.0-py3-none-any.whl",  # another version
        "jsonschema-4.26.0-py3-none-any.whl",
        "six-1.17.0-py2.py3-none-any.whl",
    ]  # not wanted
    keep, stale = mod.split_stale([Path(n) for n in names], mod.WANTED, "3.12")
    assert [p.name for p in keep] == [names[0], names[3]]
    assert [p.name for p in stale] == [names[1], names[2], names[4]]


def test_gpu_wheels_drops_only_bitsandbytes_when_the_limit_is_passed(tmp_path: Path) -> None:
    mod = _wheels_script()
    small = _wheel(tmp_path, "jsonschema-4.26.0-py3-none-any.whl", [], 1000)
    big = _wheel(tmp_path, "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", [], 50_000)
    sizes = small.stat().st_size, big.stat().st_size
    assert mod.fit(0, [small, big], limit=sum(sizes)) == ([small, big], [])
    kept, notes = mod.fit(0, [small, big], limit=sum(sizes) - 1)
    assert kept == [small] and "dropped" in notes[0] and big.name in notes[0]
    with pytest.raises(SystemExit):
        mod.fit(sizes[1], [small, big], limit=sum(sizes) - 1)  # too big even without bitsandbytes
