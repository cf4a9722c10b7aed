"""Build the exact model of a document: its config, the meta-device model, the exact LoRA injection.

Shared by ``resolve``, ``estimate`` and ``measure``: one place turns ``identity``/``method``/
``base_model`` into transformers + PEFT objects. Imports torch & co. only inside functions.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledgerspec.contract import dtypes
from ledgerspec.contract.document import Document, pointer
from ledgerspec.errors import EXIT_FINDINGS, LedgerspecError


def _err(doc: Document, path: tuple[str, ...], message: str, hint: str | None = None,
         rule: str = "resolve") -> LedgerspecError:
    line, col = doc.position(pointer(*path))
    return LedgerspecError(message, doc.path, line, col, rule=rule, hint=hint, exit_code=EXIT_FINDINGS)


@dataclass
class ModelSource:
    """Where the config came from, and what it is."""

    config: Any  # transformers.PretrainedConfig
    config_file: str | None
    sha256: str | None
    architecture: str | None


def load_config(doc: Document, offline: bool = False, trust_remote_code: bool = False) -> ModelSource:
    """The model config named by ``identity.config_path`` (relative to the document) or ``model_id``+``revision``."""
    from transformers import AutoConfig

    cfg_path = doc.get("identity", "config_path").text()
    if cfg_path:
        base = Path(doc.path).parent if doc.path not in ("<input>", "<stdin>") else Path.cwd()
        p = (base / cfg_path).resolve()
        file: Path = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise _err(doc, ("identity", "config_path"), f"no config.json at {file}",
                       "config_path is relative to the ledger file; point it at a config.json or its folder")
        raw = file.read_bytes()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _err(doc, ("identity", "config_path"), f"{file} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise _err(doc, ("identity", "config_path"), f"{file} is not a JSON object")
        if data.get("auto_map") and not trust_remote_code:
            raise _err(doc, ("identity", "config_path"), "this model needs remote code (auto_map in config.json)",
                       "pass --trust-remote-code if you trust it")
        try:
            config = AutoConfig.from_pretrained(str(file.parent) if file.name == "config.json" else str(file),
                                                trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, OSError) as exc:
            raise _err(doc, ("identity", "config_path"), f"transformers cannot read {file}: {_one_line(exc)}",
                       "is model_type a transformers architecture? (custom code needs --trust-remote-code)"
                       ) from None
        archs = data.get("architectures") or []
        return ModelSource(config, str(file), hashlib.sha256(raw).hexdigest(), archs[0] if archs else None)

    model_id = doc.get("identity", "model_id").text()
    if not model_id:
        raise _err(doc, ("identity",), "no identity.config_path and no identity.model_id",
                   "set identity.config_path to a local config.json")
    revision = doc.get("identity", "revision").text()
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError/ValueError/EnvironmentError variants
        msg = _one_line(exc)
        hint = "set identity.config_path to a local config.json (nothing is downloaded with --offline)"
        if "trust_remote_code" in msg:
            hint = "pass --trust-remote-code if you trust this model's code"
        raise _err(doc, ("identity", "model_id"), f"cannot load the config of {model_id!r}: {msg}", hint) from None
    archs = getattr(config, "architectures", None) or []
    name_or_path = getattr(config, "_name_or_path", None)
    return ModelSource(config, str(name_or_path) if name_or_path else None, None, archs[0] if archs else None)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def torch_dtype(doc: Document, path: tuple[str, ...], default: str | None = None) -> Any:
    import torch

    name = doc.get(*path).text() or default
    canon = dtypes.canonical(name) if name else None
    if canon is None:
        raise _err(doc, path, f"unknown dtype {name!r}", "use float32, bfloat16, float16 (or fp32, bf16, fp16)")
    return getattr(torch, canon)


def lora_config(doc: Document) -> Any:
    """The exact ``peft.LoraConfig`` of ``method``."""
    from peft import LoraConfig

    def m(*path: str) -> Any:
        return doc.get(*path)

    rank = m("method", "rank").integer()
    if rank is None or rank < 1:
        raise _err(doc, ("method", "rank"), f"method.rank must be an integer >= 1, got {m('method', 'rank').raw!r}")
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
        "task_type": "CAUSAL_LM",
    }
    if params is not None:
        kwargs["target_parameters"] = [params] if isinstance(params, str) else list(params)
    for key, peft_key in (("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern")):
        if m("method", key).known and isinstance(m("method", key).value, dict):
            kwargs[peft_key] = dict(m("method", key).value)
    mts = m("method", "modules_to_save")
    if mts.known:
        kwargs["modules_to_save"] = [mts.value] if isinstance(mts.value, str) else list(mts.value)
    try:
        return LoraConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise _err(doc, ("method",), f"PEFT rejects this LoRA recipe: {_one_line(exc)}") from None


def build_meta_model(doc: Document, source: ModelSource, dtype: Any = None, trust_remote_code: bool = False) -> Any:
    """The base model on the meta device (no memory, no weights), in the declared ``loaded_dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(source.config, dtype=dtype, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as exc:
        raise _err(doc, ("identity",), f"transformers cannot build this architecture: {_one_line(exc)}",
                   "is it a causal language model transformers knows?") from None


def inject_adapters(doc: Document, model: Any, on_meta: bool = False) -> Any:
    """Inject the exact adapters with PEFT; PEFT's errors become one-line errors at ``method``.

    ``on_meta=True`` creates the adapter tensors on the meta device (``low_cpu_mem_usage``): shapes and
    dtypes without memory or init time, for counting. Adapters then keep PEFT's creation dtype (float32).
    """
    import warnings

    from peft import get_peft_model

    cfg = lora_config(doc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on_meta:
                return get_peft_model(model, cfg, low_cpu_mem_usage=True)
            return get_peft_model(model, cfg)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        msg = _one_line(exc)
        where: tuple[str, ...] = ("method", "target_modules") if "target" in msg.lower() else ("method",)
        hint = "check module names against the architecture (e.g. q_proj, v_proj, or all-linear)" \
            if "target" in msg.lower() else None
        raise _err(doc, where, f"PEFT cannot inject these adapters: {msg}", hint) from None
