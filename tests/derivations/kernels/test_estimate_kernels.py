"""The declared kernels change the simulated step as their tools change the real one (``software.kernels``).

Expected figures come from the model's config and arithmetic, not from the estimate: a fused linear cross-entropy
never holds the logits, whose size is tokens x vocabulary x bytes; axolotl's LoRA kernels train the same adapters
(the same gradients and optimizer state) and keep fewer activations.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support import EXAMPLES

CONFIG = EXAMPLES / "configs" / "llama-3.2-1b" / "config.json"
VOCAB = json.loads(CONFIG.read_text(encoding="utf-8"))["vocab_size"]
SEQ, ROWS = 1024, 2
TOKENS = SEQ * ROWS


def ledger(
    kernels: str = "", checkpointing: bool = True, loop: str = "trainer", targets: str = "[q_proj, v_proj]"
) -> Any:
    text = f"""ledgerspec: ledger/v1
identity: {{model_id: meta-llama/Llama-3.2-1B, revision: main, config_path: {CONFIG}}}
method: {{kind: LoRA, rank: 16, alpha: 32, dropout: 0.0, target_modules: {targets}, bias: none}}
base_model: {{loaded_dtype: bfloat16, quantized: false}}
adapter: {{dtype: float32}}
workload: {{max_length: {SEQ}, packing: true, microbatch: {ROWS}, gradient_accumulation: 1}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: {str(checkpointing).lower()}}}
training: {{mixed_precision: bf16, loop: {loop}}}
software:
  kernels: {{{kernels}}}
"""
    return from_text(text, "k.ledger.yaml")


def run(doc: Any, target: str = "cuda") -> Any:
    from ledgerspec.derivations.estimate.estimator import estimate

    return estimate(doc, target=target)


@pytest.fixture(scope="module")
def eager() -> Any:
    return run(ledger())


@pytest.mark.slow
@pytest.mark.xdist_group("kernels-eager")
@pytest.mark.parametrize("kernel", ["liger_fused_linear_cross_entropy", "cut_cross_entropy", "trl_chunked_nll"])
def test_a_fused_cross_entropy_drops_the_logits(eager: Any, kernel: str) -> None:
    fused = run(ledger(f"cross_entropy: {kernel}"))
    bf16_logits = TOKENS * VOCAB * 2
    # the eager step holds the bf16 logits and their float32 copy at once at the loss; the fused one neither
    assert eager.peak_allocated - fused.peak_allocated >= bf16_logits * 3
    # at the fused step's peak, nothing owned by no component is as large as one bf16 logits tensor
    assert fused.at_peak["temporary"] < bf16_logits
    assert fused.components["gradients"] == eager.components["gradients"]  # the same adapters train
    assert kernel in fused.method


@pytest.mark.slow
@pytest.mark.xdist_group("kernels-eager")
def test_a_kernel_the_estimate_does_not_model_leaves_the_step_as_it_was(eager: Any) -> None:
    other = run(ledger("cross_entropy: liger_cross_entropy, other: [unsloth]"))
    assert other.phases == eager.phases
    assert "declared kernels modelled" not in other.method


@pytest.mark.slow
def test_axolotl_lora_kernels_train_the_same_adapters_and_keep_fewer_activations() -> None:
    targets = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
    peft = run(ledger(checkpointing=False, targets=targets))
    fused = run(
        ledger("lora_projections: [axolotl_lora_qkv, axolotl_lora_o, axolotl_lora_mlp]", False, targets=targets)
    )
    for component in ("adapter", "gradients", "optimizer"):
        assert fused.components[component] == peft.components[component], component
    assert fused.activations < peft.activations
    # per layer the fused MLP keeps no activation output (intermediate x tokens x 2 bytes) nor product
    config = json.loads(CONFIG.read_text(encoding="utf-8"))
    per_layer = TOKENS * config["intermediate_size"] * 2
    assert peft.activations - fused.activations >= config["num_hidden_layers"] * per_layer


def test_a_triton_kernel_is_not_estimated_for_the_cpu() -> None:
    with pytest.raises(LedgerspecError, match="runs a Triton kernel on the GPU, which the CPU does not run"):
        run(ledger("norm: liger_rms_norm"), target="cpu")


def test_a_fused_loss_needs_the_trainer_step() -> None:
    with pytest.raises(LedgerspecError, match="custom keeps the logits"):
        run(ledger("cross_entropy: cut_cross_entropy", loop="custom"))


def test_measure_refuses_a_step_with_declared_kernels() -> None:
    """``measure`` runs transformers' and PEFT's modules: with declared kernels it would measure another step."""
    from ledgerspec.derivations.measure.measurer import make_request

    with pytest.raises(LedgerspecError, match="would measure another step") as err:
        make_request(ledger("lora_projections: [axolotl_lora_o]"), "cpu", 2, None, None)
    assert err.value.exit_code == 2


@pytest.mark.slow
def test_the_kernels_run_in_each_ranks_fsdp2_step(tmp_path: Any) -> None:
    """``shard --estimate`` simulates every rank with the declared kernels; the fused loss looks the lm_head weight
    up at each call (FSDP2 gathers it during forward), as Liger's and TRL's forwards do."""
    import shutil

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.shard.sharder import shard
    from tests.support import DATA

    shutil.copytree(DATA / "sharding" / "tiny", tmp_path / "tiny")
    text = (DATA / "sharding" / "tiny-lora-mp.ledger.yaml").read_text(encoding="utf-8")
    kernels = "  kernels: {cross_entropy: liger_fused_linear_cross_entropy, norm: liger_rms_norm, rope: liger_rope}\n"
    (tmp_path / "e.ledger.yaml").write_text(text, encoding="utf-8")
    (tmp_path / "k.ledger.yaml").write_text(text.replace("software:\n", "software:\n" + kernels, 1), encoding="utf-8")
    plain = shard(load(tmp_path / "e.ledger.yaml"), estimate=True).estimate.ranks
    fused = shard(load(tmp_path / "k.ledger.yaml"), estimate=True).estimate.ranks
    for p, f in zip(plain, fused, strict=True):
        assert f.phases["forward_peak"] < p.phases["forward_peak"]
        assert f.components["gradients"] == p.components["gradients"]


@pytest.mark.slow
def test_a_trainable_lm_head_gets_its_gradient_through_every_fused_loss(tmp_path: Any) -> None:
    """``modules_to_save: [lm_head]``: the fused kernels return the classifier's gradient too (Liger's ``grad_weight``,
    CCE's ``dc``, TRL's float32 ``grad_weight``), so the gradients and optimizer state are the eager step's. Mistral-7B
    with 2 decoder layers, traced at that depth (one trace per estimate, not two probe depths): the classifier and
    the loss sit above the decoder stack, whose depth only scales the q/v adapters both sides train alike."""
    config = tmp_path / "config.json"
    cfg = json.loads((EXAMPLES / "configs" / "mistral-7b-v0.1" / "config.json").read_text(encoding="utf-8"))
    config.write_text(json.dumps({**cfg, "num_hidden_layers": 2}), encoding="utf-8")

    def doc(kernels: str) -> Any:
        return from_text(
            f"""ledgerspec: ledger/v1
