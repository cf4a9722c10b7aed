"""axolotl YAML -> intake. Expected values: the fixture files, and what axolotl 0.18.0's own code does with them
(``loaders/model.py``, ``loaders/adapter.py``, ``utils/config/__init__.py``, ``utils/schemas/``; cited in
docs/from-your-setup.md). ``test_import_upstream.py`` checks the defaults against axolotl's pydantic model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract import config
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS, imported, keys_of, plain


def test_lora_maps_every_memory_setting_with_its_origin() -> None:
    doc, result = imported("axolotl/lora.yml")
    assert plain(doc, "identity", "model_id") == "meta-llama/Llama-2-7b-hf"
    assert plain(doc, "identity", "revision") == "UNKNOWN"  # no revision_of_model: the Hub's latest
    assert plain(doc, "identity", "config_path").endswith("examples/configs/llama-2-7b")
    assert (plain(doc, "method", "kind"), plain(doc, "method", "rank"), plain(doc, "method", "alpha")) == (
        "LoRA",
        32,
        16,
    )
    assert plain(doc, "method", "target_modules") == "all-linear"  # lora_target_linear: find_all_linear_names
    assert plain(doc, "method", "bias") == "none"
    assert plain(doc, "base_model", "loaded_dtype") == "bfloat16"  # bf16: true -> cfg.torch_dtype
    assert plain(doc, "base_model", "quantized") is False
    assert plain(doc, "workload", "max_length") == 4096
    assert plain(doc, "workload", "packing") is True
    assert plain(doc, "workload", "microbatch") == 2
    assert plain(doc, "workload", "gradient_accumulation") == 4
    assert plain(doc, "optimizer", "name") == "adamw_bnb_8bit"
    assert plain(doc, "memory_options", "gradient_checkpointing") is True
    assert plain(doc, "memory_options", "checkpointing_kind") == "reentrant"  # normalize_config's default
    assert plain(doc, "software", "attention_implementation") == "flash_attention_2"
    assert plain(doc, "training", "mixed_precision") == "bf16"
    assert plain(doc, "training", "loop") == "trainer"
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "float32")
    # the comment beside a value names its setting
    assert any(
        line.split("#")[0].strip() == "rank: 32" and "# axolotl: lora_r" in line for line in result.text.splitlines()
    )
    # the fused LoRA kernels axolotl turns on by itself are a note, declared (and modelled: issue 25)
    assert keys_of(result, "not-modelled") == []
    assert keys_of(result, "note") == ["adapter"]
    assert plain(doc, "software", "kernel_backend") == "axolotl LoRA kernels"
    report = validate(doc)
    assert not [f for f in report.findings if f.severity == "error"]


def test_qlora_is_axolotls_fixed_bitsandbytes_recipe() -> None:
    doc, result = imported("axolotl/qlora.yml")
    q = ("base_model", "quantization")
    assert plain(doc, "method", "kind") == "QLoRA"
    assert plain(doc, "identity", "revision") == "d04e592bb4f6aa9cfee91e2e20afa771667e1d4b"
    assert [plain(doc, *q, k) for k in ("type", "double_quant", "compute_dtype", "storage_dtype", "bits")] == [
        "nf4",
        True,
        "bfloat16",
        "bfloat16",  # bnb_4bit_quant_storage=torch.bfloat16 in _set_quantization_config
        4,
    ]
    assert plain(doc, "base_model", "prepare_for_kbit_training") is True
    assert plain(doc, "base_model", "module_dtypes") == {
        "norm": "bfloat16",
        "embed_tokens": "bfloat16",
        "lm_head": "bfloat16",
    }
    assert plain(doc, "method", "target_modules") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert plain(doc, "optimizer", "name") == "paged_adamw_8bit"
    assert plain(doc, "software", "attention_implementation") == "sdpa"
    assert "kernel_backend" not in doc.section("software")  # the four lora_*_kernel: false
    assert result.findings == []
    cfg = config.read(doc)
    assert cfg.quantization.four_bit and cfg.prepare_kbit and cfg.optimizer.spec is not None


def test_zero3_reads_the_deepspeed_file_beside_the_yaml() -> None:
    doc, result = imported("axolotl/lora-zero3.yml")
    assert plain(doc, "memory_options", "sharding") == "zero3"
    assert [
        plain(doc, "parallelism", k) for k in ("parameter_placement", "gradient_placement", "optimizer_placement")
    ] == ["sharded"] * 3
    assert plain(doc, "parallelism", "gpu_count") == "UNKNOWN"  # the launcher decides
    assert plain(doc, "memory_options", "checkpointing_kind") == "non-reentrant"  # kwargs given
    assert "deepspeed" in keys_of(result, "not-modelled")  # bucket sizes etc. kept, not modelled
    assert "zero_optimization.overlap_comm" in result.text
    doc, _ = imported("axolotl/lora-zero3.yml", gpu_count=4)
    assert plain(doc, "parallelism", "gpu_count") == 4 and plain(doc, "workload", "dp_world_size") == 4


def test_fsdp2_qlora() -> None:
    doc, result = imported("axolotl/qlora-fsdp2.yml")
    assert plain(doc, "memory_options", "sharding") == "fsdp2"
    assert plain(doc, "parallelism", "reshard_after_forward") is True
    assert plain(doc, "parallelism", "cpu_offload") is False
    # FSDP-QLoRA skips prepare_model_for_kbit_training (_prepare_model_for_quantization)
    assert plain(doc, "base_model", "prepare_for_kbit_training") is False
    assert "fsdp_config" in keys_of(result, "not-modelled")  # cpu_ram_efficient_loading


def test_every_key_is_accounted_for() -> None:
    doc, result = imported("axolotl/unknown-keys.yml")
    assert keys_of(result, "unknown-key") == ["gradient_acumulation_steps"]
    assert any("did you mean 'gradient_accumulation_steps'" in f.message for f in result.findings)
    assert {"torch_compile", "liger_rms_norm"} <= set(keys_of(result, "not-modelled"))
    assert plain(doc, "workload", "gradient_accumulation") == 2  # batch_size 8 // micro_batch_size 4
    ignored = doc.get("x-import", "ignored").raw
    assert ignored and "learning_rate" in next(iter(ignored.values()))
    # the defaults axolotl applies are ASSUMPTION with the default named
    v = doc.get("optimizer", "name")
    assert v.source == "ASSUMPTION" and v.value == "adamw_torch_fused" and "axolotl 0.18.0" in (v.note or "")
    assert doc.get("memory_options", "gradient_checkpointing").value is False


def test_qlora_under_zero3_skips_prepare_model_for_kbit_training(tmp_path: Path) -> None:
    """``_prepare_model_for_quantization`` skips PEFT's prepare under ZeRO-3: the stage is read from the JSON."""
    text = (IMPORTS / "axolotl/qlora.yml").read_text() + "deepspeed: ds.json\n"
    (tmp_path / "qlora.yml").write_text(text)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    doc, _ = imported(tmp_path / "qlora.yml")
    assert plain(doc, "base_model", "prepare_for_kbit_training") is False
    assert plain(doc, "memory_options", "sharding") == "zero3"
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    doc, _ = imported(tmp_path / "qlora.yml")
    assert plain(doc, "base_model", "prepare_for_kbit_training") is True


