"""Any values under the tools' own keys: the importer returns an intake that loads, or raises one
LedgerspecError (exit 2) -- never another exception (which the CLI would report as an internal error)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledgerspec.contract.document import from_text
from ledgerspec.contract.imports import import_files
from ledgerspec.contract.imports.common import known_keys
from ledgerspec.errors import LedgerspecError

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10_000),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from(["auto", "lora", "qlora", "true", "2", "nf4", "bf16", "full_shard auto_wrap", "all", ""]),
    st.text(max_size=8),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["stage", "version", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
#: the keys the importers read, per format, with a few that make a file recognisable
_KEYS = {
    "axolotl": sorted(
        {"base_model", "adapter", "load_in_4bit", "load_in_8bit", "lora_r", "lora_alpha", "lora_dropout"}
        | {"lora_target_modules", "lora_target_linear", "sequence_len", "sample_packing", "micro_batch_size"}
        | {"gradient_accumulation_steps", "batch_size", "gradient_checkpointing", "gradient_checkpointing_kwargs"}
        | {"optimizer", "bf16", "fp16", "deepspeed", "fsdp_config", "fsdp_version", "bnb_config_kwargs"}
        | {"flash_attention", "attn_implementation", "max_grad_norm", "lora_modules_to_save", "peft_use_dora"}
        | {"activation_offloading", "lora_mlp_kernel", "learning_rate"}
    ),
    "llamafactory": sorted(
        {"model_name_or_path", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target"}
        | {"quantization_bit", "quantization_type", "double_quantization", "cutoff_len", "packing", "neat_packing"}
        | {"per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "pure_bf16", "optim"}
        | {"flash_attn", "deepspeed", "disable_gradient_checkpointing", "use_reentrant_gc", "upcast_layernorm"}
    ),
    "training-args": sorted(
        {"per_device_train_batch_size", "gradient_accumulation_steps", "optim", "bf16", "fp16", "max_length"}
        | {"packing", "gradient_checkpointing", "gradient_checkpointing_kwargs", "fsdp", "fsdp_config", "deepspeed"}
        | {"model_init_kwargs", "max_grad_norm", "use_cache", "loss_type", "activation_offloading"}
    ),
    "adapter-config": sorted(
        {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "modules_to_save", "use_dora"}
        | {"rank_pattern", "layers_to_transform", "base_model_name_or_path"}
    ),
}


def test_the_key_lists_cover_the_fuzzed_keys() -> None:
    tools = {"axolotl": "axolotl", "llamafactory": "llamafactory", "training-args": "trl", "adapter-config": "peft"}
    for fmt, keys in _KEYS.items():
        assert set(keys) <= known_keys(tools[fmt]) | {"peft_type"}, fmt


_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@settings(max_examples=100, **_FUZZ)  # type: ignore[arg-type]
@given(fmt=st.sampled_from(sorted(_KEYS)), data=st.data())
def test_any_values_give_an_intake_or_one_clear_error(tmp_path: Path, fmt: str, data: Any) -> None:
    _imports_or_refuses(tmp_path, fmt, data)


@pytest.mark.slow  # 300 more configurations in the full suite
@settings(max_examples=300, **_FUZZ)  # type: ignore[arg-type]
@given(fmt=st.sampled_from(sorted(_KEYS)), data=st.data())
def test_many_values_give_an_intake_or_one_clear_error(tmp_path: Path, fmt: str, data: Any) -> None:
    _imports_or_refuses(tmp_path, fmt, data)


def _imports_or_refuses(tmp_path: Path, fmt: str, data: Any) -> None:
    keys = data.draw(st.lists(st.sampled_from(_KEYS[fmt]), unique=True, max_size=12))
    config = {k: data.draw(_VALUES) for k in keys}
    if fmt == "axolotl" and data.draw(st.booleans()):  # most runs past the adapter check
        config["adapter"] = data.draw(st.sampled_from(["lora", "qlora"]))
    if fmt == "llamafactory" and data.draw(st.booleans()):
        config["finetuning_type"] = "lora"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    try:
        result = import_files([str(path)], fmt=fmt)
    except LedgerspecError as exc:
        assert exc.exit_code == 2 and "\n" not in exc.format()
        return
    doc = from_text(result.text)
    assert doc.kind == "intake"


def test_a_control_character_in_a_value_reaches_the_comment_escaped(tmp_path: Path) -> None:
    """Found by the fuzz above: LLaMA-Factory's ``quantization_bit: "\\b"`` was quoted raw in the comment beside
    ``method.kind``, and YAML forbids control characters there: the intake could not be read back."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"quantization_bit": "\x08"}))
    result = import_files([str(path)], fmt="llamafactory")
    assert "\x08" not in result.text and "quantization_bit \\x08" in result.text
    from_text(result.text)  # reads back
