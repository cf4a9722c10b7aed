"""The intake of a live ``transformers.Trainer``: what its objects say, each value with where it was read.

:func:`intake_from_trainer` reads the trainer's model (the model's config, the PEFT adapters as injected, the
quantization config, the dtypes of the real parameters) and its ``TrainingArguments`` and returns an
``intake/v1`` document. The ``TrainingArguments`` and the PEFT ``LoraConfig`` go through the same mapping as
``ledgerspec import`` of their JSON dumps (:mod:`ledgerspec.contract.imports.hf`: ``args.to_dict()`` and
``peft_config.to_dict()`` are those dumps), so an import and a live read agree; what only the live objects know
is read first and wins:

- ``method.target_modules``: the modules PEFT really adapted (``all-linear`` and regular expressions resolved):
  their last name component when that picks exactly the same modules, else their full names;
- ``base_model.loaded_dtype``: the model config's ``dtype`` (what ``from_pretrained``/``from_config`` loaded),
  else the frozen parameters' dtype; ``adapter.dtype``: the dtype of the real LoRA weights;
- ``base_model.prepare_for_kbit_training``: PEFT's ``prepare_model_for_kbit_training`` casts every 16-bit
  parameter that is not a 4-bit weight to float32 (peft/utils/other.py, PEFT 0.21): a quantized 16-bit base whose
  other frozen parameters are all float32 had it (but for the embeddings and the LM head when TRL's ORPO/CPO trainers
  cast them back to bfloat16: ``base_model.module_dtypes``, from their ``_peft_has_been_casted_to_bf16``);
- ``software.attention_implementation``: ``config._attn_implementation``; ``identity.revision``: the Hub commit
  the config was loaded from (:func:`hub_commit`: the config's ``_commit_hash`` before transformers 5.19, else the
  one snapshot in the Hugging Face cache that holds this config), else PEFT's ``revision``;
  ``identity.config_path``: the folder the config was read from, when it is a local folder with a ``config.json``;
- ``parallelism.gpu_count`` and ``workload.dp_world_size``: ``args.world_size`` (the launcher's ranks);
- ``training.objective``: the class of the live arguments (TRL's ``DPOConfig``, ``KTOConfig``, ``GRPOConfig``,
  ``RLOOConfig``, ``RewardConfig``, ...: a dump's keys only guess it), and the reference from the live trainer;
- ``software.kernels``: the kernels the tools put on the live model (:func:`kernels_in_use`: Liger's, TRL's fused LM
  head, Cut Cross-Entropy's forward, axolotl's LoRA kernels), besides those the arguments switch on
  (``use_liger_kernel``, TRL's loss).

Values read from the objects are plain values (provenance CONFIGURATION) with a comment naming the attribute;
the tools' defaults are never needed (a live object holds every setting). ``workload.max_length`` is UNKNOWN for a
plain ``TrainingArguments`` (they hold no sequence length; TRL's ``SFTConfig.max_length`` does): the
``LedgerCallback`` fills it from the batches it sees.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
from pathlib import Path
from typing import Any

from ledgerspec.contract.config import TRL_BF16_CASTS
from ledgerspec.contract.document import Document, from_text
from ledgerspec.contract.imports import (
    ADAPTER_FIELDS,
    MINIMUM,  # written UNKNOWN when the objects do not tell
    hf,
    shipped,
)
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.common import QUANTIZED, is_off
from ledgerspec.contract.imports.source import Source
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

RULE = "trainer-intake"


def _error(message: str, hint: str) -> LedgerspecError:
    return LedgerspecError(message, "<trainer>", rule=RULE, hint=hint, exit_code=EXIT_USAGE)


def _dtype(d: Any) -> str:
    return str(d).removeprefix("torch.")


def full_model(model: Any) -> Any:
    """The model of a full fine-tune (no PEFT adapters, trainable parameters), unwrapped from DDP/accelerate; None
    for a PEFT model or a model with nothing to train (:func:`peft_parts` says what is wrong with it)."""
    inner = model
    for _ in range(4):  # DDP / accelerate wrappers keep the model in .module
        if hasattr(inner, "peft_config"):
            return None
        nested = getattr(inner, "module", None)
        if nested is None:
            break
        inner = nested
    if any(p.requires_grad for p in inner.parameters()):
        return inner
    return None


def trained_parts(model: Any) -> None:
    """A clear error for a model the callback cannot size: neither PEFT LoRA adapters nor a full fine-tune."""
    if full_model(model) is None:
        peft_parts(model)


def peft_parts(model: Any) -> tuple[Any, Any, str]:
    """The PEFT model, its active LoRA config and the adapter's name; a clear error for anything else."""
    peft_model = model
    for _ in range(4):  # DDP / accelerate wrappers keep the model in .module
        if hasattr(peft_model, "peft_config"):
            break
        inner = getattr(peft_model, "module", None)
        if inner is None:
            break
        peft_model = inner
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        trainable = sum(int(p.numel()) for p in model.parameters() if p.requires_grad)
        if trainable:
            raise _error(
                f"the Trainer's model has no PEFT adapters and {trainable} trainable parameters: a full fine-tune, "
                "which ledgerspec does not size (it sizes LoRA/QLoRA fine-tunes)",
                "wrap the model with peft.get_peft_model(model, LoraConfig(...)) before building the Trainer",
            )
        raise _error(
            "the Trainer's model has no PEFT adapters (no peft_config) and nothing to train",
            "wrap the model with peft.get_peft_model(model, LoraConfig(...)) before building the Trainer",
        )
    name = getattr(peft_model, "active_adapter", None)
    name = name if isinstance(name, str) and name in configs else next(iter(configs))
    cfg = configs[name]
    kind = str(getattr(cfg, "peft_type", "LORA")).rsplit(".", 1)[-1].upper()
    if kind != "LORA":
        raise _error(
            f"the Trainer's model holds a {kind} adapter: ledgerspec sizes LoRA adapters only",
            "use a peft LoraConfig (QLoRA is LoRA on a bitsandbytes 4-bit base)",
        )
    return peft_model, cfg, name


