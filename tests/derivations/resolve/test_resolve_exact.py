"""The resolver's figures equal the bytes of the tensors that really exist.

For each case a REAL model is built on the CPU from a small config with real shapes (random weights),
quantized by transformers + bitsandbytes where the case is QLoRA (``from_pretrained`` of a saved random
checkpoint with a ``BitsAndBytesConfig``), adapters are injected with PEFT the way a user does it, ONE real
optimizer step runs, and the bytes of the unique storages that exist are counted: frozen parameters with
their quantization state (absmax, code tables, nested absmax, offset), buffers, trainable tensors, gradients
and optimizer state. The resolver (meta device, no weights) must produce exactly those numbers.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from ledgerspec.contract.document import from_text  # noqa: E402
from ledgerspec.derivations.resolve.resolver import resolve  # noqa: E402
from tests.support import TESTS  # noqa: E402

CONFIGS = TESTS / "data" / "resolve" / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}

pytestmark = pytest.mark.slow


@dataclass
class Case:
    id: str
    config: str
    method: dict[str, Any]
    optimizer: str
    loaded: str = "bfloat16"
    adapter: str = "float32"
    quant: dict[str, Any] | None = None  # {type, double_quant, storage_dtype}
    prepare: bool = False
    min_8bit_size: int | None = None
    extra_lora: dict[str, Any] = field(default_factory=dict)
    full: bool = False  # method.kind full: no adapters, every parameter trained


CASES = [
    Case("lora-qv-adamw", "llama_gqa", {"rank": 8, "target_modules": ["q_proj", "v_proj"]}, "adamw_torch"),
    Case("all-linear-sgd-fp32", "llama_gqa", {"rank": 4, "target_modules": "all-linear"}, "sgd", loaded="float32"),
    Case("all-linear-sgd-momentum", "llama_gqa", {"rank": 4, "target_modules": "all-linear"}, "sgd_momentum"),
    Case(
        "rank-pattern-fused",
        "llama_gqa",
        {
            "rank": 8,
            "target_modules": ["q_proj", "k_proj", "o_proj"],
            "rank_pattern": {"o_proj": 2},
            "alpha_pattern": {"o_proj": 4},
        },
        "adamw_torch_fused",
    ),
    Case(
        "modules-to-save-8bit",
        "llama_gqa",
        {"rank": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
        "adamw_8bit",
    ),
    Case(
        "qkv-bias-lora-only-tied",
        "qwen2_tied_bias",
        {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj"], "bias": "lora_only"},
        "adamw_torch",
    ),
    Case(
        "dora-adafactor",
        "llama_gqa",
        {"rank": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
        "adafactor",
    ),
    Case(
        "moe-target-parameters",
        "mixtral_tiny",
        {"rank": 4, "target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
        "adamw_torch",
    ),
    Case("bf16-adapters", "llama_gqa", {"rank": 8, "target_modules": "all-linear"}, "adamw_torch", adapter="bfloat16"),
    Case(
        "qlora-nf4-dq-uint8-paged8",
        "llama_gqa",
        {"rank": 8, "target_modules": "all-linear"},
        "paged_adamw_8bit",
        quant={"type": "nf4", "double_quant": True, "storage_dtype": "uint8"},
        min_8bit_size=256,
    ),
    Case(
        "qlora-nf4-nodq-bf16-prepare",
        "qwen2_tied_bias",
        {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "adamw_8bit",
        quant={"type": "nf4", "double_quant": False, "storage_dtype": "bfloat16"},
        prepare=True,
        min_8bit_size=512,
    ),
    Case(
        "qlora-fp4-dq-bf16-adamw",
        "llama_gqa",
        {"rank": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
        "adamw_torch",
        quant={"type": "fp4", "double_quant": True, "storage_dtype": "bfloat16"},
        prepare=True,
    ),
    Case(
        "int8-base-lora-qv",
        "llama_gqa",
        {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "adamw_torch",
        quant={"type": "int8"},
    ),
    Case(
        "int8-base-bias-prepare",
        "qwen2_tied_bias",
        {"rank": 4, "target_modules": "all-linear"},
        "adamw_8bit",
        quant={"type": "int8"},
        prepare=True,
        min_8bit_size=256,
    ),
    Case(
        "qlora-nf4-moe",
        "mixtral_tiny",
        {"rank": 4, "target_modules": ["q_proj", "o_proj"]},
        "paged_adamw_32bit",
        quant={"type": "nf4", "double_quant": True, "storage_dtype": "uint8"},
    ),
    # full fine-tuning (issue 26): every parameter trained, gradients and optimizer state for all of them
    Case("full-bf16-adamw", "llama_gqa", {}, "adamw_torch", full=True),
    Case("full-fp32-adamw-fused", "llama_gqa", {}, "adamw_torch_fused", loaded="float32", full=True),
    Case("full-bf16-adamw-8bit", "llama_gqa", {}, "adamw_8bit", min_8bit_size=256, full=True),
    Case("full-tied-bias-adafactor", "qwen2_tied_bias", {}, "adafactor", full=True),
    Case("full-moe-paged-32bit", "mixtral_tiny", {}, "paged_adamw_32bit", full=True),
]


# -- the real stack ------------------------------------------------------------------------------------------


def _lora_config(case: Case) -> Any:
    from peft import LoraConfig

    m = case.method
    kwargs: dict[str, Any] = {
        "r": m["rank"],
        "lora_alpha": 16,
        "target_modules": m.get("target_modules"),
        "task_type": "CAUSAL_LM",
        "bias": m.get("bias", "none"),
        "use_dora": m.get("use_dora", False),
    }
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters"):
        if key in m:
            kwargs[key] = m[key]
    return LoraConfig(**kwargs)


def _base_model(case: Case, tmp: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(CONFIGS / f"{case.config}.json")
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[case.loaded])
    if case.quant is None:
        return model
    model.save_pretrained(tmp / "ckpt")
    q = case.quant
    if q["type"] == "int8":
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    else:
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q["type"],
            bnb_4bit_use_double_quant=q["double_quant"],
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=DTYPES[q["storage_dtype"]],
        )
    model = AutoModelForCausalLM.from_pretrained(
        tmp / "ckpt", quantization_config=bnb, dtype=DTYPES[case.loaded], device_map="cpu"
    )
    if case.prepare:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def _optimizer(case: Case, params: list[Any]) -> Any:
    name = case.optimizer
    if name in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(params, lr=1e-3, fused=name.endswith("fused"))
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    import bitsandbytes as bnb

    kwargs: dict[str, Any] = {"lr": 1e-3}
    if case.min_8bit_size is not None:
        kwargs["min_8bit_size"] = case.min_8bit_size
    if name == "adamw_8bit":
        return bnb.optim.AdamW(params, optim_bits=8, **kwargs)
    if name == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, **kwargs)
    if name == "paged_adamw_32bit":
        return bnb.optim.PagedAdamW32bit(params, **kwargs)
    raise AssertionError(name)


def _storages(tensors: list[Any]) -> int:
    """Bytes of the unique storages behind ``tensors`` (views and aliases once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _quant_state_tensors(param: Any) -> list[Any]:
    qs = getattr(param, "quant_state", None)
    if qs is None:
        return []
    out = [qs.absmax, qs.code]
    if getattr(qs, "offset", None) is not None:
        out.append(qs.offset)
    if getattr(qs, "state2", None) is not None:
        out += [qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


@dataclass
class Counted:
    total_parameters: int
    trainable_parameters: int
    frozen: int
    adapter: int
    gradients: int
    optimizer: int


def count_real_stack(case: Case, tmp: Path) -> Counted:
    from peft import get_peft_model

    model = _base_model(case, tmp)
    logical = 0
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        logical += qs.shape.numel() if qs is not None else p.numel()
    if not case.full:  # full fine-tuning trains the model as transformers built it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, _lora_config(case), autocast_adapter_dtype=case.adapter == "float32")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(case, trainable)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    frozen_params = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen_params), "a frozen tensor got a gradient"
    assert not case.full or all(p.grad is not None for p in trainable), "a trained tensor got no gradient"
    int8_state = [
        t
        for m in model.modules()
        for t in (
            getattr(getattr(m, "state", None), "SCB", None),
            getattr(getattr(m, "state", None), "CB", None),
            getattr(getattr(m, "weight", None), "SCB", None),
        )
        if isinstance(t, torch.Tensor)
    ]  # LLM.int8 row scales (CB aliases the int8 weight)
    frozen = (
        frozen_params + [t for p in frozen_params for t in _quant_state_tensors(p)] + int8_state + list(model.buffers())
    )
    fused_or_capturable = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
    state = [
        v
        for st in opt.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and (k != "step" or fused_or_capturable)
    ]  # torch keeps the step scalar on the host otherwise
    return Counted(
        total_parameters=logical,
        trainable_parameters=sum(p.numel() for p in trainable),
        frozen=_storages(frozen),
        adapter=_storages(trainable),
        gradients=_storages([p.grad for p in trainable]),
        optimizer=_storages(state),
    )


# -- the resolver --------------------------------------------------------------------------------------------


def _document(case: Case, tmp: Path) -> str:
    method = dict(case.method)
    lines = [
        "ledgerspec: ledger/v1",
        "identity:",
        f"  config_path: {CONFIGS / (case.config + '.json')}",
        "method:",
        f"  kind: {'full' if case.full else 'QLoRA' if case.quant else 'LoRA'}",
    ]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in method.items()]
    lines += ["base_model:", f"  loaded_dtype: {case.loaded}"]
    if case.prepare:
        lines.append("  prepare_for_kbit_training: true")
    if case.quant and case.quant["type"] == "int8":
        lines.append("  quantization: {type: int8, bits: 8}")
    elif case.quant:
        q = case.quant
        lines.append(
            f"  quantization: {{type: {q['type']}, double_quant: {str(q['double_quant']).lower()}, "
            f"compute_dtype: bfloat16, storage_dtype: {q['storage_dtype']}}}"
        )
    lines += [] if case.full else ["adapter:", f"  dtype: {case.adapter}"]
    lines += ["optimizer:", f"  name: {case.optimizer}"]
    if case.min_8bit_size is not None:
        lines.append(f"  min_8bit_size: {case.min_8bit_size}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resolver_equals_the_tensors_that_exist(case: Case, tmp_path: Path) -> None:
    expected = count_real_stack(case, tmp_path)
    doc = from_text(_document(case, tmp_path), str(tmp_path / "ledger.yaml"))
    f = resolve(doc).figures
    got = Counted(
        f.total_parameters,
        f.trainable_parameters,
        f.frozen_base_bytes,
        f.adapter_bytes,
        f.gradient_bytes,
        f.optimizer.device if f.optimizer else -1,
    )
    assert got == expected


def test_breakdown_lists_each_target_with_its_shape_and_rank(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.id == "rank-pattern-fused")
    doc = from_text(_document(case, tmp_path), str(tmp_path / "ledger.yaml"))
    rows = {r.module: r for r in resolve(doc).census.breakdown}
    q, k, o = (rows[f"model.layers.*.self_attn.{n}"] for n in ("q_proj", "k_proj", "o_proj"))
    assert (q.count, q.shape, q.rank, q.parameters) == (2, (64, 64), 8, 2 * 8 * (64 + 64))
    assert (k.shape, k.rank, k.parameters) == ((32, 64), 8, 2 * 8 * (64 + 32))  # GQA: 2 kv heads x 16
    assert (o.rank, o.parameters) == (2, 2 * 2 * (64 + 64))


def test_a_declared_transformers_4_prices_its_quantized_linear_experts(tmp_path: Path) -> None:
    """transformers < 5 built each Mixtral expert as three ``nn.Linear`` (w1, w3: hidden -> intermediate; w2 back)
    that bitsandbytes quantized; 5.x fuses them into bf16 parameters it leaves alone. Declared, the transformers-4
    layout is built (``stack.legacy_moe``): the frozen base differs from the installed layout's by the real 4-bit
    tensors of the experts (packed weight + quantization state, as bitsandbytes makes them) minus the fused bf16
    parameters transformers 5 builds, plus the router, an ``nn.Linear`` quantized in 4.x (a 5.x router is a bf16
    parameter); the installed layout still records that size as the other side of the difference."""
    import bitsandbytes.functional as bf
    from transformers import AutoConfig, AutoModelForCausalLM

    case = next(c for c in CASES if c.id == "qlora-nf4-moe")
    text = _document(case, tmp_path)
    installed = resolve(from_text(text, str(tmp_path / "ledger.yaml")))
    declared = resolve(from_text(text + "software:\n  transformers: '4.48'\n", str(tmp_path / "ledger.yaml")))

    config = AutoConfig.from_pretrained(CONFIGS / "mixtral_tiny.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fused = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    router = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    hidden, inter, experts = config.hidden_size, config.intermediate_size, config.num_local_experts

    def quantized(*shape: int) -> int:
        packed, state = bf.quantize_4bit(
            torch.randn(shape, dtype=torch.bfloat16), compress_statistics=True, quant_type="nf4"
        )
        holder = type("Holder", (), {"quant_state": state})()
        return _storages([packed, *_quant_state_tensors(holder)])

    per_expert = quantized(inter, hidden) * 2 + quantized(hidden, inter)  # w1, w3, w2
    layers = config.num_hidden_layers
    linear_experts = layers * experts * per_expert

    entry = installed.doc.get("x-resolve", "differences").raw["transformers-moe-fused-experts"]
    assert entry == {"computed_as": "newer", "bytes": linear_experts - fused}
    assert declared.doc.get("x-resolve", "differences").raw["transformers-moe-fused-experts"] == {
        "computed_as": "older"
    }
    assert not any(n.startswith("declared stack:") for n in declared.notes), declared.notes
    change = declared.figures.frozen_base_bytes - installed.figures.frozen_base_bytes
    assert change == linear_experts - fused + layers * quantized(experts, hidden) - router


def test_a_full_fine_tuning_ledger_validates_clean_and_reaches_calculated(tmp_path: Path) -> None:
    """The ledger resolve writes for ``method.kind: full`` satisfies every rule (LS020-LS022 included): its
    trainable, gradient and optimized counts are every parameter, and its breakdown lists the model's weights."""
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.writer import document_text

    case = next(c for c in CASES if c.id == "full-bf16-adamw")
    text = _document(case, tmp_path).replace("ledger/v1", "intake/v1")
    text += "workload: {microbatch: 1, max_length: 8}\nmemory_options: {gradient_checkpointing: false}\n"
    text = text.replace("identity:\n", "identity:\n  model_id: tiny/llama\n  revision: main\n")
    result = resolve(from_text(text, str(tmp_path / "full.intake.yaml")))
    report = validate(from_text(document_text(result.doc), str(tmp_path / "full.ledger.yaml")))
    assert [f for f in report.findings if f.severity == "error"] == []
    assert report.supported_status == "CALCULATED", report.reasons
    f = result.figures
    assert f.trainable_parameters == f.total_parameters
    kinds = {r.kind for r in result.census.breakdown}
    assert kinds == {"weight"}, kinds
    assert sum(r.parameters for r in result.census.breakdown) == f.total_parameters


def test_full_fine_tuning_of_a_quantized_base_is_one_line_at_method_kind(tmp_path: Path) -> None:
    from ledgerspec.errors import LedgerspecError

    case = next(c for c in CASES if c.id == "qlora-nf4-moe")
    text = _document(case, tmp_path).replace("kind: QLoRA", "kind: full")
    text = text.replace("  loaded_dtype: bfloat16\n", "  loaded_dtype: bfloat16\n  quantized: true\n")
    with pytest.raises(LedgerspecError) as err:
        resolve(from_text(text, str(tmp_path / "ledger.yaml")))
    message = str(err.value)
    assert "\n" not in message and "ledger.yaml:5:" in message and "quantized" in message, message
