"""TrainingArguments / SFTConfig + adapter_config.json + config.json -> intake. The JSON fixtures were written by
transformers 5.24.0, PEFT 0.21.2 and TRL 1.9.0 themselves (tests/data/imports/hf/make_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ledgerspec.checks.validate import validate
from tests.support.imports import IMPORTS, imported, keys_of, plain


def test_trainer_lora_three_files_merged() -> None:
    doc, result = imported("hf/lora/training_args.json", "hf/lora/adapter_config.json", "hf/lora/config.json")
    assert plain(doc, "identity", "model_id") == "meta-llama/Llama-3.2-3B"
    assert plain(doc, "identity", "architecture") == "LlamaForCausalLM"
    assert plain(doc, "identity", "config_path").endswith("tests/data/imports/hf/lora/config.json")
    assert (plain(doc, "method", "kind"), plain(doc, "method", "rank"), plain(doc, "method", "alpha")) == (
        "LoRA",
        16,
        32,
    )
    assert plain(doc, "method", "target_modules") == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert plain(doc, "workload", "microbatch") == 4 and plain(doc, "workload", "gradient_accumulation") == 4
    assert plain(doc, "workload", "max_length") == "UNKNOWN"  # TrainingArguments hold no sequence length
    assert plain(doc, "optimizer", "name") == "adamw_torch_fused"
    assert plain(doc, "training", "mixed_precision") == "bf16"
    assert plain(doc, "training", "max_grad_norm") == 1.0 and plain(doc, "training", "use_cache") is False
    assert plain(doc, "memory_options", "gradient_checkpointing") is True
    # transformers 5.24 checkpoints non-reentrant without kwargs (modeling_utils._activation_checkpointing_enable)
    assert plain(doc, "memory_options", "checkpointing_kind") == ("ASSUMPTION", "non-reentrant")
    # from_pretrained(dtype="auto") loads the checkpoint's dtype: the config's
    assert plain(doc, "base_model", "loaded_dtype") == ("ASSUMPTION", "bfloat16")
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "float32")  # PEFT autocast_adapter_dtype=True
    assert result.findings == []
    assert not [f for f in validate(doc).findings if f.severity == "error"]


def test_sft_config_qlora_from_the_config_quantization() -> None:
    doc, result = imported("hf/qlora/sft_config.json", "hf/qlora/adapter_config.json", "hf/qlora/config.json")
    q = ("base_model", "quantization")
    assert plain(doc, "method", "kind") == "QLoRA"
    assert [plain(doc, *q, k) for k in ("type", "double_quant", "compute_dtype", "storage_dtype")] == [
        "nf4",
        True,
        "bfloat16",
        "uint8",
    ]
    assert plain(doc, "base_model", "loaded_dtype") == "bfloat16"  # model_init_kwargs.dtype
    assert plain(doc, "base_model", "prepare_for_kbit_training") is False  # TRL 1.9 SFTTrainer
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "bfloat16")  # TRL casts QLoRA adapters to bf16
    assert plain(doc, "workload", "max_length") == 2048
    assert plain(doc, "memory_options", "checkpointing_kind") == "non-reentrant"
    assert plain(doc, "method", "target_modules") == "all-linear"
    # TRL's default loss computes the lm_head in chunks (its fused LM head): declared as the kernel it is, which the
    # estimate models (issue 25)
    assert keys_of(result, "not-modelled") == []
    assert plain(doc, "software", "kernels", "cross_entropy") == "trl_chunked_nll"
    assert [f.pointer for f in validate(doc).findings if f.rule == "LS013"] == []


def test_fsdp2_yaml() -> None:
    doc, result = imported("hf/fsdp2/training_args.yaml", "hf/fsdp2/adapter_config.json", gpu_count=8)
    assert plain(doc, "memory_options", "sharding") == "fsdp2"
    assert plain(doc, "parallelism", "reshard_after_forward") is True
    assert plain(doc, "parallelism", "gpu_count") == 8
    assert plain(doc, "training", "max_grad_norm") == 0.3
    assert plain(doc, "optimizer", "name") == "adamw_torch"
    assert plain(doc, "identity", "config_path").endswith("examples/configs/llama-3.1-70b")  # shipped config
    assert result.findings == []


def test_a_conflict_between_files_is_a_finding(tmp_path: Path) -> None:
    adapter = json.loads((IMPORTS / "hf/lora/adapter_config.json").read_text())
    adapter["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    config = json.loads((IMPORTS / "hf/lora/config.json").read_text())
    config["_name_or_path"] = "meta-llama/Llama-3.2-3B"
    (tmp_path / "config.json").write_text(json.dumps(config))
    doc, result = imported(tmp_path / "adapter_config.json", tmp_path / "config.json")
    conflicts = [f for f in result.findings if f.kind == "conflict"]
    assert len(conflicts) == 1 and "meta-llama/Llama-3.1-8B" in conflicts[0].message
    assert plain(doc, "identity", "model_id") == "meta-llama/Llama-3.1-8B"  # the first file's value is kept
    assert doc.get("x-import", "findings").raw[0]["kind"] == "conflict"


def test_unknown_adapter_keys_and_layers_to_transform(tmp_path: Path) -> None:
    adapter = json.loads((IMPORTS / "hf/lora/adapter_config.json").read_text())
    adapter.update(layers_to_transform=[0, 1], lora_rnak=4)
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    _, result = imported(tmp_path / "adapter_config.json")
    assert keys_of(result, "not-modelled") == ["layers_to_transform"]
    assert keys_of(result, "unknown-key") == ["lora_rnak"]


# -- use_liger_kernel and TRL's loss (issue 25) ----------------------------------------------------------------------


def _args(tmp_path: Path, args: dict[str, Any], name: str = "training_args.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"output_dir": "out", "learning_rate": 1e-4, **args}), encoding="utf-8")
    return path


def test_use_liger_kernel_declares_liger_defaults_and_the_config_over_them(tmp_path: Path) -> None:
    doc, _ = imported(_args(tmp_path, {"use_liger_kernel": True, "liger_kernel_config": {"rope": False}}))
    assert doc.get("software", "kernels").value == {
        "norm": "liger_rms_norm",
        "mlp_activation": "liger_swiglu",
        "cross_entropy": "liger_fused_linear_cross_entropy",
        "rope": "eager",
    }


def test_trl_loss_type_nll_is_its_fused_head_too(tmp_path: Path) -> None:
    """TRL 1.16: ``nll`` is the default and ``chunked_nll`` its deprecated alias, both through the fused LM head; TRL
    1.9 computed ``nll`` on the logits: declared, as an ASSUMPTION saying so."""
    doc, _ = imported(_args(tmp_path, {"dataset_text_field": "text", "loss_type": "nll"}, "sft_config.json"))
    assert plain(doc, "software", "kernels", "cross_entropy") == ("ASSUMPTION", "trl_chunked_nll")


def test_training_arguments_without_an_adapter_config_are_a_full_fine_tune() -> None:
    """A Trainer's arguments and the model's config, no PEFT ``adapter_config.json``: the Trainer trains every
    parameter (issue 26). Said as an ASSUMPTION (the adapter config may just not have been given), so the adapter
    fields are not asked for."""
    doc, _ = imported("hf/lora/training_args.json", "hf/lora/config.json")
    assert plain(doc, "method", "kind") == ("ASSUMPTION", "full")
    for absent in (("method", "rank"), ("method", "target_modules"), ("adapter", "dtype")):
        assert not doc.get(*absent).present, absent
    assert not [f for f in validate(doc).findings if f.severity == "error"]
    with_adapter, _ = imported("hf/lora/training_args.json", "hf/lora/adapter_config.json", "hf/lora/config.json")
    assert plain(with_adapter, "method", "kind") == "LoRA"


def test_trl_under_zero3_checkpoints_reentrant_whatever_its_kwargs_say() -> None:
    """TRL 1.16's core trainers force ``use_reentrant=True`` for a PEFT model under DeepSpeed ZeRO-3 with gradient
    checkpointing (``dpo_trainer.py:696-714``: a warning, then the kwargs overwritten); ORPO and CPO
    (``trl.experimental``) do not. The DPO fixture's own kwargs say ``use_reentrant: false``."""
    files = ("hf/dpo/dpo_config.json", "hf/dpo/adapter_config.json", "hf/dpo/config.json")
    alone, _ = imported(*files)
    assert plain(alone, "memory_options", "checkpointing_kind") == "non-reentrant"  # one device: as written
    doc, _ = imported(*files, "accelerate/deepspeed-z3.yaml")
    assert plain(doc, "memory_options", "sharding") == "zero3"
    assert plain(doc, "memory_options", "checkpointing_kind") == "reentrant"
    assert "forces use_reentrant=True" in doc.text and "over 'non-reentrant'" in doc.text
    orpo = ("hf/orpo/orpo_config.json", "hf/orpo/adapter_config.json", "hf/orpo/config.json")
    kept, _ = imported(*orpo, "accelerate/deepspeed-z3.yaml")
    assert plain(kept, "memory_options", "checkpointing_kind") == plain(
        imported(*orpo)[0], "memory_options", "checkpointing_kind"
    )