def adapted_modules(peft_model: Any, adapter: str) -> list[str]:
    """The full names of the modules PEFT gave a LoRA adapter (``lora_A`` holds ``adapter``), in the base model."""
    base = peft_model.get_base_model()
    out = []
    for name, module in base.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if lora_a is not None and hasattr(lora_a, "keys") and adapter in lora_a.keys():
            out.append(name)
    return out


def target_names(peft_model: Any, adapter: str) -> list[str] | None:
    """``method.target_modules`` for the modules really adapted: the last name components when they pick exactly
    those modules (PEFT matches a plain name against the end of a module's name), else the full names."""
    adapted = adapted_modules(peft_model, adapter)
    if not adapted:
        return None
    leaves = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    base = peft_model.get_base_model()
    picked = {n for n, _ in base.named_modules() if n and n.rsplit(".", 1)[-1] in leaves}
    return leaves if picked == set(adapted) else sorted(adapted)


def _plain_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A config dump as JSON would hold it: enums as their values, sets as sorted lists."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, enum.Enum):
            v = v.value
        if isinstance(v, set | frozenset):
            v = sorted(map(str, v))
        out[k] = v
    return out


def _source(label: str, fmt: str, data: dict[str, Any]) -> Source:
    return Source(label, fmt, data, data)


def local_config_folder(config: Any) -> Path | None:
    """The local folder the model's config was read from (``config._name_or_path``), if it holds a config.json."""
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    p = Path(name)
    return p if p.is_dir() and (p / "config.json").is_file() else None


def intake_from_trainer(trainer: Any, output: str | None = None) -> Document:
    """The ``intake/v1`` of a live ``transformers.Trainer`` (or TRL trainer), read from its objects.

    ``output``: where the intake (or the ledger made from it) will be written, so that ``identity.config_path``
    is relative to it (None: the current folder). A model without PEFT LoRA adapters (a full fine-tune) is a
    :class:`~ledgerspec.errors.LedgerspecError`. The findings (settings the ledger does not model) are in the
    document's ``x-import``.
    """
    model = getattr(trainer, "model", None)
    args = getattr(trainer, "args", None)
    if model is None or args is None:
        raise _error("not a transformers Trainer (no .model and .args)", "pass the Trainer you train with")
    return intake_from_objects(model, args, output, trainer)


