"""The models people fine-tune now (issue 17): the auto class a config calls for, a native type built natively despite
``auto_map``, attention an architecture refuses, bases quantized by other libraries, and the coverage findings.

Independent truths: the published parameter counts of the shipped configs (``examples/configs/SOURCES.md``), real
CPU models built by transformers (the vision tower's parameters, the experts' shapes), transformers' own MXFP4
experts module, and the tensors AutoGPTQ's / AutoAWQ's ``QuantLinear`` registers (their ``__init__`` transcribed:
the libraries do not install here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from ledgerspec.contract.document import from_text  # noqa: E402
from ledgerspec.derivations.stack import quant_storage  # noqa: E402
from ledgerspec.errors import LedgerspecError  # noqa: E402
from tests.support import DATA, EXAMPLES  # noqa: E402

CONFIGS = DATA / "resolve" / "configs"


def _intake(
    config: Path, kind: str = "LoRA", quant: str = "", dropout: float = 0.0, attention: str = "sdpa", **method: str
) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in method.items())
    return f"""ledgerspec: intake/v1
identity:
  model_id: test/tiny
  config_path: {config}
software:
  attention_implementation: {attention}
method:
  kind: {kind}
  rank: 4
  alpha: 8
  dropout: {dropout}
  target_modules: all-linear
{extra}base_model:
  loaded_dtype: bfloat16
{quant}adapter:
  dtype: float32
workload:
  max_length: 16
  microbatch: 1
optimizer:
  name: adamw_torch
memory_options:
  gradient_checkpointing: false
