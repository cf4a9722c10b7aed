"""Build the exact model of a document: its config, the meta-device model, the exact LoRA injection.

Shared by ``resolve``, ``estimate`` and ``measure``: one place turns ``identity``/``method``/
``base_model`` into transformers + PEFT objects. Imports torch & co. only inside functions.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.stack import targets as target_names
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes
from ledgerspec.errors import LedgerspecError, first_line, joined_lines

_err = ErrorAt("resolve")


@dataclass
class ModelSource:
    """Where the config came from, and what it is."""

    config: Any  # transformers.PretrainedConfig
    config_file: str | None
    sha256: str | None
    architecture: str | None
    #: what the user should know about how the config was read (e.g. a native class built despite ``auto_map``)
    notes: tuple[str, ...] = ()


def config_file(doc: Document, trust_remote_code: bool = False) -> tuple[Path, bytes, dict[str, Any]] | None:
    """The local ``config.json`` named by ``identity.config_path`` (relative to the document): its path, bytes and
    JSON object, checked with the standard library only (no torch); None when the document names none."""
    cfg_path = doc.get("identity", "config_path").text()
    if not cfg_path:
        return None
    base = Path(doc.path).parent if not doc.path.startswith("<") else Path.cwd()  # <stdin>, <input>
    p = (base / cfg_path).resolve()
    file: Path = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise _err(
            doc,
            ("identity", "config_path"),
            f"no config.json at {file}",
            "config_path is relative to the ledger file; point it at a config.json or its folder",
        )
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise _err(doc, ("identity", "config_path"), f"cannot read {file}: {exc.strerror}") from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _err(doc, ("identity", "config_path"), f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _err(doc, ("identity", "config_path"), f"{file} is not a JSON object")
    return file, raw, data


def native_model_type(model_type: Any) -> bool:
    """Whether transformers has its own classes for ``model_type`` (its ``CONFIG_MAPPING_NAMES``; no torch)."""
    if not isinstance(model_type, str) or not model_type:
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def remote_code_note(doc: Document, data: dict[str, Any], trust_remote_code: bool) -> str | None:
    """How a config that names its own code (``auto_map``) is built: natively when transformers knows its
    ``model_type`` (the note says so), the repository's code only with ``--trust-remote-code``; a type transformers
    does not know without that flag is a one-line error.

    transformers does the same for a local folder (``AutoConfig.from_pretrained``: ``has_local_code`` is
    ``model_type in CONFIG_MAPPING``, and remote code is used only when ``trust_remote_code`` is true;
    ``dynamic_module_utils.resolve_trust_remote_code``, transformers 5.24).
    """
    if not data.get("auto_map") or trust_remote_code:
        return None
    model_type = data.get("model_type")
    if native_model_type(model_type):
        return (
            f"config.json names its own code (auto_map), but model_type {model_type!r} is native to transformers: "
            "built with transformers' own classes (pass --trust-remote-code to run the repository's code instead)"
        )
    raise _err(
        doc,
        ("identity", "config_path"),
        f"this model needs remote code (auto_map in config.json; model_type {model_type!r} is not in transformers)",
        "pass --trust-remote-code if you trust it",
    )


def lora_rank(doc: Document) -> int:
    """``method.rank``, an integer >= 1 (a one-line error otherwise)."""
    value = doc.get("method", "rank")
    rank = value.integer()
    if rank is None or rank < 1:
        raise _err(doc, ("method", "rank"), f"method.rank must be an integer >= 1, got {value.raw!r}")
    return rank


def preflight(doc: Document, trust_remote_code: bool = False) -> None:
    """The checks of :func:`load_config` and :func:`lora_config` that need no torch, for a parent process to fail
    fast before it starts a child that imports torch (the config's pin too: ``identity.config_sha256``)."""
    local = config_file(doc, trust_remote_code)
    if local is not None:
        _check_pin(doc, local[0], hashlib.sha256(local[1]).hexdigest())
    if not config.read(doc).full:  # full fine-tuning has no adapters
        lora_rank(doc)


def load_config(doc: Document, offline: bool = False, trust_remote_code: bool = False) -> ModelSource:
    """The model config named by ``identity.config_path`` (relative to the document) or ``model_id``+``revision``."""
    local = config_file(doc, trust_remote_code)
    if local is not None:  # the pin first: a config other than the pinned one is refused before transformers loads
        _check_pin(doc, local[0], hashlib.sha256(local[1]).hexdigest())
    from ledgerspec.derivations.stack.imports import import_stack

    import_stack()  # the command line's first import of the stack: the garbage collector paused meanwhile
    from transformers import AutoConfig

    if local is not None:
        file, raw, data = local
        note = remote_code_note(doc, data, trust_remote_code)
        try:
            config = AutoConfig.from_pretrained(
                str(file.parent) if file.name == "config.json" else str(file), trust_remote_code=trust_remote_code
            )
        except Exception as exc:  # anything transformers (or its strict config dataclasses) refuses is the file's
            msg = joined_lines(exc)
            hint = (
                "fix the value in config.json (copy the model's published config.json)"
                if "validation error" in msg.lower()
                else "is model_type a transformers architecture? (custom code needs --trust-remote-code)"
            )
            raise _err(doc, ("identity", "config_path"), f"transformers cannot read {file}: {msg}", hint) from None
        archs = data.get("architectures") or []
        sha256 = hashlib.sha256(raw).hexdigest()
        return ModelSource(config, str(file), sha256, archs[0] if archs else None, (note,) if note else ())

    model_id = doc.get("identity", "model_id").text()
    if not model_id:
        raise _err(
            doc,
            ("identity",),
            "no identity.config_path and no identity.model_id",
            "set identity.config_path to a local config.json",
        )
    revision = doc.get("identity", "revision").text()
    unreachable = None if offline else hub_unreachable()
    if offline:
        go_offline()
    try:
        # local_files_only: HF_HUB_OFFLINE is read when huggingface_hub is imported, which may have happened;
        # with no way to the Hub, only the local cache is asked (no minute of retries against a missing DNS)
        config = AutoConfig.from_pretrained(
            model_id,
            revision=revision,
            trust_remote_code=trust_remote_code,
            local_files_only=offline or unreachable is not None,
        )
    except Exception as exc:  # transformers raises OSError/ValueError/EnvironmentError variants
        msg = first_line(exc)
        if unreachable and "trust_remote_code" not in msg:
            msg = f"{unreachable}, and it is not in the local Hugging Face cache"
        elif offline and "trust_remote_code" not in msg and ("connect" in msg or "local_files_only" in msg):
            msg = "it is not in the local Hugging Face cache, and --offline asks nothing of the Hub"
        hint = "set identity.config_path to a local config.json (nothing is downloaded with --offline)"
        if "trust_remote_code" in msg:
            hint = "pass --trust-remote-code if you trust this model's code"
        raise _err(doc, ("identity", "model_id"), f"cannot load the config of {model_id!r}: {msg}", hint) from None
    archs = getattr(config, "architectures", None) or []
    name_or_path = getattr(config, "_name_or_path", None)
    return ModelSource(config, str(name_or_path) if name_or_path else None, None, archs[0] if archs else None)


def _check_pin(doc: Document, file: Path, sha256: str) -> None:
    """``identity.config_sha256`` pins the exact config: every command that reads the config refuses another one
    (figures of two configurations in one ledger would otherwise pass as one)."""
    declared = (doc.get("identity", "config_sha256").text() or "").strip()
    if declared.upper() in ("", "UNKNOWN", "CONFIGURATION-SPECIFIC"):  # no pin (also in a long form's value)
        return
    if declared.lower() != sha256:
        raise _err(
            doc,
            ("identity", "config_sha256"),
            f"identity.config_sha256 does not match {file} (sha256 {sha256[:12]}...)",
            "the config changed since it was pinned: check it, then remove config_sha256 to re-pin",
            rule="config",
        )


def go_offline() -> None:
    """Nothing touches the network from here on: ``HF_HUB_OFFLINE=1`` for what is imported later, and the constant
    huggingface_hub read from it at its import (``huggingface_hub/constants.py``: ``HF_HUB_OFFLINE = _is_true(...)``)
    for what is imported already. The constant is what matters: huggingface_hub 2.4's ``hf_hub_download`` builds its
    headers before it looks at ``local_files_only``, and the user agent fetches the Hub's agent registry
    (``utils/_detect_agent.py``, ``_fetch_registry``) unless ``constants.HF_HUB_OFFLINE`` is set: one DNS query."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached at all (its host name does not resolve), else None.

    A failed DNS lookup is not transient: huggingface_hub would retry it for half a minute before failing.
    Anything else (a slow or flaky network, a proxy that resolves names itself) is left to huggingface_hub.
    """
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # behind a proxy the name may resolve only there
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except (socket.gaierror, UnicodeError) as exc:
        return (
            f"the Hub ({host}) cannot be reached: {exc.strerror or exc}"
            if isinstance(exc, socket.gaierror)
            else f"the Hub host {host!r} is not a valid name"
        )
    except OSError:
        return None
    return None


def torch_dtype(doc: Document, path: tuple[str, ...], default: str | None = None) -> Any:
    import torch

    return getattr(torch, config.require_dtype(doc, path, default))


def lora_config(doc: Document) -> Any:
    """The exact ``peft.LoraConfig`` of ``method``."""
    quiet_bitsandbytes()
    from peft import LoraConfig

    def m(*path: str) -> Any:
        return doc.get(*path)

    rank = lora_rank(doc)
    targets = m("method", "target_modules").value if m("method", "target_modules").known else None
    params = m("method", "target_parameters").value if m("method", "target_parameters").known else None
    if targets is None and params is None:
        raise _err(doc, ("method",), "method.target_modules or method.target_parameters is needed")
    kwargs: dict[str, Any] = {
        "r": rank,
        "target_modules": targets,
        "lora_alpha": m("method", "alpha").number() if m("method", "alpha").known else 8,
        "lora_dropout": m("method", "dropout").number() or 0.0,
        "bias": m("method", "bias").text() or "none",
        "use_dora": bool(m("method", "use_dora").switch()),
        # a reward model: PEFT's sequence-classification model, which adds its `score` head to modules_to_save (a
        # trainable copy; peft_model.py PeftModelForSequenceClassification.__init__, PEFT 0.18)
        "task_type": "SEQ_CLS" if is_reward_model(doc) else "CAUSAL_LM",
    }
    if params is not None:
        kwargs["target_parameters"] = [params] if isinstance(params, str) else list(params)
    for key, peft_key in (("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern")):
        if m("method", key).known and isinstance(m("method", key).value, dict):
            kwargs[peft_key] = {k: v for k, v in m("method", key).value.items() if not str(k).startswith("x-")}
    excl = m("method", "exclude_modules")
    if excl.known:  # a string is a regex matched in full, a list matched by name suffix (PEFT's exclude_modules)
        kwargs["exclude_modules"] = excl.value if isinstance(excl.value, str) else list(excl.value)
    mts = m("method", "modules_to_save")
    if mts.known:
        kwargs["modules_to_save"] = [mts.value] if isinstance(mts.value, str) else list(mts.value)
    try:
        return LoraConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise _err(doc, ("method",), f"PEFT rejects this LoRA recipe: {first_line(exc)}") from None


#: the auto classes a fine-tuned model is built with, in the order they are asked, with transformers' mapping of
#: ``model_type`` to class names (``transformers.models.auto.modeling_auto``, 5.24): text-only causal LMs, then
#: vision-language models (image-text-to-text, which covers what ``AutoModelForVision2Seq`` built before v5), then
#: other multimodal LMs (audio + text)
AUTO_CLASSES = (
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("AutoModelForMultimodalLM", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"),
)


#: what the estimate of a vision-language model leaves out (its method says so)
MULTIMODAL_LIMIT = (
    "vision-language model: the batch is text tokens only (no image tokens or patches): the vision tower is resident "
    "(frozen base, its adapters and their optimizer state are counted) but runs no forward, so its activations and "
    "the image tokens' share of the language model's activations are not in the estimate"
)


@dataclass(frozen=True)
class ModelClass:
    """The auto class that builds a config, and why that one."""

    auto_class: str  # e.g. AutoModelForImageTextToText
    class_name: str  # the model class it builds, e.g. Qwen2_5_VLForConditionalGeneration
    reason: str
    #: the class is a vision-language (or other multimodal) model: an image-text-to-text or multimodal-LM class
    #: (transformers also lists Gemma3ForConditionalGeneration as gemma3's causal LM)
    multimodal: bool = False


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(v for v in value or () if isinstance(v, str))


def model_class(config: Any) -> ModelClass | None:
    """The auto class for ``config``: the one whose mapping builds the class the config names in ``architectures``
    (``Gemma3ForConditionalGeneration``, not the text-only ``Gemma3ForCausalLM`` that the causal-LM mapping also
    offers for ``gemma3``; ``MllamaForConditionalGeneration``, not ``MllamaForCausalLM``); without such a name, the
    first of :data:`AUTO_CLASSES` that knows the ``model_type``. None: no auto class builds it (a config with
    ``auto_map`` and ``--trust-remote-code`` is left to ``AutoModelForCausalLM``'s own remote-code path)."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    known: list[tuple[str, tuple[str, ...]]] = []
    for auto, mapping in AUTO_CLASSES:
        names = _names(getattr(modeling_auto, mapping, {}).get(model_type))
        if names:
            known.append((auto, names))
    multimodal = {n for auto, names in known if auto != "AutoModelForCausalLM" for n in names}
    for arch in archs:
        for auto, names in known:
            if arch in names:
                why = f"config.json names {arch}, which {auto} builds for {model_type!r}"
                return ModelClass(auto, arch, why, arch in multimodal)
    if known:
        auto, names = known[0]
        why = f"{auto} builds {names[0]} for {model_type!r}"
        if archs:
            why += f" (config.json names {archs[0]}, which no causal-LM or image-text-to-text class is)"
        return ModelClass(auto, names[0], why, names[0] in multimodal)
    return None


def text_config(config: Any) -> Any:
    """The language model's config (``text_config`` of a vision-language config; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except (TypeError, ValueError):
        return get()


def decoder_layers(model: Any) -> tuple[str, Any] | None:
    """The language model's decoder stack, wherever it sits: ``(qualified name, ModuleList)``.

    The decoder is ``get_decoder()`` of the model (transformers' own accessor: ``model.model`` of a causal LM,
    ``model.model.language_model`` of Qwen2.5-VL/Gemma-3/Mllama); its layers are its largest ``ModuleList``.
    """
    import torch

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(root, "get_decoder", None)
    decoder = get() if get is not None else None
    if decoder is None:
        return None
    best: tuple[str, Any] | None = None
    lists: list[str] = []
    for name, module in decoder.named_modules():
        if not isinstance(module, torch.nn.ModuleList):
            continue
        if any(name.startswith(f"{outer}.") for outer in lists):  # inside a layer (transformers 4's experts)
            continue
        lists.append(name)
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        return None
    prefix = next((n for n, m in root.named_modules() if m is decoder), "")
    return (f"{prefix}.{best[0]}" if prefix else best[0]), best[1]


def is_reward_model(doc: Document) -> bool:
    """``training.objective: reward``: the model is a sequence classifier with one score (TRL's ``RewardTrainer``)."""
    return config.read(doc).training.objective == "reward"


def reward_config(model_config: Any) -> Any:
    """The config a reward model is built from, as TRL 1.16's ``RewardTrainer`` makes it: ``num_labels=1``
    (reward_trainer.py:396; a model handed over must have it, :413-418), and a pad token id, which the sequence
    classifier needs to find each row's last token (reward_trainer.py:563-572: the tokenizer's pad token, else its eos
    token; any id allocates the same)."""
    import copy

    cfg = copy.deepcopy(model_config)
    cfg.num_labels = 1
    text = text_config(cfg)
    if getattr(text, "pad_token_id", None) is None:
        eos = getattr(text, "eos_token_id", None)
        text.pad_token_id = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    return cfg


def build_base(
    doc: Document,
    config: Any,
    dtype: Any,
    trust_remote_code: bool = False,
    attention: str | None = None,
    declared_moe_layout: bool = True,
) -> Any:
    """The base model of ``config`` on the current device (use ``with torch.device("meta")``), built with the auto
    class :func:`model_class` picks. ``attention``: transformers' ``attn_implementation`` (None: its default).

    One place for resolve (:func:`build_meta_model`), the estimate and the measurement
    (:meth:`ledgerspec.derivations.engine.workload.Workload.prepare`). An architecture transformers cannot build
    is a one-line error; an attention implementation the architecture refuses names the ones it supports.
    ``declared_moe_layout``: build the MoE blocks of a declared transformers < 5 (:mod:`.legacy_moe`; resolve, the
    estimate and ``shard``), not the installed ones (the measurement runs the installed stack, as with the loss).
    """
    import transformers

    chosen = model_class(config)
    if chosen is None and not trust_remote_code:
        raise _err(
            doc,
            ("identity",),
            f"transformers cannot build this architecture: model_type {getattr(config, 'model_type', None)!r} has "
            "no causal-LM or image-text-to-text class",
            "is it a language or vision-language model transformers knows? (custom code needs --trust-remote-code)",
        )
    auto = getattr(transformers, chosen.auto_class if chosen else "AutoModelForCausalLM")
    if is_reward_model(doc):  # TRL's RewardTrainer builds AutoModelForSequenceClassification (reward_trainer.py:398)
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        model_type = getattr(config, "model_type", None)
        if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES and not trust_remote_code:
            raise _err(
                doc,
                ("training", "objective"),
                f"a reward model is a sequence classifier, and transformers has no sequence-classification class for "
                f"model_type {model_type!r}",
                "TRL's RewardTrainer builds AutoModelForSequenceClassification: is this model one it can build?",
            )
        auto, config = transformers.AutoModelForSequenceClassification, reward_config(config)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attention is not None:
        kwargs["attn_implementation"] = attention
    try:
        model = auto.from_config(config, **kwargs)
    except (ValueError, KeyError, ImportError) as exc:
        msg = first_line(exc)
        if attention is not None and "attention implementation" in msg.lower():
            supported = supported_attention(config, chosen)
            raise _err(
                doc,
                ("software", "attention_implementation"),
                f"{chosen.class_name if chosen else 'this model'} does not support attention implementation "
                f"{attention!r} in transformers {transformers.__version__}",
                f"declare one it supports: {', '.join(supported)}" if supported else None,
            ) from None
        raise _err(
            doc,
            ("identity",),
            f"transformers cannot build this architecture: {msg}",
            "is it a language or vision-language model transformers knows?",
        ) from None
    from ledgerspec.derivations.stack import legacy_moe

    if declared_moe_layout:
        legacy_moe.swap(model, doc)  # a declared transformers 4's MoE layout (nothing otherwise)
    return model


#: attention implementations and the class flag that says a model supports them (transformers 5.24
#: ``PreTrainedModel``: ``_supports_sdpa``, ``_supports_flash_attn``, ``_supports_flex_attn``; eager always)
_ATTENTION_FLAGS = (
    ("sdpa", "_supports_sdpa"),
    ("flash_attention_2", "_supports_flash_attn"),
    ("flash_attention_3", "_supports_flash_attn"),
    ("flex_attention", "_supports_flex_attn"),
)


def supported_attention(config: Any, chosen: ModelClass | None = None) -> list[str]:
    """The attention implementations the model class of ``config`` declares it supports (``eager`` first)."""
    import transformers

    chosen = chosen or model_class(config)
    cls = getattr(transformers, chosen.class_name, None) if chosen else None
    out = ["eager"]
    if cls is None:
        return out
    compatible = list(getattr(cls, "_compatible_flash_implementations", None) or [])
    for name, flag in _ATTENTION_FLAGS:
        if getattr(cls, flag, False) and not (compatible and name.startswith("flash_attention")):
            out.append(name)
    return out + compatible  # e.g. gpt-oss: only kernels with attention sinks


def build_meta_model(doc: Document, source: ModelSource, dtype: Any = None, trust_remote_code: bool = False) -> Any:
    """The base model on the meta device (no memory, no weights), in the declared ``loaded_dtype``."""
    import torch

    dtype = dtype or torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    with torch.device("meta"):
        return build_base(doc, source.config, dtype, trust_remote_code)


def inject_adapters(
    doc: Document, model: Any, on_meta: bool = False, custom_modules: dict[Any, Any] | None = None
) -> Any:
    """Inject the exact adapters with PEFT; PEFT's errors become one-line errors at ``method``.

    ``on_meta=True`` creates the adapter tensors on the meta device (``low_cpu_mem_usage``): shapes and
    dtypes without memory or init time, for counting. Adapters then keep PEFT's creation dtype (float32).
    """
    quiet_bitsandbytes()
    import warnings

    from peft import get_peft_model

    from ledgerspec.derivations.stack.legacy_moe import peft_as_v4

    cfg = lora_config(doc)
    if custom_modules:  # layers PEFT wraps through LoRA's custom-module dispatch (a GPTQ QuantLinear's GPTQLoraLinear)
        cfg._register_custom_module(custom_modules)
    names = [n for n, _ in model.named_modules(remove_duplicate=False)] + [n for n, _ in model.named_parameters()]
    # PEFT's sequence classifier (a reward model) adds both of its head names to modules_to_save, the one the model
    # lacks included (peft_model.py, PeftModelForSequenceClassification: ["classifier", "score"]), and a ledger
    # written from that config lists both: they are PEFT's, not the user's
    own = target_names.CLASSIFIER_HEADS if is_reward_model(doc) else ()
    _refuse_unmatched(doc, "modules_to_save", names, target_names.ends, names, model, skip=own)
    _refuse_unmatched(doc, "exclude_modules", names, target_names.matches, names, model)
    try:
        with warnings.catch_warnings(), peft_as_v4(model):
            warnings.simplefilter("ignore")
            wrapped = get_peft_model(model, cfg, low_cpu_mem_usage=True) if on_meta else get_peft_model(model, cfg)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        msg = first_line(exc)
        whole = str(exc)  # PEFT's message may start with a long set of targets: its phrases can lie past the cut
        unmatched = (
            _unmatched_targets(doc, cfg, names, [], _name(model)) if "not found in the base model" in whole else None
        )
        if unmatched is not None:
            raise unmatched from None
        if "lora_dropout != 0" in whole:  # peft.tuners.lora.layer.ParamWrapper.update_layer (PEFT 0.21)
            raise _err(
                doc,
                ("method", "dropout") if doc.get("method", "dropout").present else ("method",),
                f"PEFT cannot inject these adapters: {msg}: the targets include expert parameters (3-D tensors: "
                "method.target_parameters, or the expert and router names of target_modules, which PEFT converts to "
                "parameters of this MoE's fused experts, all-linear included)",
                "set method.dropout: 0 to adapt the experts, or list only the attention modules in "
                "method.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj]) to leave them alone",
            ) from None
        where: tuple[str, ...] = ("method", "target_modules") if "target" in whole.lower() else ("method",)
        hint = (
            "check module names against the architecture (e.g. q_proj, v_proj, or all-linear)"
            if "target" in whole.lower()
            else None
        )
        if hint and isinstance(cfg.target_modules, str):
            hint = target_names.string_hint(cfg.target_modules) or hint
        raise _err(doc, where, f"PEFT cannot inject these adapters: {msg}", hint) from None
    after = next(iter(wrapped.peft_config.values()), cfg)  # the config PEFT injected with (converted in place)
    adapted = list(wrapped.targeted_module_names)
    unmatched = _unmatched_targets(doc, after, names, adapted, _name(model))
    if unmatched is not None:
        raise unmatched
    adapted += list(getattr(wrapped, "targeted_parameter_names", None) or [])
    for field in ("rank_pattern", "alpha_pattern"):  # PEFT only warns of a key that matches no adapted module
        _refuse_unmatched(doc, field, adapted, target_names.pattern_matches, names, model, mapping=True)
    return wrapped


def _name(model: Any) -> str:
    return type(model).__name__


def _refuse_unmatched(
    doc: Document,
    field: str,
    against: list[str],
    rule: Callable[[str, str], bool],
    names: list[str],
    model: Any,
    skip: tuple[str, ...] = (),
    mapping: bool = False,
) -> None:
    """Refuse the names of ``method.FIELD`` (a list, or with ``mapping`` a mapping's keys) that no name of ``against``
    matches by ``rule`` (:mod:`~ledgerspec.derivations.stack.targets`); a mapping's ``x-`` keys and ``skip`` are not
    asked about; ``names``: the model's names before the injection, for the guesses."""
    declared = doc.get("method", field)
    value = declared.value
    if not (declared.known and isinstance(value, dict if mapping else list)):
        return
    # a mapping's x- keys are the document's, not PEFT's (lora_config drops them)
    listed = [str(t) for t in value if not (mapping and str(t).startswith("x-")) and str(t) not in skip]
    missing = target_names.unmatched(listed, against, rule)
    if missing:
        raise _err(doc, ("method", field), *target_names.problem(field, missing, names, _name(model), True))


def _unmatched_targets(
    doc: Document, cfg: Any, names: list[str], adapted: list[str], model: str
) -> LedgerspecError | None:
    """The error for the names of a declared ``target_modules`` list that match no module (nor parameter) of the
    model and that PEFT adapted nothing for: it skips such a name in silence while another matches
    (:mod:`~ledgerspec.derivations.stack.targets`). ``cfg``: the LoraConfig after the injection; PEFT has taken out
    of its ``target_modules`` the expert names it converted to parameters (transformers 5's fused MoE experts) and,
    for 20 names or more, shortened each to the shortest ending that still tells it apart, so a declared name is
    asked about when one of the names kept is it or its ending. ``names``: the model's module and parameter names
    before the injection; a name that matches one of them but was adapted nothing for was left out by
    ``exclude_modules`` or ``modules_to_save``, as declared."""
    declared = doc.get("method", "target_modules")
    if not (declared.known and isinstance(declared.value, list)):
        return None
    kept = list(cfg.target_modules) if isinstance(cfg.target_modules, (set, list, tuple)) else []
    asked = [str(t) for t in declared.value if any(target_names.matches(k, str(t)) for k in kept)]
    missing = target_names.unmatched(target_names.unmatched(asked, adapted), names)
    if not missing:  # in the declared order (LoraConfig keeps a set)
        return None
    return _err(
        doc, ("method", "target_modules"), *target_names.problem("target_modules", missing, names, model, bool(adapted))
    )


def cast_module_dtypes(model: Any, pairs: tuple[tuple[str, str], ...], skip: set[int] | None = None) -> int:
    """``base_model.module_dtypes``: the frozen, non-quantized floating parameters and buffers of each module whose
    name contains a key take its dtype, as TRL's ``peft_module_casting_to_bf16`` casts whole modules
    (``module.to(dtype)``, ``trl/experimental/utils.py`` in TRL 1.16; ``trl/trainer/utils.py`` in 0.x). Modules are
    visited in ``named_modules`` order, so a deeper module's cast wins over its parent's; within one name the first
    key that matches wins. Trainable tensors (adapters: ``adapter.dtype``) and 4-bit/8-bit weights are left alone.
    ``skip``: ids of tensors to leave as they are (the census's meta stand-ins of quantized weights). Returns how
    many tensors changed dtype."""
    import torch

    if not pairs:
        return 0
    wanted = [(key, getattr(torch, dtype)) for key, dtype in pairs]
    changed = 0
    for name, module in model.named_modules():
        target = next((dt for key, dt in wanted if key in name), None)
        if target is None:
            continue
        for sub in module.modules():
            for tensors in (sub._parameters, sub._buffers):
                for t in list(tensors.values()):
                    if (
                        t is None
                        or not t.is_floating_point()
                        or t.dtype == target
                        or getattr(t, "requires_grad", False)
                        or type(t).__name__ in ("Params4bit", "Int8Params")
                        or (skip is not None and id(t) in skip)
                    ):
                        continue
                    t.data = t.data.to(target)
                    changed += 1
    return changed