# -- the kernels axolotl will run (issue 25) -------------------------------------------------------------------------


def test_default_lora_kernels_are_declared_where_they_attach() -> None:
    """No lora_*_kernel set: axolotl auto-enables them for LoRA/QLoRA (check_auto_enable_lora_kernels); each attaches
    where all its projections carry LoRA (apply_lora_kernel_patches): all-linear gets the three."""
    doc, _ = imported("axolotl/lora.yml")
    assert plain(doc, "software", "kernels", "lora_projections") == [
        "axolotl_lora_mlp",
        "axolotl_lora_qkv",
        "axolotl_lora_o",
    ]
    assert config.read(doc).kernels.lora_projections == ("axolotl_lora_mlp", "axolotl_lora_qkv", "axolotl_lora_o")


def test_a_kernel_whose_projections_are_not_all_lora_does_not_attach(tmp_path: Path) -> None:
    text = (IMPORTS / "axolotl" / "lora.yml").read_text(encoding="utf-8")
    text = text.replace("lora_target_linear: true", "lora_target_modules: [q_proj, v_proj, o_proj]")
    (tmp_path / "lora.yml").write_text(text, encoding="utf-8")
    doc, _ = imported(tmp_path / "lora.yml")
    assert plain(doc, "software", "kernels", "lora_projections") == ["axolotl_lora_o"]  # no k_proj: no qkv


def test_kernels_switched_off_are_peft_layers() -> None:
    doc, _ = imported("axolotl/qlora.yml")  # the four lora_*_kernel: false
    assert plain(doc, "software", "kernels", "lora_projections") == ["eager"]


def test_liger_and_cut_cross_entropy_plugins(tmp_path: Path) -> None:
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8")
    text += (
        "plugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
        "  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n  - acme.plugins.FastRopePlugin\n"
        "liger_rms_norm: true\nliger_glu_activation: true\nliger_rope: false\n"
    )
    (tmp_path / "qlora.yml").write_text(text, encoding="utf-8")
    doc, result = imported(tmp_path / "qlora.yml")
    kernels = doc.get("software", "kernels").value
    assert {k: v for k, v in kernels.items() if k != "lora_projections"} == {
        "cross_entropy": "cut_cross_entropy",  # the plugin listed: cut_cross_entropy defaults to true
        "norm": "liger_rms_norm",
        "mlp_activation": "liger_swiglu",
        "other": ["acme.plugins.FastRopePlugin"],  # a plugin whose name says it replaces a kernel
    }
    assert "plugin acme.plugins.FastRopePlugin is not modelled" in [f.message for f in result.findings]
    lines = [f.message for f in validate(doc).findings if f.rule == "LS013"]
    assert lines == [
        "kernel replacement 'acme.plugins.FastRopePlugin' is not modelled (it likely replaces rope): the estimate runs "
        "transformers' own ops there"
    ]


