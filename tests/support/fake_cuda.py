"""Fakes of ``torch.cuda`` and nvidia-ml-py's ``pynvml`` and a fake workload with known bytes: the cuda backend's
plumbing is tested with them (no GPU is needed, none is used). Expected figures are the fake workload's own bytes,
added up by hand; nothing here is a GPU measurement (``scripts/gpu-check`` on a real GPU is the check for that)."""

from __future__ import annotations

import os
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.derivations.engine.backends import CudaBackend
from ledgerspec.derivations.engine.protocol import ProtocolResult, run_protocol
from tests.support import DATA

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
        # device memory outside the allocator beyond the CONTEXT: kernel modules the first forward loads (lazy
        # loading), set by a test; `outside` is what the fake device holds of it now
        self.lazy_modules = 0
        self.outside = 0

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

    def memory_reserved(self, index: int | None = None) -> int:
        return self.reserved

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return TOTAL - (CONTEXT + self.outside + self.reserved), TOTAL

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
        return self.value if self.value is not None else CONTEXT + self.cuda.outside + self.cuda.reserved

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
    prefetch: int | None = None


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
    _step: FakeStep | None = None

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
        self.cuda.outside = self.cuda.lazy_modules  # the first launch of the step's kernels loads their modules
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

    @property
    def step(self) -> FakeStep:
        """The protocol's step interface over this fake: a loop that keeps its logits through backward."""
        if self._step is None:
            self._step = FakeStep(self)
        return self._step


@dataclass
class FakeStep:
    """:class:`ledgerspec.derivations.engine.step.TrainingStep` over a :class:`FakeWorkload`."""

    w: FakeWorkload
    seq: int = 0

    def start(self, seq: int, micro_steps: int) -> None:
        self.seq = seq

    def forward(self, i: int) -> int:
        ids, _ = self.w.batch(self.seq)
        return self.w.forward(ids)

    def loss(self, logits: int, i: int) -> int:
        return self.w.loss(logits, logits)

    def backward(self, loss: int) -> None:
        self.w.backward(loss)

    def release(self, i: int) -> None:
        pass

    def optimizer_step(self) -> None:
        self.w.optimizer_step()

    def zero_grad(self) -> None:
        self.w.zero_grad()

    def finish(self) -> None:
        pass


def run_fake(
    cuda: FakeCuda, snapshot: str | None = None, **workload: Any
) -> tuple[ProtocolResult, CudaBackend, FakeWorkload]:
    backend = CudaBackend(cuda=cuda, sample_interval=0.001)
    w = FakeWorkload(cuda, **workload)
    result = run_protocol(w, backend, device="cuda", steps=2, snapshot_path=snapshot)  # type: ignore[arg-type]
    return result, backend, w


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


def resolved_ledger(tmp_path: Path) -> Path:
    """The tiny Llama ledger, resolved (CPU), with a target device and an activation estimate."""
    pytest.importorskip("peft")
    from ledgerspec import resolve
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render

    shutil.copytree(DATA / "measure" / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / "tiny-llama-lora.yaml"
    shutil.copy(DATA / "measure" / "tiny-llama-lora.yaml", path)
    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture: stands in for estimate")
    atomic_write(path, render(doc.data, doc.text))
    return path


def stack_versions() -> dict[str, str]:
    from importlib import metadata

    return {name: metadata.version(name) for name in ("torch", "transformers", "peft")}


def cuda_output(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, snapshot: str | None = None, **workload: Any
) -> Any:
    import torch

    from ledgerspec.derivations.measure.measurer import ChildOutput

    monkeypatch.setattr(torch.version, "cuda", "12.8")  # what a CUDA build reports; device_info reads it
    result, _, _ = run_fake(fake_cuda, snapshot, **workload)
    # across the child-process boundary, as in `measure`
    return ChildOutput(ProtocolResult.from_json(result.to_json()), stack_versions())