def intake_from_objects(model: Any, args: Any, output: str | None = None, trainer: Any = None) -> Document:
    """:func:`intake_from_trainer` from the model and the ``TrainingArguments`` (what a callback receives; with the
    trainer when it is known, its reference model is read too)."""
    full = full_model(model)  # a full fine-tune: the model itself, every parameter trained (issue 26)
    if full is not None:
        peft_model, lora, adapter = full, None, ""
        base = full
    else:
        peft_model, lora, adapter = peft_parts(model)
        base = peft_model.get_base_model()
    config = base.config
    b = Builder()
    origin = "trainer.model"
    _identity(b, config, lora, output)
    if lora is None:
        _full_dtypes(b, base, config)
    else:
        _dtypes(b, peft_model, base, config, adapter)
        targets = target_names(peft_model, adapter)
        lora_dump = _plain_dict(lora.to_dict())
        if targets is not None:
            lora_dump["target_modules"] = targets
        # the settings PEFT defaults to that the dump holds as None/False/{} (a live config holds every key)
        lora_dump = {k: v for k, v in lora_dump.items() if k in ("r", "lora_alpha", "lora_dropout") or not is_off(v)}
        lora_dump.pop("base_model_name_or_path", None)
        lora_dump.pop("revision", None)
        hf.adapter_config(_source(f"{origin}.peft_config[{adapter!r}]", "adapter-config", lora_dump), b)
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        qd = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
        hf.quantization(
            _source(f"{origin}.config", "model-config", {}), b, _plain_dict(qd), "config.quantization_config"
        )
    b.set(QUANTIZED, bool(b.value(QUANTIZED)), "config.quantization_config" if qc is not None else "no quantization")
    quantized = bool(b.value(QUANTIZED))
    if full is not None:
        if quantized:
            raise _error(
                "the Trainer's model is quantized and has no PEFT adapters: a full fine-tune of a quantized base, "
                "which cannot train its quantized weights",
                "wrap the model with peft.get_peft_model(model, LoraConfig(...)) (QLoRA), or load it unquantized",
            )
        b.set(("method", "kind"), "full", f"{origin}: no PEFT adapters, every parameter trainable (a full fine-tune)")
    else:
        b.set(
            ("method", "kind"),
            "QLoRA" if quantized else "LoRA",
            f"{origin}: PEFT LoRA on a quantized base" if quantized else f"{origin}: PEFT LoRA",
        )
    casts = _trl_casts(b, trainer)
    _prepared(b, base, quantized, casts)
    for op, (value, seen) in kernels_in_use(base).items():
        b.set(("software", "kernels", op), value, f"{origin}: {seen}")
    world = int(getattr(args, "world_size", 1) or 1)
    for path in (("parallelism", "gpu_count"), ("workload", "dp_world_size")):
        b.set(path, world, "trainer.args.world_size (the launcher's ranks)")
    if not getattr(args, "fsdp", None) and not getattr(args, "deepspeed", None):
        b.set(("memory_options", "sharding"), "none", "trainer.args: no fsdp, no deepspeed")
    b.unknown(
        ("workload", "max_length"),
        "the Trainer's objects hold no sequence length (TRL's SFTConfig.max_length does): LedgerCallback fills it "
        "from the longest batch it sees; else give your tokenizer's truncation length",
    )
    args_dump = {k: v for k, v in _plain_dict(args.to_dict()).items() if not k.startswith("_")}
    _objective(b, args, trainer)
    hf.training_args(_source("trainer.args", "training-args", args_dump), b)
    _reference(b, peft_model, trainer)
    if world > 1 and b.value(("memory_options", "sharding")) in (None, "none"):
        b.set(("memory_options", "sharding"), "none", "trainer.args: no FSDP or DeepSpeed: DDP")
        b.set(("parallelism", "strategy"), "ddp", "trainer.args: no FSDP or DeepSpeed")
        for k in ("parameter_placement", "gradient_placement", "optimizer_placement"):
            b.set(("parallelism", k), "replicated", "DDP: every rank holds a full copy")
    for path in MINIMUM:
        if path == ("method", "target_modules") and b.read_from_file(("method", "target_parameters")):
            continue
        if path == ("identity", "revision") and b.value(("identity", "config_sha256")):
            continue  # the minimum intake needs one of the two
        if full is not None and path in ADAPTER_FIELDS:
            continue  # full fine-tuning has no adapters
        if path not in b.entries:
            b.unknown(path, "the Trainer's objects do not tell: give it")
    model_id, rank = b.value(("identity", "model_id")), b.value(("method", "rank"))
    what = "full fine-tuning" if full is not None else f"{'QLoRA' if quantized else 'LoRA'} r={rank}"
    b.titles.append(f"{model_id or 'a model'}, {what}, read from a live transformers.Trainer")
    b.tools.append(
        f"a live transformers.Trainer ({type(base).__name__}, no PEFT wrapper)"
        if full is not None
        else f"a live transformers.Trainer ({type(peft_model).__name__} over {type(base).__name__})"
    )
    for entry in b.entries.values():  # the importer's labels name files; here they are the live objects
        for old, new in _ORIGINS:
            if entry.origin.startswith(old):
                entry.origin = new + entry.origin[len(old) :]
    text = b.render().replace(_IMPORT_HEAD, _HEAD, 1)
    return from_text(text, output or "<trainer>")


