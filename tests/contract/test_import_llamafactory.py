"""LLaMA-Factory YAML -> intake. Expected values: the fixture files and LLaMA-Factory 0.9.5's own code
(``hparams/``, ``model/adapter.py``, ``model/model_utils/quantization.py``, ``checkpointing.py``);
``test_import_upstream.py`` checks the defaults against its dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS, imported, keys_of, plain


def test_lora_with_the_tools_defaults() -> None:
    doc, result = imported("llamafactory/lora.yaml")
    assert plain(doc, "identity", "model_id") == "meta-llama/Llama-3.1-8B"
    assert plain(doc, "method", "rank") == 16
    assert plain(doc, "method", "alpha") == ("ASSUMPTION", 32)  # lora_alpha defaults to lora_rank * 2
    assert plain(doc, "method", "target_modules") == "all-linear"  # lora_target: all
    assert plain(doc, "adapter", "dtype") == "float32"  # _setup_lora_tuning casts trainable params to fp32
    assert plain(doc, "workload", "max_length") == 4096
    assert plain(doc, "workload", "packing") == ("ASSUMPTION", False)  # stage sft
    assert (plain(doc, "workload", "microbatch"), plain(doc, "workload", "gradient_accumulation")) == (2, 8)
    # checkpointing is on unless disabled, reentrant unless use_reentrant_gc: false
    assert plain(doc, "memory_options", "gradient_checkpointing") == ("ASSUMPTION", True)
    assert plain(doc, "memory_options", "checkpointing_kind") == ("ASSUMPTION", "reentrant")
    assert plain(doc, "base_model", "prepare_for_kbit_training") is False
    assert result.findings == []
    assert not [f for f in validate(doc).findings if f.severity == "error"]


def test_qlora_storage_and_compute_follow_the_training_dtype() -> None:
    doc, result = imported("llamafactory/qlora.yaml")
    q = ("base_model", "quantization")
    assert plain(doc, "method", "kind") == "QLoRA"
    assert plain(doc, "identity", "revision") == "01c7f73d771dfac7d292323805ebc428287df4f9"
    assert plain(doc, *q, "type") == ("ASSUMPTION", "nf4")
    assert plain(doc, *q, "double_quant") is True
    # bnb_4bit_compute_dtype = bnb_4bit_quant_storage = compute_dtype (bf16: true)
    assert plain(doc, *q, "compute_dtype") == plain(doc, *q, "storage_dtype") == "bfloat16"
    assert plain(doc, "method", "target_modules") == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert plain(doc, "optimizer", "name") == "paged_adamw_8bit"
    assert plain(doc, "software", "attention_implementation") == "sdpa"
    assert result.findings == []


def test_zero2_offload_and_neat_packing() -> None:
    doc, result = imported("llamafactory/lora-zero2-offload.yaml")
    assert plain(doc, "memory_options", "sharding") == "zero2"
    assert plain(doc, "parallelism", "optimizer_placement") == "cpu"
    assert plain(doc, "parallelism", "gradient_placement") == "sharded"
    assert plain(doc, "parallelism", "parameter_placement") == "replicated"
    assert plain(doc, "memory_options", "cpu_offload") is True
    assert plain(doc, "workload", "packing") is True
    assert plain(doc, "memory_options", "checkpointing_kind") == "non-reentrant"
    assert plain(doc, "software", "attention_implementation") == "flash_attention_2"
    assert keys_of(result, "not-modelled") == ["deepspeed"]


def test_unknown_key_and_liger() -> None:
    doc, result = imported("llamafactory/unknown-keys.yaml")
    assert keys_of(result, "unknown-key") == ["lora_targt"]
    assert "did you mean 'lora_target'" in next(f.message for f in result.findings if f.key == "lora_targt")
    assert keys_of(result, "not-modelled") == []  # Liger's kernels are declared, and modelled (issue 25)
    assert plain(doc, "software", "kernel_backend") == "liger"
    assert plain(doc, "software", "kernels") == {  # enable_liger_kernel, stage sft: Liger's defaults (loader.py:142)
        "rope": "liger_rope",
        "norm": "liger_rms_norm",
        "mlp_activation": "liger_swiglu",
        "cross_entropy": "liger_fused_linear_cross_entropy",
    }


def _full(tmp_path: Path, extra: str = "", ft: str = "full") -> Path:
    path = tmp_path / "full.yaml"
    text = (
        (IMPORTS / "llamafactory" / "lora.yaml").read_text().replace("finetuning_type: lora", f"finetuning_type: {ft}")
    )
    path.write_text(text + extra)
    return path


def test_a_full_fine_tune_is_a_full_intake(tmp_path: Path) -> None:
    """``finetuning_type: full``: every parameter trained (``_setup_full_tuning``), cast to float32 by
    ``init_adapter`` (not pure_bf16, no quantization, no ZeRO-3/FSDP) and trained under bf16 autocast (``bf16: true``);
    the LoRA keys are not read. The intake reaches the minimum intake without adapter fields."""
    doc, result = imported(_full(tmp_path))
    assert plain(doc, "method", "kind") == "full"
    assert plain(doc, "base_model", "loaded_dtype") == "float32"
    assert plain(doc, "training", "mixed_precision") == "bf16"
    assert plain(doc, "base_model", "quantized") is False
    for absent in (("method", "rank"), ("method", "target_modules"), ("adapter", "dtype")):
        assert not doc.get(*absent).present, absent
    assert result.findings == []
    assert not [f for f in validate(doc).findings if f.severity == "error"]
    assert "lora_rank" in str(doc.get("x-import", "ignored").value)  # a LoRA setting, not read for full


def test_a_pure_bf16_full_fine_tune_keeps_the_half_precision_weights(tmp_path: Path) -> None:
    doc, _ = imported(_full(tmp_path, "pure_bf16: true\n"))
    assert plain(doc, "base_model", "loaded_dtype") == "bfloat16"
    assert plain(doc, "training", "mixed_precision") == "no"


def test_a_quantized_full_fine_tune_and_freeze_tuning_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LedgerspecError, match="quantized base cannot be fully fine-tuned") as exc:
        imported(_full(tmp_path, "quantization_bit: 4\n"))
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    with pytest.raises(LedgerspecError, match="finetuning_type 'freeze'") as exc:
        imported(_full(tmp_path, ft="freeze"))
    assert exc.value.exit_code == 2 and exc.value.line == 7


def test_unsloth_is_declared_as_kernels_the_estimate_does_not_model(tmp_path: Path) -> None:
    """``use_unsloth`` / ``use_unsloth_gc``: Unsloth's patched model and its offloaded checkpointing replace ops the
    estimate runs eagerly: declared in ``software.kernels.other``, so LS013 names them (issue 25)."""
    path = tmp_path / "unsloth.yaml"
    path.write_text(
        "model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: sft\nfinetuning_type: lora\nuse_unsloth: true\n"
        "use_unsloth_gc: true\n",
        encoding="utf-8",
    )
    doc, _ = imported(path)
    assert plain(doc, "software", "kernels", "other") == ["unsloth", "unsloth_gradient_checkpointing"]
    assert [f.rule for f in validate(doc).findings if f.rule == "LS013"] == ["LS013", "LS013"]