def test_activation_offloading_on_lora_replaces_checkpointing(tmp_path: Path) -> None:
    """``gradient_checkpointing: offload`` on LoRA: axolotl turns the Trainer's checkpointing off and offloads every
    saved activation (core/builders/base.py; loaders/model.py applies no recompute wrap to adapters)."""
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8")
    text = text.replace("gradient_checkpointing: true", "gradient_checkpointing: offload")
    (tmp_path / "qlora.yml").write_text(text, encoding="utf-8")
    doc, _ = imported(tmp_path / "qlora.yml")
    assert plain(doc, "memory_options", "activation_offload") is True
    assert plain(doc, "memory_options", "gradient_checkpointing") is False
    assert plain(doc, "memory_options", "checkpointing_kind") == "absent"


def test_no_adapter_is_a_full_fine_tune() -> None:
    """No ``adapter:``: axolotl trains every parameter of the model it loads in ``cfg.torch_dtype`` (issue 26)."""
    doc, result = imported("axolotl/full.yml")
    assert plain(doc, "method", "kind") == "full"
    assert plain(doc, "base_model", "quantized") is False
    assert plain(doc, "base_model", "loaded_dtype") == ("ASSUMPTION", "bfloat16")  # bf16: auto
    assert plain(doc, "optimizer", "name") == "paged_adamw_8bit"
    for absent in (("method", "rank"), ("method", "target_modules"), ("adapter", "dtype"), ("method", "bias")):
        assert not doc.get(*absent).present, absent
    assert keys_of(result, "unknown-key") == []
    assert not [f for f in validate(doc).findings if f.severity == "error"]


def test_lora_settings_without_an_adapter_are_a_finding(tmp_path: Path) -> None:
    """A forgotten ``adapter:`` makes axolotl fine-tune every parameter, many times a LoRA run's memory: sized as
    the full fine-tune it is, and said at the first ``lora_*`` key (a newcomer trial: it was filed as a setting that
    does not change memory)."""
    path = tmp_path / "forgot.yml"
    path.write_text((IMPORTS / "axolotl" / "full.yml").read_text() + "lora_r: 16\nlora_alpha: 32\n")
    doc, result = imported(path)
    assert plain(doc, "method", "kind") == "full"
    found = [f for f in result.findings if f.key == "lora_r"]
    assert len(found) == 1 and "did you forget `adapter: lora`" in found[0].message and found[0].kind == "conflict"


def test_target_modules_written_as_one_string_are_a_finding(tmp_path: Path) -> None:
    """PEFT matches a string as one regular expression against each module's whole name: 'q_proj,v_proj' matches
    no module, and ``resolve`` failed on it seconds later, pointing at the intake (a newcomer trial)."""
    text = (IMPORTS / "axolotl" / "lora.yml").read_text()
    path = tmp_path / "string.yml"
    lines = [ln for ln in text.splitlines() if not ln.startswith(("lora_target_modules", "  - ", "lora_target_linear"))]
    path.write_text("\n".join(lines) + "\nlora_target_modules: q_proj,v_proj\n")
    _, result = imported(path)
    found = [f for f in result.findings if f.key == "lora_target_modules"]
    assert len(found) == 1 and "write a list" in found[0].message


def test_a_missing_base_model_is_a_finding(tmp_path: Path) -> None:
    text = (IMPORTS / "axolotl" / "lora.yml").read_text()
    path = tmp_path / "nobase.yml"
    path.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("base_model:")) + "\n")
    doc, result = imported(path)
    assert doc.get("identity", "model_id").unknown
    assert [f.key for f in result.findings if f.key == "base_model"] == ["base_model"]


def test_a_full_fine_tune_of_a_quantized_base_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "full-4bit.yml"
    path.write_text((IMPORTS / "axolotl" / "full.yml").read_text() + "load_in_4bit: true\n")
    with pytest.raises(LedgerspecError, match="load_in_4bit without an adapter") as exc:
        imported(path)
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)


def test_an_unknown_optimizer_gets_the_did_you_mean_validate_gives(tmp_path: Path) -> None:
    text = (IMPORTS / "axolotl" / "lora.yml").read_text()
    path = tmp_path / "opt.yml"
    path.write_text(
        "\n".join(ln for ln in text.splitlines() if not ln.startswith("optimizer:")) + "\noptimizer: adamw_8bit_paged\n"
    )
    _, result = imported(path)
    found = [f for f in result.findings if f.key == "optimizer"]
    assert len(found) == 1 and "(did you mean 'paged_adamw_8bit'?)" in found[0].message