def _objective(b: Builder, args: Any, trainer: Any) -> None:
    """``training.objective`` from the class of the live arguments (a ``GRPOConfig``, a ``KTOConfig``...: TRL's
    trainers each take their own config class), else of the trainer (``GRPOTrainer``...), where a dump's keys only
    guess it (GRPOConfig's keys are RLOOConfig's too)."""
    for obj, suffix, where in ((args, "Config", "trainer.args"), (trainer, "Trainer", "trainer")):
        for cls in type(obj).__mro__ if obj is not None else ():
            name = cls.__name__
            if not cls.__module__.startswith("trl") or not name.endswith(suffix):
                continue
            objective = hf.CONFIG_OBJECTIVES.get(name.removesuffix(suffix) + "Config")
            if objective is not None and objective != "sft":  # sft: the default, left unwritten as before
                b.set(("training", "objective"), objective, f"{where} is TRL's {name}")
                return


def _reference(b: Builder, peft_model: Any, trainer: Any) -> None:
    """DPO's, KTO's, and GRPO's and RLOO's (``beta > 0``) reference, read from the live objects where the arguments
    leave it to TRL's defaults (TRL 1.16, dpo_trainer.py, kto_trainer.py, grpo_trainer.py, rloo_trainer.py): a
    ``ref_model`` on the trainer is a second model; a PEFT model handed to the trainer gets a frozen copy of its adapter
    named ``ref`` (dpo_trainer.py:666-691, kto_trainer.py:740-745, grpo_trainer.py:478-505, rloo_trainer.py:398-425)
    and trains against it; else the adapters are disabled (grpo_trainer.py:987-990)."""
    path = ("training", "objective_settings", "reference")
    if b.value(("training", "objective")) not in ("dpo", "kto", "grpo", "rloo") or b.value(path) in (
        "precomputed",
        "none",  # GRPO/RLOO at beta 0: no reference (grpo_trainer.py:984-986, rloo_trainer.py:670-672)
    ):
        return
    if trainer is not None and getattr(trainer, "ref_model", None) is not None:
        b.set(path, "model", "trainer.ref_model: a separate reference model")
    elif "ref" in (getattr(peft_model, "peft_config", None) or {}):
        b.set(path, "adapter_copy", "trainer.model.peft_config['ref']: TRL's frozen copy of the adapter")
    elif trainer is not None or "default" in (getattr(peft_model, "peft_config", None) or {}):
        b.set(path, "adapter_disabled", "trainer.model: one adapter and no ref_model: TRL disables the adapters")


