"""The Llama-3.2-3B config shipped for benchmarks/estimate_vs_peft.py reproduces PEFT's published counts.

PEFT's MetaMathQA results (huggingface/peft, method_comparison/MetaMathQA/results/*.json, commit 51c2ff666) log
``num_trainable_params`` and ``num_total_params`` of every run on meta-llama/Llama-3.2-3B. Those numbers are
external: the config must build a model with exactly the base parameters they imply, and ``resolve`` must count
exactly the trainable parameters PEFT counted for each LoRA recipe.
"""

from __future__ import annotations

import json

import pytest

from tests.support import REPO_ROOT

ROOT = REPO_ROOT
CONFIG = ROOT / "examples" / "configs" / "llama-3.2-3b" / "config.json"

#: (experiment, rank, targets, use_dora, published trainable, published total) from results/lora--llama-3.2-3B-*.json
PUBLISHED = [
    ("rank32", 32, ["q_proj", "v_proj"], False, 9_175_040, 3_221_924_864),
    ("rank64", 64, ["q_proj", "v_proj"], False, 18_350_080, 3_231_099_904),
    ("rank10-target-mlp", 10, ["gate_proj", "up_proj", "down_proj"], False, 9_461_760, 3_222_211_584),
    ("rank32-dora", 32, ["q_proj", "v_proj"], True, 9_289_728, 3_222_039_552),
]
#: full-finetuning--llama-3.2-3B-lr_0.00001.json: every parameter trainable
PUBLISHED_BASE = 3_212_749_824


def intake(rank: int, targets: list[str], dora: bool) -> str:
    return f"""ledgerspec: intake/v1
identity: {{model_id: meta-llama/Llama-3.2-3B, config_path: {CONFIG}}}
method: {{kind: LoRA, rank: {rank}, alpha: {2 * rank}, dropout: 0.0, target_modules: [{", ".join(targets)}],
  use_dora: {str(dora).lower()}}}
base_model: {{loaded_dtype: bfloat16, quantized: false}}
adapter: {{dtype: float32}}
workload: {{max_length: 768, microbatch: 4, gradient_accumulation: 1, packing: false}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: false}}
"""


def test_config_builds_the_published_base() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(CONFIG.parent)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    unique = {id(p): p.numel() for p in model.parameters()}  # tied embedding counted once
    assert sum(unique.values()) == PUBLISHED_BASE
    assert config.tie_word_embeddings is True


@pytest.mark.parametrize("name, rank, targets, dora, trainable, total", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_counts_follow_from_the_config(
    name: str, rank: int, targets: list[str], dora: bool, trainable: int, total: int
) -> None:
    """The published trainable count is r(d_in + d_out) per target (+ d_out for DoRA's magnitude) per layer."""
    c = json.loads(CONFIG.read_text())
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {
        "q_proj": (h, h),
        "v_proj": (h, kv),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) + (shapes[t][1] if dora else 0) for t in targets)
    assert per_layer * c["num_hidden_layers"] == trainable
    assert PUBLISHED_BASE + trainable == total


@pytest.mark.parametrize("name, rank, targets, dora, trainable, total", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_resolve_counts_what_peft_counted(
    name: str, rank: int, targets: list[str], dora: bool, trainable: int, total: int
) -> None:
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.resolve.resolver import resolve

    doc = from_text(intake(rank, targets, dora), str(ROOT / "benchmarks" / "peft.intake.yaml"))
    figures = resolve(doc, offline=True).figures
    assert figures.trainable_parameters == trainable
    assert figures.total_parameters + figures.trainable_parameters == total
    assert figures.adapter_bytes == 4 * trainable  # fp32 adapters (autocast_adapter_dtype=True)