"""


def _resolve(text: str) -> Any:
    from ledgerspec.derivations.resolve.resolver import resolve

    return resolve(from_text(text), offline=True)


# -- the auto class ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "auto", "cls", "published"),
    [
        ("qwen2.5-vl-7b", "AutoModelForImageTextToText", "Qwen2_5_VLForConditionalGeneration", 8_292_166_656),
        ("gemma-3-4b-it", "AutoModelForCausalLM", "Gemma3ForConditionalGeneration", 4_300_079_472),  # both list it
        ("llama-3.2-11b-vision", "AutoModelForImageTextToText", "MllamaForConditionalGeneration", 10_670_220_835),
        ("gemma-3-1b-it", "AutoModelForCausalLM", "Gemma3ForCausalLM", 999_885_952),
        ("gpt-oss-20b", "AutoModelForCausalLM", "GptOssForCausalLM", 20_914_757_184),
        ("yi-34b", "AutoModelForCausalLM", "LlamaForCausalLM", 34_388_917_248),  # the model card's 34.4B
        # v0.1's architecture and count (the model card's 7.24B), with rope_theta 1e6 and no sliding window
        ("mistral-7b-v0.2", "AutoModelForCausalLM", "MistralForCausalLM", 7_241_732_096),
    ],
)
def test_the_auto_class_builds_the_class_the_config_names(name: str, auto: str, cls: str, published: int) -> None:
    """Mllama's causal-LM mapping offers the text-only MllamaForCausalLM (9.78 B): the config names the full model,
    whose count is the published one (SOURCES.md)."""
    from transformers import AutoConfig

    from ledgerspec.derivations.stack.build import build_base, model_class

    config = AutoConfig.from_pretrained(EXAMPLES / "configs" / name)
    chosen = model_class(config)
    assert chosen is not None and (chosen.auto_class, chosen.class_name) == (auto, cls)
    assert chosen.multimodal == ("ConditionalGeneration" in cls)
    with torch.device("meta"):
        model = build_base(from_text("ledgerspec: intake/v1\n"), config, torch.bfloat16)
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) == published


def test_the_layer_plan_reads_the_language_model_and_keeps_the_vision_tower() -> None:
    from transformers import AutoConfig

    from ledgerspec.derivations.estimate.extrapolate import plan, with_layers

    config = AutoConfig.from_pretrained(EXAMPLES / "configs" / "qwen2.5-vl-7b")
    p = plan(config)
    assert p.layers == 28 and p.probes == (2, 3)
    short = with_layers(config, 3)
    assert short.text_config.num_hidden_layers == 3
    assert short.vision_config.depth == 32
    mllama = AutoConfig.from_pretrained(EXAMPLES / "configs" / "llama-3.2-11b-vision")
    assert plan(mllama).probes is None  # cross-attention layers: traced in full


# -- auto_map ------------------------------------------------------------------------------------------------------


def test_a_native_model_type_is_built_natively_despite_auto_map_and_says_so() -> None:
    result = _resolve(_intake(CONFIGS / "deepseek_v2_tiny_auto_map.json"))
    assert result.census.architecture == "DeepseekV2ForCausalLM"
    assert any("auto_map" in n and "native to transformers" in n for n in result.notes)


# -- attention -----------------------------------------------------------------------------------------------------


def test_attention_the_architecture_refuses_is_named_with_the_supported_list() -> None:
    """gpt-oss: transformers 5.24 sets ``_supports_sdpa = False`` (attention sinks)."""
    from ledgerspec.derivations.engine.workload import Workload

    doc = from_text(_intake(CONFIGS / "gpt_oss_tiny.json", attention="sdpa"))
    with pytest.raises(LedgerspecError) as err:
        Workload(doc).prepare()
    assert "does not support attention implementation 'sdpa'" in err.value.message
    assert err.value.hint is not None and "eager" in err.value.hint and "vllm-flash-attn3" in err.value.hint


# -- MoE findings --------------------------------------------------------------------------------------------------


def test_expert_wrapping_router_and_linear_layers_left_out_are_findings_with_figures() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    result = _resolve(_intake(CONFIGS / "deepseek_v2_tiny_auto_map.json"))
    cover = result.census.coverage
    # independent: the real model's expert tensors and Linear layers of the shared experts / dense MLP
    config = AutoConfig.from_pretrained(CONFIGS / "deepseek_v2_tiny_auto_map.json")
    model = AutoModelForCausalLM.from_config(config)
    experts = [p for n, p in model.named_parameters() if p.dim() == 3]
    assert cover["experts_wrapped"]["tensors"] == len(experts) == 2 * 2  # gate_up + down, 2 MoE layers
    assert cover["routers_adapted"]["tensors"] == 2
    left = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".mlp." in n}  # dense + shared
    expected = sum(model.get_submodule(n).weight.numel() for n in left)
    assert sum(v["parameters"] for v in cover["linear_not_adapted"].values()) == expected
    assert any(n.startswith("expert parameters wrapped") for n in result.notes)


def test_dropout_with_wrapped_experts_is_one_clear_error_with_the_way_out() -> None:
    with pytest.raises(LedgerspecError) as err:
        _resolve(_intake(CONFIGS / "deepseek_v2_tiny_auto_map.json", dropout=0.05))
    assert "lora_dropout != 0" in err.value.message and "expert parameters" in err.value.message
    assert err.value.hint is not None and "method.dropout: 0" in err.value.hint


def test_gpt_oss_experts_without_adapters_and_unquantized_by_bitsandbytes_are_named() -> None:
    quant = "  quantization: {type: nf4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}\n"
    result = _resolve(_intake(CONFIGS / "gpt_oss_tiny.json", kind="QLoRA", quant=quant))
    cover = result.census.coverage["experts_not_adapted"]
    # 2 layers x (gate_up (4, 64, 128) + down (4, 64, 64))
    assert cover == {"tensors": 4, "parameters": 2 * (4 * 64 * 128 + 4 * 64 * 64)}
    assert result.census.coverage["experts_unquantized"] == cover
    assert any("bitsandbytes leaves" in n for n in result.notes)


# -- the vision tower ----------------------------------------------------------------------------------------------


def test_the_vision_tower_share_and_exclude_modules() -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(CONFIGS / "qwen2_5_vl_tiny.json")
    real = AutoModelForImageTextToText.from_config(config)
    visual = sum(p.numel() for n, p in real.named_parameters() if n.startswith("model.visual."))
    result = _resolve(_intake(CONFIGS / "qwen2_5_vl_tiny.json"))
    vision = result.census.coverage["vision"]
    assert vision["modules"] == ["model.visual"]
    assert vision["frozen_parameters"] == visual
    assert vision["adapter_parameters"] > 0
    only_lm = _resolve(_intake(CONFIGS / "qwen2_5_vl_tiny.json", exclude_modules=f"'{vision['exclude_regex']}'"))
    assert only_lm.census.coverage["vision"]["adapter_parameters"] == 0
    lm_linear = [
        m
        for n, m in real.named_modules()
        if type(m) is torch.nn.Linear and not n.startswith("model.visual") and n != "lm_head"
    ]
    r = 4
    assert only_lm.figures.trainable_parameters == sum(r * (m.in_features + m.out_features) for m in lm_linear)


# -- bases quantized by other libraries ------------------------------------------------------------------------------


def _gptq_quantlinear_bytes(infeatures: int, outfeatures: int, bits: int, group_size: int) -> int:
    """AutoGPTQ ``qlinear_cuda_old.QuantLinear.__init__`` (and GPTQModel's ``PackableQuantLinear``): the buffers it
    registers, as real tensors."""
    tensors = [
        torch.zeros((infeatures // 32 * bits, outfeatures), dtype=torch.int32),  # qweight
        torch.zeros((math.ceil(infeatures / group_size), outfeatures // 32 * bits), dtype=torch.int32),  # qzeros
        torch.zeros((math.ceil(infeatures / group_size), outfeatures), dtype=torch.float16),  # scales
        torch.tensor([i // group_size for i in range(infeatures)], dtype=torch.int32),  # g_idx
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def _awq_gemm_bytes(in_features: int, out_features: int, w_bit: int, group_size: int) -> int:
    """AutoAWQ ``WQLinear_GEMM.__init__``: qweight, qzeros, scales as real tensors."""
    pack = 32 // w_bit
    tensors = [
        torch.zeros((in_features, out_features // pack), dtype=torch.int32),
        torch.zeros((in_features // group_size, out_features // pack), dtype=torch.int32),
        torch.zeros((in_features // group_size, out_features), dtype=torch.float16),
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("k", "n"), [(3584, 3584), (3584, 512), (18944, 3584), (256, 384)])
def test_gptq_and_awq_bytes_equal_the_quantlinear_buffers(k: int, n: int) -> None:
    assert quant_storage.gptq_bytes(k, n, 4, 128).total == _gptq_quantlinear_bytes(k, n, 4, 128)
    assert quant_storage.awq_bytes(k, n, 4, 128).total == _awq_gemm_bytes(k, n, 4, 128)


def test_a_gptq_base_resolves_to_exact_bytes() -> None:
    """The tiny GPTQ config (group size 128, from its quantization_config): every Linear of the decoder layers as
    QuantLinear buffers, the rest (embeddings, lm_head, norms) in the loaded dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    result = _resolve(_intake(CONFIGS / "qwen2_gptq_tiny.json", kind="QLoRA", quant="  quantization: {type: gptq}\n"))
    config = AutoConfig.from_pretrained(CONFIGS / "qwen2_gptq_tiny.json")
    real = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    expected = 0
    for name, m in real.named_modules():
        if type(m) is torch.nn.Linear and name.startswith("model.layers."):
            expected += _gptq_quantlinear_bytes(m.in_features, m.out_features, 4, 128)
            if m.bias is not None:
                expected += m.bias.numel() * 2
    quantized_weights = {
        f"{n}.weight" for n, m in real.named_modules() if type(m) is torch.nn.Linear and n.startswith("model.layers.")
    }
    expected += sum(
        p.numel() * 2 for n, p in real.named_parameters() if n not in quantized_weights and not n.endswith("_proj.bias")
    )
    expected += sum(b.numel() * b.element_size() for b in real.buffers())
    assert result.figures.frozen_base_bytes == expected
    assert "GPTQ 4-bit, group size 128" in result.doc.get("ledger", "frozen_base").method


def test_mxfp4_bytes_equal_transformers_experts_module() -> None:
    """transformers' own ``Mxfp4GptOssExperts`` (packed uint8 codes, fp32 biases) plus the checkpoint's scales
    (``blocks.shape[:-1] == scales.shape``, one byte per 32 values)."""
    from transformers import AutoConfig
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    config = AutoConfig.from_pretrained(CONFIGS / "gpt_oss_tiny.json")
    experts = Mxfp4GptOssExperts(config)
    codes = experts.gate_up_proj.numel() + experts.down_proj.numel()
    biases = sum(p.numel() * p.element_size() for n, p in experts.named_parameters() if n.endswith("_bias"))
    scales = codes * 2 // 32  # two codes a byte; one scale per 32 values
    result = _resolve(_intake(CONFIGS / "gpt_oss_tiny.json", kind="QLoRA", quant="  quantization: {type: mxfp4}\n"))
    assert result.figures.frozen_quantized_bytes == 2 * (codes + scales)  # 2 layers
    dense = _resolve(_intake(CONFIGS / "gpt_oss_tiny.json"))
    gap = dense.figures.frozen_base_bytes - result.figures.frozen_base_bytes
    bf16_experts = 2 * 2 * codes * 2  # 2 layers, 2 values a code byte, 2 bytes a value
    assert gap == bf16_experts - 2 * (codes + scales) - 2 * (biases // 2)  # biases fp32 instead of bf16


def test_hqq_and_torchao_nf4_layouts() -> None:
    """Documented layouts (unverified against the libraries, which do not install here)."""
    n = 4096 * 4096
    assert quant_storage.hqq_bytes(n, 4, 64).total == n // 2 + 2 * (n // 64) * 2
    assert quant_storage.torchao_nf4_bytes(n).total == n // 2 + n // 64 + (n // 64 // 256) * 2 + 16 * 2 + 2


def test_the_published_config_json_files_load(tmp_path: Path) -> None:
    for folder in sorted((EXAMPLES / "configs").iterdir()):
        if folder.is_dir():
            assert isinstance(json.loads((folder / "config.json").read_text()), dict), folder
