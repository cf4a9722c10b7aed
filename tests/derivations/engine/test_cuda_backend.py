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

import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.derivations.engine import backends as B
from ledgerspec.derivations.engine.backends import CudaBackend
from ledgerspec.derivations.engine.protocol import run_protocol
from tests.support.fake_cuda import (
    ACCUMULATION,
    ADAPTER,
    BASE,
    CONTEXT,
    DRIVER,
    SEG,
    UUID,
    WORST,
    FakeCuda,
    FakeNVML,
    FakeOOM,
    FakeWorkload,
    MiB,
    act_bytes,
    expected_phases,
    ids_bytes,
    logits_bytes,
    roundup,
    run_fake,
)

# -- peaks per phase ---------------------------------------------------------------------------------------------------


def test_every_phase_records_the_peak_the_counters_reached_in_that_phase(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML
) -> None:
    result, _, _ = run_fake(fake_cuda)
    assert result.complete and not result.oom
    assert {k: r.figure for k, r in result.phases.items()} == expected_phases()
    # without the resets the steady state (typical shape) would report the worst shape's backward peak
    assert result.phases["steady_state_peak"].figure < result.phases["backward_peak"].figure
    assert result.peak_allocated() == max(expected_phases().values())
    assert result.activations_saved == ids_bytes(WORST) + act_bytes(WORST) + logits_bytes(WORST)
    assert result.phases["after_optimizer_init"].held == BASE + ADAPTER


def test_peak_counters_are_reset_at_the_start_of_every_phase(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    _, _, w = run_fake(fake_cuda)
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
    result, _, _ = run_fake(fake_cuda)
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
    result, _, _ = run_fake(fake_cuda)
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
    result, _, _ = run_fake(fake_cuda)
    assert "device-wide" in result.device["device_memory_source"]
    for rec in result.phases.values():  # the other process counts too: the source says so
        assert rec.device_peak == CONTEXT + (rec.reserved_peak or 0) + fake_nvml.other


def test_cuda_mem_get_info_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    result, _, _ = run_fake(fake_cuda)
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
    result, backend, _ = run_fake(fake_cuda, snapshot, fail_at=(stage, nth))
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
    result, _, _ = run_fake(cuda, str(tmp_path / "ledger.oom-snapshot.pickle"))
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
    result, _, _ = run_fake(fake_cuda, str(tmp_path / "ledger.oom-snapshot.pickle"), fail_at=("forward", 1))
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


# -- outside the caching allocator (issue 23) ---------------------------------------------------------------------


def test_the_context_is_read_before_the_first_allocation(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    """NVML's used memory of the process right after the context exists and before any tensor: the CONTEXT."""
    result, backend, _ = run_fake(fake_cuda)
    assert result.context == {"used": CONTEXT, "reserved": 0, "source": backend.sampler.source}  # type: ignore[union-attr]
    assert fake_cuda.events.index(("init", None)) < fake_cuda.events.index(("alloc", BASE))


def test_outside_is_used_minus_reserved_at_each_phase_end_and_at_the_device_peak(
    fake_cuda: FakeCuda, fake_nvml: FakeNVML
) -> None:
    """Modules loaded at the first forward (lazy loading) grow the memory outside the allocator after load."""
    fake_cuda.lazy_modules = 96 * MiB
    result, _, _ = run_fake(fake_cuda)
    outside = {name: rec.outside for name, rec in result.phases.items()}
    assert outside["after_load"] == CONTEXT  # nothing loaded yet beyond the context
    assert outside["after_optimizer_init"] == CONTEXT
    for name in ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak"):
        assert outside[name] == CONTEXT + 96 * MiB, name
    at = result.outside_at_peak()
    assert at is not None and at[0] == CONTEXT + 96 * MiB
    top = result.phases[at[1]]
    assert top.device_peak == result.device_peak()  # the phase that holds the device peak


def test_outside_falls_back_to_cuda_mem_get_info(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_cuda.lazy_modules = 10 * MiB
    result, _, _ = run_fake(fake_cuda)
    assert result.context is not None and result.context["used"] == CONTEXT
    assert result.context["source"].startswith("cudaMemGetInfo")
    assert result.phases["steady_state_peak"].outside == CONTEXT + 10 * MiB


def test_no_device_reading_means_no_outside_figure(fake_cuda: FakeCuda, fake_nvml: FakeNVML) -> None:
    fake_nvml.mode = "host_pid"

    def broken(handle: str) -> Any:
        raise RuntimeError("NVML_ERROR_UNKNOWN")

    fake_nvml.nvmlDeviceGetMemoryInfo = broken  # type: ignore[method-assign]
    result, _, _ = run_fake(fake_cuda)
    assert result.context is None
    assert all(rec.outside is None for rec in result.phases.values())
    assert result.outside_at_peak() is None


def test_the_tracker_backends_read_nothing_outside() -> None:
    from ledgerspec.derivations.engine.backends import TrackerBackend

    backend = TrackerBackend()
    assert backend.outside_now() is None and backend.context_reading() is None