_ORIGINS = (
    ("adapter_config.json: ", "trainer.model.peft_config: "),
    ("TrainingArguments: ", "trainer.args."),
    ("SFTConfig: ", "trainer.args."),
    ("GRPOConfig: ", "trainer.args."),
    ("RLOOConfig: ", "trainer.args."),
    ("TRL config: ", "trainer.args: "),
)
_IMPORT_HEAD = '# Imported by `ledgerspec import` (mapping: docs "From your setup").'
_HEAD = '# Read from a live Trainer by ledgerspec.intake_from_trainer (docs "From your setup").'


def _function(f: Any) -> tuple[str, str]:
    """(module, qualified name) of a function or bound method."""
    f = getattr(f, "__func__", f)
    return str(getattr(f, "__module__", "") or ""), str(getattr(f, "__qualname__", "") or "")


#: words in a Liger module's or function's name -> (op, kernel id)
_LIGER_NAMES = (
    ("rmsnorm", ("norm", "liger_rms_norm")),
    ("rms_norm", ("norm", "liger_rms_norm")),
    ("layernorm", ("norm", "liger_layer_norm")),
    ("layer_norm", ("norm", "liger_layer_norm")),
    ("swiglu", ("mlp_activation", "liger_swiglu")),
    ("geglu", ("mlp_activation", "liger_geglu")),
)


def kernels_in_use(base: Any) -> dict[str, tuple[Any, str]]:
    """The kernels the tools put on a live model, read off its functions: op -> (``software.kernels`` value, what
    was seen). Liger patches instances (``forward`` rebound to ``lce_forward``, ``LigerRMSNorm.forward``...,
    liger-kernel ``transformers/monkey_patch.py``) or classes; TRL's ``add_fused_lm_head`` rebinds ``forward`` to its
    ``_fused_forward``; the CCE fork's ``cce_patch`` replaces the class's ``forward``; axolotl's
    ``apply_lora_kernel_patches`` binds ``apply_qkv``/``apply_o`` on the attention and the MLP's ``forward``."""
    import sys

    found: dict[str, tuple[Any, str]] = {}
    module, name = _function(getattr(base, "forward", None))
    if module.startswith("liger_kernel"):
        found["cross_entropy"] = ("liger_fused_linear_cross_entropy", f"forward is {module}.{name}")
    elif module.startswith("trl.") and name.endswith("_fused_forward"):
        found["cross_entropy"] = ("trl_chunked_nll", f"forward is TRL's fused LM head ({module}.{name})")
    elif module.startswith("cut_cross_entropy"):
        found["cross_entropy"] = ("cut_cross_entropy", f"forward is {module}.{name}")
    lora: list[str] = []
    for m in base.modules():
        module, name = _function(getattr(m, "forward", None))
        words = (type(m).__module__ + "." + type(m).__name__ + " " + module + "." + name).lower()
        if "liger_kernel" in words:
            for word, (op, kernel) in _LIGER_NAMES:
                if word in words and op not in found:
                    found[op] = (kernel, f"{type(m).__name__}.forward is {module}.{name}")
        for attr, kernel in (("apply_qkv", "axolotl_lora_qkv"), ("apply_o", "axolotl_lora_o")):
            if attr in m.__dict__ and kernel not in lora:
                lora.append(kernel)
        if module.startswith("axolotl.kernels") and "mlp" in name.lower() and "axolotl_lora_mlp" not in lora:
            lora.append("axolotl_lora_mlp")
    if lora:
        found["lora_projections"] = (lora, "axolotl's LoRA kernels bound on the modules (apply_qkv, apply_o, MLP)")
    modeling = sys.modules.get(type(base).__module__)
    rope_module, rope_name = _function(getattr(modeling, "apply_rotary_pos_emb", None))
    if rope_module.startswith("liger_kernel"):
        found["rope"] = ("liger_rope", f"apply_rotary_pos_emb is {rope_module}.{rope_name}")
    return found


