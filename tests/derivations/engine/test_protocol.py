"""The measurement protocol on tiny real-architecture models (Llama and Qwen2, 2 layers, hidden 64) on the CPU.

Expected figures come from the resolver (an independent formula path over a meta-device model) or
are counted here from the real tensors; none are copied from the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from ledgerspec.contract.document import Document, load
from ledgerspec.contract.edit import set_plain
from ledgerspec.derivations.engine.backends import TrackerBackend
from ledgerspec.derivations.engine.protocol import PHASES, ProtocolResult, run_protocol
from ledgerspec.derivations.engine.workload import Workload, WorkloadSpec
from tests.support import TESTS

DATA = TESTS / "data" / "measure"
LLAMA = DATA / "tiny-llama-lora.yaml"
QWEN_QLORA = DATA / "tiny-qwen2-qlora.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("protocol")]  # its module fixtures set up once


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Memory does not depend on the thread count; one thread keeps these tiny models fast on a busy host."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ledger(path: Path, **changes: Any) -> Document:
    """Load a fixture and change declared inputs: ``ledger(P, workload__microbatch=1)``."""
    doc = load(path)
    for key, value in changes.items():
        set_plain(doc, tuple(key.split("__")), value, force=True)
    return doc


def run(doc: Document, steps: int = 2, limit: int | None = None, fake: bool = False) -> ProtocolResult:
    w = Workload(doc)
    return run_protocol(w, TrackerBackend(limit=limit, fake=fake), device="cpu", steps=steps, memory_limit=limit)


@pytest.fixture(scope="module")
def llama_run() -> ProtocolResult:
    return run(ledger(LLAMA))


@pytest.fixture(scope="module")
def qlora_run() -> ProtocolResult:
    return run(ledger(QWEN_QLORA))


def _resolved(path: Path) -> Document:
    from ledgerspec import resolve

    doc = ledger(path)
    resolve(doc, offline=True)
    return doc


# -- phases ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama_run", "qlora_run"])
def test_every_phase_is_recorded_and_monotone_where_it_must_be(which: str, request: pytest.FixtureRequest) -> None:
    r: ProtocolResult = request.getfixturevalue(which)
    assert not r.oom and r.complete
    assert list(r.phases) == list(PHASES)
    f = {name: rec.figure for name, rec in r.phases.items()}
    # each protocol step only adds long-lived state
    assert 0 < f["after_load"] <= f["after_adapter_injection"] <= f["after_optimizer_init"]
    # a training phase starts from everything that is held, so its peak is at least that
    for name in ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak"):
        assert f[name] >= f["after_optimizer_init"], name
    assert f["backward_peak"] > f["after_optimizer_init"]  # activations were really allocated
    assert r.peak_allocated() == max(rec.peak for rec in r.phases.values())
    assert r.step_time_s is not None and r.step_time_s > 0
    assert r.host_peak is not None and r.host_peak > (r.peak_allocated() or 0)  # the process holds its tensors


def test_adapter_phase_adds_exactly_the_adapter_bytes(llama_run: ProtocolResult) -> None:
    # LoRA r=4 on q_proj (64->64) and v_proj (64->32, 2 kv heads x 16) in 2 layers, float32
    lora_params = 2 * (4 * (64 + 64) + 4 * (64 + 32))
    ph = llama_run.phases
    assert ph["after_adapter_injection"].figure - ph["after_load"].figure == lora_params * 4


# -- byte for byte against the resolver -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [LLAMA, QWEN_QLORA], ids=["lora-adamw", "qlora-adamw8bit"])
def test_gradients_adapter_and_optimizer_equal_the_resolver(path: Path, request: pytest.FixtureRequest) -> None:
    resolved = _resolved(path)
    r: ProtocolResult = request.getfixturevalue("llama_run" if path == LLAMA else "qlora_run")
    grads = r.phases["backward_peak"].census["gradients"]
    state = r.phases["steady_state_peak"].census
    assert r.phases["after_adapter_injection"].census["adapter"] == resolved.get("ledger", "adapter").size()
    assert grads == resolved.get("ledger", "gradients").size()
    # torch AdamW keeps one float32 `step` scalar per parameter on the host: the resolver leaves it out of the
    # device figure, the cpu census (host = device) counts it; bitsandbytes keeps its step in Python
    n_trainable = len(_trainable_shapes(Workload(ledger(path))))
    host_steps = 4 * n_trainable if resolved.get("optimizer", "name").text() == "adamw_torch" else 0
    assert state["optimizer"] == (resolved.get("ledger", "optimizer").size() or 0) + host_steps


def _trainable_shapes(w: Workload) -> list[Any]:
    w.prepare()
    return [p.shape for p in w.model.parameters() if p.requires_grad]


def test_frozen_base_equals_the_resolver_for_lora(llama_run: ProtocolResult) -> None:
    resolved = _resolved(LLAMA)
    assert llama_run.phases["after_load"].figure == resolved.get("ledger", "frozen_base").size()


def test_qlora_frozen_base_equals_the_resolver_once_training_runs(qlora_run: ProtocolResult) -> None:
    """PEFT's prepare_model_for_kbit_training upcasts every bf16 parameter that is not a Params4bit to fp32, the
    q/k/v biases of Qwen2's 4-bit layers included; bitsandbytes' Linear4bit.forward then casts its bias to the
    input's dtype (bf16) on the first forward. The resolver's figure is the training (steady-state) one."""
    from ledgerspec.derivations.engine.tracker import by_component

    resolved = _resolved(QWEN_QLORA)
    calc = resolved.get("ledger", "frozen_base").size() or 0
    biases = 2 * (64 + 32 + 32)  # 2 layers x (q: 4 heads x 16, k and v: 2 kv heads x 16)
    assert qlora_run.phases["after_load"].figure == calc + biases * (4 - 2)
    steady = by_component(qlora_run.phases["steady_state_peak"].census)
    assert steady["frozen_base"] == calc


def test_qlora_frozen_base_counted_from_the_real_tensors(qlora_run: ProtocolResult) -> None:
    """The 4-bit weights, their quantization state and the fp32-upcast rest, counted from the built model."""
    import torch

    w = Workload(ledger(QWEN_QLORA))
    w.prepare()
    w.materialise_base("cpu")
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = list(w.model.parameters()) + list(w.model.buffers())
    for p in w.model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            tensors += [t for t in (qs.absmax, qs.code, getattr(qs, "offset", None)) if isinstance(t, torch.Tensor)]
            qs = getattr(qs, "state2", None)
    for t in tensors:
        if t.requires_grad:
            continue
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert qlora_run.phases["after_load"].figure == sum(seen.values())
    quantized = [p for p in w.model.parameters() if type(p).__name__ == "Params4bit"]
    assert quantized and all(p.dtype == torch.uint8 for p in quantized)
    others = [p for p in w.model.parameters() if type(p).__name__ != "Params4bit" and not p.requires_grad]
    assert all(p.dtype == torch.float32 for p in others)  # prepare_model_for_kbit_training's upcast


# -- accumulation ---------------------------------------------------------------------------------------------------


def test_accumulation_is_sequential_micro_steps_not_a_bigger_activation_batch() -> None:
    one = run(ledger(LLAMA, workload__gradient_accumulation=1, training__loop="custom"))
    four = run(ledger(LLAMA, workload__gradient_accumulation=4, training__loop="custom"))
    assert four.accumulation == 4
    # the same activations per micro-step...
    assert four.activations_saved == one.activations_saved
    act1 = one.phases["forward_peak"].categories_at_peak
    act4 = four.phases["forward_peak"].categories_at_peak
    assert act1 is not None and act4 is not None
    assert act4["activations"] == act1["activations"]
    # ...and the forward peak grows only by the gradients held between micro-steps (exact bytes)
    grads = four.phases["backward_peak"].census["gradients"]
    assert four.phases["forward_peak"].figure - one.phases["forward_peak"].figure == grads


def test_the_trainer_holds_the_steps_micro_batches_and_the_last_loss_while_it_accumulates() -> None:
    """transformers.Trainer fetches all micro-batches of a step first (``get_batch_samples``) and keeps the previous
    micro-step's detached loss (``tr_loss_step``): with 4 micro-steps the forward peak also holds 3 more batches
    (input_ids, attention_mask, labels: int64, microbatch x max_length each) and one fp32 scalar."""
    one = run(ledger(LLAMA, workload__gradient_accumulation=1))
    four = run(ledger(LLAMA, workload__gradient_accumulation=4))
    assert four.activations_saved == one.activations_saved
    doc = load(LLAMA)
    mb, seq = doc.get("workload", "microbatch").integer() or 0, doc.get("workload", "max_length").integer() or 0
    batch = 3 * mb * seq * 8
    grads = four.phases["backward_peak"].census["gradients"]
    assert four.phases["forward_peak"].figure - one.phases["forward_peak"].figure == grads + 3 * batch + 4


# -- simulated out-of-memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["load", "adapter_injection", "forward", "backward"])
def test_a_memory_limit_fails_in_the_phase_that_crosses_it(where: str, llama_run: ProtocolResult) -> None:
    ph = llama_run.phases
    fwd_cats = ph["forward_peak"].categories_at_peak or {}
    limit = {
        "load": ph["after_load"].figure - 1,
        "adapter_injection": (ph["after_load"].peak + ph["after_adapter_injection"].figure) // 2,
        "forward": ph["forward_peak"].figure - 1,
        # above every forward allocation, below the backward peak
        "backward": max(ph["forward_peak"].figure, sum(fwd_cats.values())) + 1,
    }[where]
    assert limit < ph["backward_peak"].figure
    r = run(ledger(LLAMA), limit=limit)
    assert r.oom and r.simulated_oom
    expected = {"backward": ("loss", "backward")}.get(where, (where,))
    assert r.oom_phase in expected
    assert r.failed_phase_peak is not None and r.failed_phase_peak > limit
    done = PHASES[: {"load": 0, "adapter_injection": 1, "forward": 3, "backward": 3}[where]]
    assert tuple(r.phases) == done


# -- fake tensors (the estimate's engine) -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [LLAMA, QWEN_QLORA], ids=["lora", "qlora"])
def test_fake_tensors_hold_the_same_static_state(path: Path, request: pytest.FixtureRequest) -> None:
    real: ProtocolResult = request.getfixturevalue("llama_run" if path == LLAMA else "qlora_run")
    fake = run(ledger(path), fake=True)
    assert fake.backend == "fake" and fake.complete
    for name in ("after_load", "after_adapter_injection", "after_optimizer_init"):
        assert fake.phases[name].figure == real.phases[name].figure, name
    assert fake.phases["steady_state_peak"].census == real.phases["steady_state_peak"].census


# -- the workload spec ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "worst", "typical"),
    [
        ({}, 64, 32),
        ({"workload__packing": True}, 64, 64),
        ({"workload__max_length": "UNKNOWN"}, 60, 32),
        ({"workload__sequence_p50": "UNKNOWN"}, 64, 64),
    ],
)
def test_sequence_shapes_follow_the_profile(changes: dict[str, Any], worst: int, typical: int) -> None:
    spec = WorkloadSpec.from_document(ledger(LLAMA, **changes))
    assert (spec.seq_worst, spec.seq_typical) == (worst, typical)


def test_spec_round_trips_through_json() -> None:
    spec = WorkloadSpec.from_document(ledger(QWEN_QLORA))
    assert WorkloadSpec.from_json(spec.to_json()) == spec
    assert spec.quant is not None and spec.quant.quant_type == "nf4" and spec.quant.double_quant


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("optimizer__name", "lion_32bit", "cannot build optimizer"),
        ("software__attention_implementation", "magic", "unknown attention implementation"),
        ("workload__microbatch", 0, "microbatch"),
        ("base_model__loaded_dtype", "float7", "unknown dtype"),
    ],
)
def test_bad_workload_inputs_are_one_line_errors(key: str, value: Any, needle: str) -> None:
    from ledgerspec.errors import LedgerspecError

    with pytest.raises(LedgerspecError) as info:
        WorkloadSpec.from_document(ledger(LLAMA, **{key: value}))
    assert needle in info.value.message and info.value.line is not None


# -- backends: out-of-memory recognition ----------------------------------------------------------------------------


def test_backends_recognise_only_their_out_of_memory_errors() -> None:
    import torch

    from ledgerspec.derivations.engine.backends import CudaBackend
    from ledgerspec.derivations.engine.tracker import SIMULATED_OOM_MARKER, SimulatedOOM

    cpu, cuda = TrackerBackend(limit=1), CudaBackend()
    assert cpu.oom_kind(SimulatedOOM("x")) == "simulated"
    assert cpu.oom_kind(RuntimeError(f"autograd re-raised: {SIMULATED_OOM_MARKER}: ...")) == "simulated"
    assert cpu.oom_kind(RuntimeError("shape mismatch")) is None
    assert cuda.oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "cuda"
    assert cuda.oom_kind(ValueError("bad value")) is None


def test_a_non_oom_error_propagates() -> None:
    class Boom(TrackerBackend):
        def classify(self, workload: Workload, stale: tuple[str, ...] = ()) -> None:
            raise KeyError("not an OOM")

    with pytest.raises(KeyError):
        run_protocol(Workload(ledger(LLAMA)), Boom(), device="cpu")