identity: {{model_id: mistralai/Mistral-7B-v0.1, revision: main, config_path: {config}}}
method: {{kind: LoRA, rank: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj], bias: none,
  modules_to_save: [lm_head]}}
base_model: {{loaded_dtype: bfloat16, quantized: false}}
adapter: {{dtype: float32}}
workload: {{max_length: 256, packing: true, microbatch: 1, gradient_accumulation: 1}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: true}}
training: {{mixed_precision: bf16}}
software: {{kernels: {{{kernels}}}}}
""",
            "m.ledger.yaml",
        )

    eager = run(doc(""))
    for kernel in ("liger_fused_linear_cross_entropy", "cut_cross_entropy", "trl_chunked_nll"):
        fused = run(doc(f"cross_entropy: {kernel}"))
        assert fused.components["gradients"] == eager.components["gradients"], kernel
        assert fused.components["optimizer"] == eager.components["optimizer"], kernel


def test_liger_applies_nothing_to_a_model_type_it_does_not_patch() -> None:
    """``_apply_liger_kernel_to_instance`` looks the model type up in ``MODEL_TYPE_TO_APPLY_LIGER_FN`` (liger-kernel
    0.8.5) and applies nothing to any other: the simulation leaves transformers' modules there, and says so."""
    from ledgerspec.contract.config import Kernels
    from ledgerspec.derivations.kernels.apply import modelled, unpatched_note

    kernels = Kernels(
        cross_entropy="liger_fused_linear_cross_entropy", norm="liger_rms_norm", lora_projections=("axolotl_lora_o",)
    )
    assert dict(modelled(kernels, "llama")) == {
        "cross_entropy": "liger_fused_linear_cross_entropy",
        "norm": "liger_rms_norm",
        "lora_projections": "axolotl_lora_o",
    }
    assert modelled(kernels, "falcon") == (("lora_projections", "axolotl_lora_o"),)
    assert unpatched_note(kernels, "llama") is None
    note = unpatched_note(kernels, "falcon")
    assert note is not None and "liger_rms_norm" in note and "falcon" in note