def _identity(b: Builder, config: Any, lora: Any, output: str | None) -> None:
    name = getattr(config, "_name_or_path", None) or getattr(lora, "base_model_name_or_path", None)
    if name:
        b.set(("identity", "model_id"), str(name), "trainer.model.config._name_or_path")
    revision = hub_commit(config)
    if revision is not None:
        b.set(("identity", "revision"), revision[0], revision[1])
    elif getattr(lora, "revision", None):
        b.set(("identity", "revision"), str(lora.revision), "trainer.model.peft_config: revision (the base's)")
    archs = getattr(config, "architectures", None)
    if isinstance(archs, list | tuple) and archs:
        b.set(("identity", "architecture"), str(archs[0]), "trainer.model.config.architectures")
    folder = local_config_folder(config)
    here = Path(output).resolve().parent if output else Path.cwd()
    if folder is not None:
        rel = os.path.relpath(folder.resolve(), here).replace(os.sep, "/")
        b.set(("identity", "config_path"), rel, "the local folder the model's config was read from")
        digest = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        b.set(("identity", "config_sha256"), digest, "sha256 of that config.json (the pin resolve checks)")
    elif name:
        found = shipped.find(str(name), shipped.default_dirs())  # a Hub id: ledgerspec's copy of its config
        if found is not None:
            rel = os.path.relpath(found.parent.resolve(), here).replace(os.sep, "/")
            b.set(
                ("identity", "config_path"),
                rel,
                f"ledgerspec's shipped copy of {name}'s published config.json (resolve reads it offline)",
            )
    impl = getattr(config, "_attn_implementation", None)
    if impl:
        b.set(("software", "attention_implementation"), str(impl), "trainer.model.config._attn_implementation")


#: a Hub repository id (``org/name``), as ``from_pretrained`` keeps it in ``config.name_or_path``
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: config settings that loading and training change (not the Hub file's): compared with the cached config.json
#: without them
_SET_AT_LOAD = frozenset(
    {
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "use_cache",
        "transformers_version",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
    }
)


def hub_commit(config: Any) -> tuple[str, str] | None:
    """The Hub commit the model's config was loaded from, with where it was read, or None when it is not known.

    transformers before 5.19 keeps it on the config (``_commit_hash``: ``from_pretrained`` reads it off the cache
    path ``.../snapshots/<commit>/config.json``, ``utils/hub.py`` ``extract_commit_hash``); 5.19 dropped that key
    (the revision is resolved once per load and kept nowhere). Then the Hugging Face cache (``HF_HUB_CACHE``, where
    ``from_pretrained`` of a repository id reads every file) is asked: the commit is the one snapshot of the
    repository whose config.json is the live config (settings that loading and training change aside,
    :data:`_SET_AT_LOAD`); several such snapshots, or none (a ``cache_dir`` elsewhere, a config edited after
    loading), tell nothing.
    """
    commit = getattr(config, "_commit_hash", None)
    if isinstance(commit, str) and commit:
        return commit, "trainer.model.config._commit_hash (the Hub commit loaded)"
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not isinstance(name, str) or not _REPO_ID.match(name) or os.path.exists(name):
        return None
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"
    snapshots = sorted(repo.glob("snapshots/*/config.json")) if repo.is_dir() else []
    found = [f.parent.name for f in snapshots if _COMMIT.match(f.parent.name) and _same_config(config, f)]
    if len(found) != 1:
        return None
    return found[0], (
        f"the one snapshot of {name} in the Hugging Face cache whose config.json is the live config "
        f"(HF_HUB_CACHE/{repo.name}/snapshots/{found[0][:12]}...)"
    )


def _same_config(config: Any, file: Path) -> bool:
    """Whether ``file`` (a config.json), read by the live config's class, is the live config, :data:`_SET_AT_LOAD`
    aside (at every level: multimodal configs nest theirs)."""
    try:
        cached = type(config).from_json_file(str(file))
        return bool(_comparable(cached.to_dict()) == _comparable(config.to_dict()))
    except Exception:  # a file another class cannot read is another model's
        return False


def _comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in _SET_AT_LOAD}
    return value


