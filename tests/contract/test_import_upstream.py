"""The fixtures and the importer's defaults against each tool's own classes (an independent truth: the tools'
parsers, not ledgerspec's mapping).

transformers, PEFT and bitsandbytes' config class ship with ledgerspec[resolve], so those checks always run. axolotl,
LLaMA-Factory and TRL are not dependencies (each pulls a large stack); their checks run when the package is
importable, e.g. unpacked beside the venv without dependencies (docs "From your setup", last section):

    pip download --no-deps -d /tmp/w axolotl==0.18.0 llamafactory==0.9.5 trl==1.9.0   # unzip into /tmp/site
    DISABLE_VERSION_CHECK=1 PYTHONPATH=/tmp/site:. pytest tests/contract/test_import_upstream.py
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.imports.common import VERSIONS, known_keys
from tests.support.imports import IMPORTS, imported, plain

pytestmark = pytest.mark.slow  # imports transformers (and the tools): seconds


def _yaml(path: Path) -> dict[str, Any]:
    from ruamel.yaml import YAML

    data: dict[str, Any] = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    return data


def _needs(module: str, dist: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{dist} {VERSIONS[dist]} is not importable (not a ledgerspec dependency; see the docstring)")
    import importlib.metadata as md

    if md.version(dist) != VERSIONS[dist]:
        pytest.skip(f"{dist} {md.version(dist)} installed; the mapping was checked against {VERSIONS[dist]}")


# -- transformers and PEFT (always here) --------------------------------------------------------------------------
def test_training_args_fixtures_are_training_arguments() -> None:
    """Every key of the TrainingArguments fixtures is a field; the files build a TrainingArguments (CPU: bf16
    and fp16 off, use_cpu on, FSDP off, which are the only changes)."""
    from transformers import TrainingArguments

    for path in (IMPORTS / "hf/lora/training_args.json", IMPORTS / "hf/fsdp2/training_args.yaml"):
        data = json.loads(path.read_text()) if path.suffix == ".json" else _yaml(path)
        data.update(bf16=False, fp16=False, use_cpu=True, fsdp=None, fsdp_config=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = TrainingArguments(**{k: v for k, v in data.items() if not k.startswith("_")})
        assert args.per_device_train_batch_size == data["per_device_train_batch_size"]


def test_the_importers_trainingarguments_defaults_are_the_libraries(tmp_path: Path) -> None:
    """A TrainingArguments file that sets nothing imports the defaults transformers itself holds."""
    import dataclasses

    from transformers import TrainingArguments

    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    (tmp_path / "training_args.json").write_text(json.dumps({"output_dir": "out"}))
    doc, _ = imported(tmp_path / "training_args.json")
    assert doc.get("workload", "microbatch").value == defaults["per_device_train_batch_size"]
    assert doc.get("workload", "gradient_accumulation").value == defaults["gradient_accumulation_steps"]
    assert doc.get("optimizer", "name").value == defaults["optim"]
    assert doc.get("training", "max_grad_norm").value == defaults["max_grad_norm"]
    assert doc.get("training", "use_cache").value == defaults["use_cache"]
    assert doc.get("training", "mixed_precision").value == "no" and defaults["bf16"] is False


def test_adapter_and_quantization_configs_load_in_peft_and_transformers() -> None:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    for folder in ("hf/lora", "hf/qlora", "hf/fsdp2"):
        data = json.loads((IMPORTS / folder / "adapter_config.json").read_text())
        config = LoraConfig(**{k: v for k, v in data.items() if k not in ("peft_type",)})
        doc, _ = imported(f"{folder}/adapter_config.json")
        assert doc.get("method", "rank").value == config.r
        assert doc.get("method", "alpha").value == config.lora_alpha
        targets = config.target_modules
        assert plain(doc, "method", "target_modules") == (sorted(targets) if isinstance(targets, set) else targets)
    qc = json.loads((IMPORTS / "hf/qlora/config.json").read_text())["quantization_config"]
    bnb = BitsAndBytesConfig.from_dict(qc)
    doc, _ = imported("hf/qlora/config.json")
    assert doc.get("base_model", "quantization", "type").value == bnb.bnb_4bit_quant_type
    assert doc.get("base_model", "quantization", "double_quant").value == bnb.bnb_4bit_use_double_quant
    # a quantization_config without the 4-bit keys takes BitsAndBytesConfig's own defaults
    bare = BitsAndBytesConfig(load_in_4bit=True)
    from ledgerspec.contract.imports.hf import BNB4_DEFAULTS

    for key, (_, default) in BNB4_DEFAULTS.items():
        value = getattr(bare, key)
        assert str(value).removeprefix("torch.") == str(default), key
    assert LoraConfig().r == 8 and LoraConfig().lora_alpha == 8  # the PEFT defaults the importer assumes


def test_the_shipped_key_lists_match_the_installed_libraries() -> None:
    import dataclasses
    import importlib.metadata as md

    from peft import LoraConfig
    from transformers import TrainingArguments

    if md.version("transformers") == VERSIONS["transformers"]:
        assert {f.name for f in dataclasses.fields(TrainingArguments)} <= known_keys("transformers")
    if md.version("peft") == VERSIONS["peft"]:
        assert {f.name for f in dataclasses.fields(LoraConfig)} == known_keys("peft")


# -- the tools that are not dependencies -----------------------------------------------------------------------------
def test_axolotl_fixtures_validate_with_axolotls_pydantic_model() -> None:
    _needs("axolotl", "axolotl")
    from axolotl.utils.schemas.config import AxolotlInputConfig

    for path in sorted((IMPORTS / "axolotl").glob("*.yml")):
        data = _yaml(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AxolotlInputConfig(**data)
        doc, _ = imported(path)
        assert doc.get("workload", "microbatch").value == cfg.micro_batch_size, path.name
        assert doc.get("workload", "max_length").value == cfg.sequence_len, path.name
        assert doc.get("method", "rank").value == cfg.lora_r, path.name
        dropout = cfg.lora_dropout or 0.0
        assert doc.get("method", "dropout").value == dropout, path.name
        assert doc.get("optimizer", "name").value == (cfg.optimizer or "adamw_torch_fused"), path.name
        assert doc.get("memory_options", "gradient_checkpointing").value == bool(cfg.gradient_checkpointing)
    assert set(AxolotlInputConfig.model_fields) <= known_keys("axolotl")


def test_llamafactory_fixtures_parse_with_its_dataclasses() -> None:
    _needs("llamafactory", "llamafactory")
    from llamafactory.hparams.parser import _parse_train_args

    for path in sorted((IMPORTS / "llamafactory").glob("*.yaml")):
        if path.name == "unknown-keys.yaml":
            continue  # its typo is what LLaMA-Factory refuses too
        data = _yaml(path)
        # on this CPU machine: no bf16, no DeepSpeed; warmup_ratio is a field of the transformers LLaMA-Factory
        # 0.9.5 runs on (<= 5.6.0) that the one installed here no longer has
        data.update(bf16=False, use_cpu=True)
        for key in ("deepspeed", "warmup_ratio"):
            data.pop(key, None)
        model, data_args, _, finetuning, _ = _parse_train_args(data)
        doc, _ = imported(path)
        assert doc.get("method", "rank").value == finetuning.lora_rank, path.name
        assert doc.get("method", "alpha").value == finetuning.lora_alpha, path.name  # lora_rank * 2 when unset
        assert doc.get("workload", "max_length").value == data_args.cutoff_len + (1 if data_args.packing else 0)
        if model.quantization_bit == 4:
            assert doc.get("base_model", "quantization", "type").value == model.quantization_type
            assert doc.get("base_model", "quantization", "double_quant").value == model.double_quantization
        assert doc.get("memory_options", "gradient_checkpointing").value == (not model.disable_gradient_checkpointing)
        kind = doc.get("memory_options", "checkpointing_kind").value
        assert kind == ("reentrant" if model.use_reentrant_gc else "non-reentrant"), path.name


def test_trl_sft_config_fixture_and_defaults() -> None:
    _needs("trl", "trl")
    import dataclasses

    from trl import SFTConfig

    data = json.loads((IMPORTS / "hf/qlora/sft_config.json").read_text())
    data.update(bf16=False, use_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = SFTConfig(**data)
    assert cfg.max_length == 2048
    defaults = {f.name: f.default for f in dataclasses.fields(SFTConfig)}
    # the defaults the importer assumes for SFTConfig
    assert defaults["max_length"] == 1024 and defaults["packing"] is False and defaults["padding_free"] is False
    assert defaults["gradient_checkpointing"] is True and defaults["packing_strategy"] == "bfd"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert SFTConfig(output_dir="x", use_cpu=True, bf16=False).loss_type == "chunked_nll"
    assert {f.name for f in dataclasses.fields(SFTConfig)} <= known_keys("trl")
