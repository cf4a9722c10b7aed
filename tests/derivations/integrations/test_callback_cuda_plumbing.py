"""The CUDA half of ``LedgerCallback`` without a GPU: its events driven by hand over the fake ``torch.cuda`` and
``pynvml`` of ``tests/support/fake_cuda.py`` (allocator counters that move only when the test allocates).

Expected figures are the fake allocations, added up by hand; nothing here is a GPU measurement
(``scripts/gpu-check`` runs ``benchmarks/callback_overhead.py --device cuda`` on a real GPU for that).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from ledgerspec.contract.document import load  # noqa: E402
from ledgerspec.derivations.engine import backends  # noqa: E402
from ledgerspec.derivations.integrations.transformers import Recorder  # noqa: E402
from tests.support import DATA  # noqa: E402
from tests.support.fake_cuda import DEVICE_NAME, FakeCuda, FakeNVML, FakeOOM, MiB, roundup  # noqa: E402
from tests.truths.trainer_run import training_args  # noqa: E402

pytestmark = pytest.mark.slow

BASE, ACT, TMP, GRAD, STATE = 300 * MiB + 12_345, 40 * MiB, 5 * MiB, 8 * MiB, 16 * MiB


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    nvml = FakeNVML(cuda)

    class Backend(backends.CudaBackend):
        def __init__(self, device_index: int = 0, record_history: bool = True) -> None:
            super().__init__(device_index, record_history, cuda=cuda, nvml=nvml, sample_interval=0.001)

    monkeypatch.setattr(backends, "CudaBackend", Backend)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: DEVICE_NAME)
    return cuda


def live(tmp_path: Path) -> tuple[Any, Any, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DATA / "measure" / "tiny-llama")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = training_args(None, str(tmp_path), use_cpu=False, per_device_train_batch_size=2)
    cuda_args = types.SimpleNamespace(**{k: getattr(args, k) for k in ("world_size", "process_index")})
    cuda_args.device = torch.device("cuda", 0)
    cuda_args.to_dict = args.to_dict
    for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "fsdp", "deepspeed"):
        setattr(cuda_args, k, getattr(args, k))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, cuda_args, optimizer


def step(rec: Recorder, cuda: FakeCuda, model: Any, seq: int, global_step: int) -> None:
    ids = torch.zeros(2, seq, dtype=torch.long)
    rec.step_begin()
    rec._in_step = True
    rec._pre_forward(model, (), {"input_ids": ids})
    cuda.alloc(ACT)  # saved activations
    cuda.alloc(TMP)  # a transient of the forward
    cuda.free(TMP)
    rec._post_forward(model, (), None)
    cuda.alloc(GRAD)  # backward: gradients; the activations are released
    cuda.free(ACT)
    rec._in_step = False
    rec._after_backward()
    if global_step == 1:
        cuda.alloc(STATE)  # AdamW's state, created at the first step
    cuda.alloc(TMP)
    cuda.free(TMP)
    cuda.free(GRAD)  # zero_grad(set_to_none=True)
    rec.step_end(global_step)


def test_the_cuda_half_records_allocator_peaks_per_phase(fake: FakeCuda, tmp_path: Path) -> None:
    model, args, optimizer = live(tmp_path)
    ledger = tmp_path / "run.ledger.yaml"
    rec = Recorder(ledger)
    fake.alloc(BASE)  # what the model holds on the device before train begin
    rec.begin(args, types.SimpleNamespace(), model, optimizer)
    assert rec.backend.name == "cuda"
    for i in range(3):
        step(rec, fake, model, 64 if i == 0 else 32, i + 1)
    rec.write("train end")
    doc = load(str(ledger))
    phase = {p: doc.get("phases", p).value for p in ("after_optimizer_init", "forward_peak", "backward_peak")}
    assert phase == {
        "after_optimizer_init": BASE,  # memory_allocated at train begin
        "forward_peak": BASE + ACT + TMP,
        "backward_peak": BASE + ACT + GRAD,  # the gradients arrive before the activations go
    }
    assert doc.get("phases", "optimizer_step_peak").value == BASE + GRAD + STATE + TMP
    assert doc.get("phases", "steady_state_peak").value == BASE + STATE + ACT + GRAD  # nothing held ahead on cuda
    assert doc.get("metrics", "peak_reserved").value == roundup(BASE + STATE + ACT + GRAD)
    assert doc.get("metrics", "device_peak").value is not None
    assert "torch.cuda.max_memory_allocated" in (doc.get("phases", "forward_peak").method or "")
    assert doc.get("measurement", "device").value == "cuda"
    assert doc.get("measurement", "device_name").value == DEVICE_NAME
    assert doc.get("ledger", "activations").value == ACT  # held after the first forward
    assert rec.ahead == [0, 0, 0]
    rec._close()


def test_a_cuda_out_of_memory_is_written_with_its_phase(fake: FakeCuda, tmp_path: Path) -> None:
    model, args, optimizer = live(tmp_path)
    ledger = tmp_path / "run.ledger.yaml"
    rec = Recorder(ledger)
    fake.alloc(BASE)
    rec.begin(args, types.SimpleNamespace(), model, optimizer)
    rec.step_begin()
    rec._in_step = True
    rec._pre_forward(model, (), {"input_ids": torch.zeros(2, 64, dtype=torch.long)})
    fake.alloc(ACT)
    rec._failed(FakeOOM("CUDA out of memory. Tried to allocate 2.00 GiB (fake)"))
    doc = load(str(ledger))
    assert doc.get("result", "oom").value is True and doc.get("result", "oom_phase").value == "forward"
    assert doc.get("x-measure", "oom").value["peak_when_failed"] == BASE + ACT
    assert not rec.active
