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

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes
from ledgerspec.errors import first_line, joined_lines

_err = ErrorAt("resolve")


@dataclass
class ModelSource:
    """Where the config came from, and what it is."""

    config: Any  # transformers.PretrainedConfig
    config_file: str | None
    sha256: str | None
    architecture: str | None


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
    if data.get("auto_map") and not trust_remote_code:
        raise _err(
            doc,
            ("identity", "config_path"),
            "this model needs remote code (auto_map in config.json)",
            "pass --trust-remote-code if you trust it",
        )
    return file, raw, data


def lora_rank(doc: Document) -> int:
    """``method.rank``, an integer >= 1 (a one-line error otherwise)."""
    value = doc.get("method", "rank")
    rank = value.integer()
    if rank is None or rank < 1:
        raise _err(doc, ("method", "rank"), f"method.rank must be an integer >= 1, got {value.raw!r}")
    return rank


def preflight(doc: Document, trust_remote_code: bool = False) -> None:
    """The checks of :func:`load_config` and :func:`lora_config` that need no torch, for a parent process to fail
    fast before it starts a child that imports torch."""
    config_file(doc, trust_remote_code)
    lora_rank(doc)


def load_config(doc: Document, offline: bool = False, trust_remote_code: bool = False) -> ModelSource:
    """The model config named by ``identity.config_path`` (relative to the document) or ``model_id``+``revision``."""
    local = config_file(doc, trust_remote_code)
    from transformers import AutoConfig

    if local is not None:
        file, raw, data = local
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
        _check_pin(doc, file, sha256)
        return ModelSource(config, str(file), sha256, archs[0] if archs else None)

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
        "task_type": "CAUSAL_LM",
    }
    if params is not None:
        kwargs["target_parameters"] = [params] if isinstance(params, str) else list(params)
    for key, peft_key in (("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern")):
        if m("method", key).known and isinstance(m("method", key).value, dict):
            kwargs[peft_key] = {k: v for k, v in m("method", key).value.items() if not str(k).startswith("x-")}
    mts = m("method", "modules_to_save")
    if mts.known:
        kwargs["modules_to_save"] = [mts.value] if isinstance(mts.value, str) else list(mts.value)
    try:
        return LoraConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise _err(doc, ("method",), f"PEFT rejects this LoRA recipe: {first_line(exc)}") from None


def build_meta_model(doc: Document, source: ModelSource, dtype: Any = None, trust_remote_code: bool = False) -> Any:
    """The base model on the meta device (no memory, no weights), in the declared ``loaded_dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(source.config, dtype=dtype, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as exc:
        raise _err(
            doc,
            ("identity",),
            f"transformers cannot build this architecture: {first_line(exc)}",
            "is it a causal language model transformers knows?",
        ) from None


def inject_adapters(doc: Document, model: Any, on_meta: bool = False) -> Any:
    """Inject the exact adapters with PEFT; PEFT's errors become one-line errors at ``method``.

    ``on_meta=True`` creates the adapter tensors on the meta device (``low_cpu_mem_usage``): shapes and
    dtypes without memory or init time, for counting. Adapters then keep PEFT's creation dtype (float32).
    """
    quiet_bitsandbytes()
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
        msg = first_line(exc)
        where: tuple[str, ...] = ("method", "target_modules") if "target" in msg.lower() else ("method",)
        hint = (
            "check module names against the architecture (e.g. q_proj, v_proj, or all-linear)"
            if "target" in msg.lower()
            else None
        )
        raise _err(doc, where, f"PEFT cannot inject these adapters: {msg}", hint) from None


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