def _dtypes(b: Builder, peft_model: Any, base: Any, config: Any, adapter: str) -> None:
    import torch

    loaded = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(loaded, torch.dtype):
        b.set(("base_model", "loaded_dtype"), _dtype(loaded), "trainer.model.config.dtype (the dtype loaded)")
    else:
        frozen = [p.dtype for p in base.parameters() if not p.requires_grad and p.dtype.is_floating_point]
        if frozen:
            b.set(("base_model", "loaded_dtype"), _dtype(frozen[0]), "the frozen parameters' dtype")
    for name, p in peft_model.named_parameters():
        if p.requires_grad and f".lora_A.{adapter}." in name:
            b.set(("adapter", "dtype"), _dtype(p.dtype), "the dtype of the real LoRA weights")
            break


def _full_dtypes(b: Builder, base: Any, config: Any) -> None:
    """Full fine-tuning: ``base_model.loaded_dtype`` is the dtype the trained parameters are in now (a tool may have
    cast them after loading, as LLaMA-Factory casts them to float32), else the model config's."""
    dtypes = {p.dtype for p in base.parameters() if p.requires_grad and p.dtype.is_floating_point}
    if len(dtypes) == 1:
        b.set(("base_model", "loaded_dtype"), _dtype(next(iter(dtypes))), "the dtype of the trained parameters")
        return
    loaded = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if loaded is not None:
        b.set(("base_model", "loaded_dtype"), _dtype(loaded), "trainer.model.config.dtype (the dtype loaded)")


#: TRL 1.16's ``peft_module_casting_to_bf16`` (trl/experimental/utils.py:950-957): modules whose name holds "norm"
#: to float32; float32 weights of modules whose name holds one of these to bfloat16
TRL_CAST_TO_BF16 = ("lm_head", "embed_tokens", "wte", "wpe")


def _trl_casts(b: Builder, trainer: Any) -> bool:
    """``base_model.module_dtypes`` as TRL's ``ORPOTrainer``/``CPOTrainer`` cast a 4-bit base with ``bf16``
    (``peft_module_casting_to_bf16``, orpo_trainer.py:262-265, cpo_trainer.py:252-255, TRL 1.16), read from the flag
    they set when they do (``_peft_has_been_casted_to_bf16``, which no other TRL 1.16 trainer has); whether they did."""
    if not getattr(trainer, "_peft_has_been_casted_to_bf16", False):
        return False
    b.set(
        ("base_model", "module_dtypes"),
        dict(TRL_BF16_CASTS),
        "trainer._peft_has_been_casted_to_bf16: TRL's peft_module_casting_to_bf16 ran (norms to float32, lm_head "
        "and embed_tokens to bfloat16)",
    )
    return True


def _prepared(b: Builder, base: Any, quantized: bool, casts: bool = False) -> None:
    """Whether PEFT's ``prepare_model_for_kbit_training`` ran, from the dtypes it leaves behind (``casts``: TRL cast
    the embeddings and the LM head back to bfloat16 after it, :func:`_trl_casts`: their dtypes say nothing)."""
    import torch

    if not quantized:
        b.set(("base_model", "prepare_for_kbit_training"), False, "the base is not quantized")
        return
    loaded = b.value(("base_model", "loaded_dtype"))
    if loaded not in ("bfloat16", "float16"):
        b.unknown(
            ("base_model", "prepare_for_kbit_training"),
            "a float32 base looks the same with or without prepare_model_for_kbit_training: say whether it ran",
        )
        return
    recast = {id(p) for n, m in base.named_modules() if any(k in n for k in TRL_CAST_TO_BF16) for p in m.parameters()}
    others = [
        p.dtype
        for p in base.parameters()
        if not p.requires_grad
        and type(p).__name__ != "Params4bit"
        and p.dtype.is_floating_point
        and not (casts and id(p) in recast)
    ]
    prepared = bool(others) and all(d == torch.float32 for d in others)
    b.set(
        ("base_model", "prepare_for_kbit_training"),
        prepared,
        "the frozen non-4-bit parameters are float32 (PEFT's cast)"
        if prepared
        else f"the frozen parameters keep the loaded {loaded}: prepare_model_for_kbit_training did not run",
    )


__all__ = ["MINIMUM", "adapted_modules", "hub_commit", "intake_from_objects", "intake_from_trainer", "target_names"]
