"""Import of existing training configurations into an ``intake/v1`` (``ledgerspec import``, ``init --from``).

One module per tool, each a table of what maps where, with the tool's defaults as ASSUMPTION and every other key
accounted for (:func:`~ledgerspec.contract.imports.common.account_for_rest`):

- :mod:`.axolotl` (axolotl YAML), :mod:`.llamafactory` (LLaMA-Factory YAML),
- :mod:`.hf` (``TrainingArguments`` / TRL ``SFTConfig``, PEFT ``adapter_config.json``, a model ``config.json``, a
  DeepSpeed JSON), which may be given together and are merged (a disagreement is a finding),
- :mod:`.accelerate` (an accelerate config YAML: processes, mixed precision, the FSDP or DeepSpeed plugin).

Pure Python and no network: the contract wing. The mapping is documented in docs "From your setup".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ledgerspec.contract.config import TRL_BF16_CASTS
from ledgerspec.contract.imports import accelerate, axolotl, hf, llamafactory, shipped
from ledgerspec.contract.imports.builder import Builder, Finding
from ledgerspec.contract.imports.common import QUANTIZED, VERSIONS
from ledgerspec.contract.imports.source import FORMATS, Source, read
from ledgerspec.errors import LedgerspecError, described

#: the order sources are read in: the training arguments first (they decide the loader's dtype defaults), the
#: adapter, then the model config (its dtype is only a fallback)
_ORDER = ("axolotl", "llamafactory", "training-args", "accelerate", "adapter-config", "deepspeed", "model-config")
_CONVERT = {
    "axolotl": axolotl.convert,
    "llamafactory": llamafactory.convert,
    "training-args": hf.training_args,
    "adapter-config": hf.adapter_config,
    "model-config": hf.model_config,
    "deepspeed": hf.deepspeed_file,
    "accelerate": accelerate.convert,
}


@dataclass
class Imported:
    """The intake text and what the import could not carry over."""

    text: str
    findings: list[Finding]
    sources: list[Source]


def import_files(
    paths: list[str],
    *,
    fmt: str | None = None,
    gpu_count: int | None = None,
    output: str | None = None,
    config_dirs: list[Path] | None = None,
) -> Imported:
    """Read ``paths`` (each recognised, or all of format ``fmt``) and build one intake.

    ``output`` is where the intake will be written (None: the current folder), so that ``identity.config_path``
    is relative to it; ``config_dirs`` are searched for a shipped config of the model (default: the checkout's
    ``examples/configs``).
    """
    sources = [read(p, fmt) for p in paths]
    tools = [s for s in sources if s.format in ("axolotl", "llamafactory")]
    if len(tools) > 1:
        raise LedgerspecError(
            f"{len(tools)} tool configurations given ({', '.join(s.path for s in tools)})",
            tools[1].path,
            rule="import",
            hint="import one axolotl or LLaMA-Factory file at a time (with its DeepSpeed JSON, if any)",
        )
    b = Builder()
    for src in sorted(sources, key=lambda s: _ORDER.index(s.format)):
        try:
            _CONVERT[src.format](src, b)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # a value of a type the tool would refuse too (a list where a word belongs, ...): one line, exit 2
            raise LedgerspecError(
                f"a setting holds a value of an unexpected type ({described(exc, 120)})",
                src.path,
                rule="import",
                hint=f"check the file against {FORMATS[src.format]}'s documented settings",
            ) from None
    _finish(b, sources, gpu_count, output, config_dirs)
    return Imported(b.render(), b.findings, sources)


def _finish(
    b: Builder, sources: list[Source], gpu_count: int | None, output: str | None, dirs: list[Path] | None
) -> None:
    """What needs every file: the method kind and adapter dtype of a Hugging Face import, the config path, the
    number of GPUs, and UNKNOWN for each minimum-intake field no file gave."""
    hf_family = not any(s.format in ("axolotl", "llamafactory") for s in sources)
    first = sources[0].path
    quantized = bool(b.value(QUANTIZED))
    if hf_family:
        if any(s.format == "adapter-config" for s in sources):
            b.set(("method", "kind"), "QLoRA" if quantized else "LoRA", "adapter_config.json + the base's quantization")
        elif any(s.format == "training-args" for s in sources) and not quantized:
            b.assume(
                ("method", "kind"),
                "full",
                "training arguments without a PEFT adapter_config.json",
                "no adapter config was given: the Trainer trains every parameter of the model (a full fine-tune); "
                "import the run's adapter_config.json with it for LoRA",
            )
        if any(s.format == "adapter-config" for s in sources):
            trl = b.facts.get("trl", False)
            if trl and quantized and b.value(("training", "objective")) == "reward":
                b.assume(
                    ("adapter", "dtype"),
                    "bfloat16",
                    "TRL RewardTrainer casts trainable parameters of a quantized model to bfloat16",
                    "TRL 1.16.0 RewardTrainer: the adapters and the score head's copy on a quantized base are cast to "
                    "bfloat16 (reward_trainer.py:549-554)",
                )
            elif trl and quantized and b.value(("training", "objective")) in ("orpo", "cpo"):
                b.assume(
                    ("adapter", "dtype"),
                    "float32",
                    "PEFT get_peft_model(autocast_adapter_dtype=True): ORPOTrainer/CPOTrainer do not cast the adapters",
                    "TRL 1.16.0 ORPOTrainer/CPOTrainer keep PEFT's float32 adapters on a quantized base "
                    "(orpo_trainer.py:243-261, cpo_trainer.py:233-251)",
                )
            elif trl and quantized:
                b.assume(
                    ("adapter", "dtype"),
                    "bfloat16",
                    "TRL SFTTrainer casts trainable parameters of a quantized model to bfloat16",
                    f"TRL {VERSIONS['trl']} SFTTrainer: adapters on a quantized base are cast to bfloat16",
                )
            elif trl and b.value(("memory_options", "sharding")) == "zero3" and b.value(("base_model", "loaded_dtype")):
                b.assume(
                    ("adapter", "dtype"),
                    b.value(("base_model", "loaded_dtype")),
                    "TRL SFTTrainer under ZeRO-3: get_peft_model(autocast_adapter_dtype=False)",
                    f"TRL {VERSIONS['trl']} keeps the adapters in the base dtype under ZeRO-3",
                )
            else:
                b.assume(
                    ("adapter", "dtype"),
                    "float32",
                    "PEFT get_peft_model(autocast_adapter_dtype=True)",
                    f"PEFT {VERSIONS['peft']} upcasts the adapters to float32 by default",
                )
        mo = ("memory_options",)
        objective = b.value(("training", "objective")) or "sft"
        if (
            b.facts.get("trl", False)
            and any(s.format == "adapter-config" for s in sources)
            and b.value((*mo, "sharding")) == "zero3"
            and b.value((*mo, "gradient_checkpointing"))
            and objective not in ("orpo", "cpo")  # trl.experimental's ORPO/CPO trainers leave the kwargs alone
        ):
            b.force(
                (*mo, "checkpointing_kind"),
                "reentrant",
                "TRL 1.16.0 forces use_reentrant=True for a PEFT model under DeepSpeed ZeRO-3 "
                "(sft_trainer.py, dpo_trainer.py:696-714 and the other core trainers)",
            )
        if quantized:
            if b.facts.get("trl") and objective in ("orpo", "cpo"):
                trainer = f"TRL 1.16.0 {str(objective).upper()}Trainer"
                b.set(
                    ("base_model", "prepare_for_kbit_training"),
                    True,
                    f"{trainer} calls it on a quantized base (orpo_trainer.py:220-232, cpo_trainer.py:210-222)",
                )
                if b.value(("training", "mixed_precision")) == "bf16":
                    b.set(
                        ("base_model", "module_dtypes"),
                        dict(TRL_BF16_CASTS),
                        f"{trainer} with bf16: peft_module_casting_to_bf16 (orpo_trainer.py:262-265, "
                        "experimental/utils.py:950-957)",
                    )
            elif b.facts.get("trl"):
                b.set(("base_model", "prepare_for_kbit_training"), False, "TRL 1.9 SFTTrainer does not call it")
            else:
                b.unknown(
                    ("base_model", "prepare_for_kbit_training"),
                    "the Trainer does not call prepare_model_for_kbit_training; your script may: say which",
                )
        else:
            b.set(("base_model", "prepare_for_kbit_training"), False, "the base is not quantized")
    here = Path(output).resolve().parent if output else Path.cwd()
    if b.config_files:
        target = Path(b.config_files[0]).resolve()
        b.set(("identity", "config_path"), _rel(target, here), "the config.json given (resolve reads it offline)")
    else:
        model_id = b.value(("identity", "model_id"))
        found = shipped.find(str(model_id), dirs if dirs is not None else shipped.default_dirs()) if model_id else None
        if found is not None:
            b.set(
                ("identity", "config_path"),
                _rel(found.parent, here),
                f"ledgerspec's shipped copy of {model_id}'s published config.json (resolve reads it offline)",
            )
    if gpu_count is not None:
        for path in (("parallelism", "gpu_count"), ("workload", "dp_world_size")):
            b.entries.pop(path, None)
            b.set(path, gpu_count, "--gpu-count (the launcher's number of ranks)")
        if (
            gpu_count > 1
            and b.value(("memory_options", "sharding")) in (None, "none")
            and not b.read_from_file(("memory_options", "sharding"))
        ):
            b.entries.pop(("memory_options", "sharding"), None)
            b.set(("memory_options", "sharding"), "none", "--gpu-count > 1 without sharding settings: DDP")
            b.set(("parallelism", "strategy"), "ddp", "--gpu-count > 1 without sharding settings")
            for k in ("parameter_placement", "gradient_placement", "optimizer_placement"):
                b.set(("parallelism", k), "replicated", "DDP: every rank holds a full copy")
    full = b.value(("method", "kind")) == "full"
    for path in MINIMUM:
        if path == ("method", "target_modules") and b.read_from_file(("method", "target_parameters")):
            continue
        if full and path in ADAPTER_FIELDS:  # full fine-tuning has no adapters
            continue
        if path not in b.entries:
            b.unknown(path, "not in the files: give it", first)
    if b.value(("method", "kind")) == "QLoRA":
        for key in ("type", "double_quant", "compute_dtype", "storage_dtype"):
            if ("base_model", "quantization", key) not in b.entries:
                b.unknown(("base_model", "quantization", key), "not in the files: give it", first)
    model, kind, rank = (b.value(p) for p in (("identity", "model_id"), ("method", "kind"), ("method", "rank")))
    what = ", ".join(sorted({s.format for s in sources}, key=_ORDER.index))
    b.titles.append(
        f"{model or 'a model'}, {kind or 'LoRA/QLoRA'}" + (f" r={rank}" if rank else "") + f", imported from {what}"
    )


#: the minimum intake fields of the adapters, which full fine-tuning does not have
ADAPTER_FIELDS = (("method", "rank"), ("method", "target_modules"), ("adapter", "dtype"))
#: the minimum intake fields an import writes UNKNOWN when the sources do not tell
MINIMUM = (
    ("identity", "model_id"),
    ("identity", "revision"),
    ("method", "kind"),
    ("method", "rank"),
    ("method", "target_modules"),
    ("base_model", "loaded_dtype"),
    ("adapter", "dtype"),
    ("workload", "microbatch"),
    ("workload", "max_length"),
    ("optimizer", "name"),
    ("memory_options", "gradient_checkpointing"),
)


def _rel(target: Path, here: Path) -> str:
    return os.path.relpath(target, here).replace(os.sep, "/")


__all__ = ["FORMATS", "Finding", "Imported", "import_files"]
