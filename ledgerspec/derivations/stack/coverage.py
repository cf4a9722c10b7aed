"""What the adapters and the quantization cover, with figures: findings a user should read before trusting the sizes.

Read off the meta model after PEFT's injection (:func:`ledgerspec.derivations.stack.census.census`); ``resolve``
writes the figures into ``method.x-coverage`` and prints the notes. Each note says what PEFT or transformers did,
the figures, and how to target what the user probably meant:

- **vision tower** (a vision-language model): the share of the frozen base, of the adapter and of the quantized
  weights that sits outside the language model (vision encoder and projector). PEFT's ``all-linear`` adapts every
  ``nn.Linear`` but the output layer (``peft.tuners.tuners_utils._maybe_include_all_linear_layers``, 0.21) and
  bitsandbytes quantizes them too: both treat the vision tower like the language model. ``method.exclude_modules``
  (PEFT's ``exclude_modules``, a regex matched in full against module names) keeps adapters off it.
- **expert parameters wrapped**: for Mixtral/Qwen2-MoE-style models PEFT converts the v4 target names of the experts
  (``gate_proj``, ``up_proj``, ``down_proj``, ``w1``/``w2``/``w3``) and of the router (``gate``) into
  ``target_parameters`` on the fused v5 tensors, for a string ``target_modules`` such as ``all-linear`` too, with
  rank and alpha doubled on the fused ``gate_up_proj`` (``peft.utils.transformers_weight_conversion.
  _convert_peft_config_moe``, 0.21); ``lora.ParamWrapper`` then allows no ``lora_dropout``.
- **router adapted**: the router's weight gets an adapter by the same conversion.
- **Linear layers left without adapters** under ``all-linear``: e.g. shared experts and dense MLPs whose names the
  conversion moved to the experts' parameters.
- **3-D expert tensors** without an adapter (gpt-oss's experts under ``all-linear``: they are no ``nn.Linear``) and
  left unquantized by bitsandbytes (it replaces ``nn.Linear`` layers only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract.document import Document

_LORA_CHILD = re.compile(r"\.(lora_[A-Za-z_]+|base_layer|lora_dropout)(\.|$)")
_INDEX = re.compile(r"\.\d+(?=\.|$)")
_PREFIX = "base_model.model."


@dataclass
class Coverage:
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "0 %"


def _pattern(name: str) -> str:
    return _INDEX.sub(".*", name.removeprefix(_PREFIX))


def _numel(p: Any) -> int:
    n = 1
    for d in p.shape:
        n *= int(d)
    return n


def language_prefixes(root: Any) -> tuple[list[str], list[str]]:
    """(names of the modules that make up the language model, names of the top-level modules outside it): the
    decoder (``get_decoder()``) and the output embeddings are the language model; in a vision-language model the
    rest of the top-level modules (vision encoder, projector) are outside it."""
    get = getattr(root, "get_decoder", None)
    decoder = get() if get is not None else None
    if decoder is None:
        return [], []
    by_id = {id(m): n for n, m in root.named_modules()}
    lang = [by_id.get(id(decoder), "")]
    out_emb = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    if out_emb is not None and id(out_emb) in by_id:
        lang.append(by_id[id(out_emb)])
    in_emb = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    if in_emb is not None and id(in_emb) in by_id:
        lang.append(by_id[id(in_emb)])
    others: list[str] = []

    def walk(module: Any, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if any(full == p for p in lang):
                continue
            if any(p.startswith(full + ".") for p in lang if p):  # a container of the language model: descend
                walk(child, full)
            elif any(True for _ in child.parameters()):
                others.append(full)

    walk(root, "")
    return lang, others


def _exclude_regex(others: list[str]) -> str:
    names = "|".join(re.escape(o) for o in others)
    return f"({names})(\\..*)?" if len(others) > 1 else f"{re.escape(others[0])}(\\..*)?"


def coverage(
    doc: Document, peft_model: Any, breakdown: list[Any], quantized_ids: set[int], quant: str | None
) -> Coverage:
    """The coverage figures and notes of one injected model (see the module docstring)."""
    import torch

    out = Coverage()
    root = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    params = dict(root.named_parameters())
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    frozen_total = sum(_numel(p) for p in frozen.values())
    adapter_total = sum(_numel(p) for p in trainable.values())
    targets = doc.get("method", "target_modules").value if doc.get("method", "target_modules").known else None
    all_linear = isinstance(targets, str) and targets.strip().lower() == "all-linear"

    # -- vision tower ------------------------------------------------------------------------------------------------
    _lang, others = language_prefixes(root)
    if others:

        def outside(name: str) -> bool:
            return any(name == o or name.startswith(o + ".") for o in others)

        v_frozen = sum(_numel(p) for n, p in frozen.items() if outside(n))
        v_adapter = sum(_numel(p) for n, p in trainable.items() if outside(n))
        v_quant = [p for n, p in frozen.items() if outside(n) and id(p) in quantized_ids]
        regex = _exclude_regex(others)
        out.figures["vision"] = {
            "modules": others,
            "frozen_parameters": v_frozen,
            "frozen_share": round(v_frozen / frozen_total, 4) if frozen_total else 0.0,
            "adapter_parameters": v_adapter,
            "adapter_share": round(v_adapter / adapter_total, 4) if adapter_total else 0.0,
            "quantized_weights": len(v_quant),
            "quantized_parameters": sum(_numel(p) for p in v_quant),
            "exclude_regex": regex,
        }
        text = (
            f"vision tower: {', '.join(others)} hold {v_frozen:,} of the {frozen_total:,} frozen parameters "
            f"({_pct(v_frozen, frozen_total)}) and get {v_adapter:,} of the {adapter_total:,} adapter parameters "
            f"({_pct(v_adapter, adapter_total)})"
        )
        if quant:
            text += f"; {len(v_quant)} of their weights ({sum(_numel(p) for p in v_quant):,} parameters) are quantized"
        if v_adapter:
            text += f" (hint: to adapt only the language model, set method.exclude_modules: '{regex}')"
        text += (
            "; the batch is text only: image tokens/patches and the vision tower's activations are not in the estimate"
        )
        out.notes.append(text)

    # -- experts and routers wrapped by PEFT (lora.ParamWrapper) -----------------------------------------------------
    rank = doc.get("method", "rank").integer()
    wrapped = [r for r in breakdown if r.kind == "lora-parameter"]
    experts = [r for r in wrapped if len(r.shape) == 3]
    routers = [r for r in wrapped if len(r.shape) == 2]
    user_params = doc.get("method", "target_parameters").known
    if experts:
        n = sum(r.parameters for r in experts)
        ranks = sorted({r.rank for r in experts if r.rank is not None})
        out.figures["experts_wrapped"] = {"tensors": sum(r.count for r in experts), "adapter_parameters": n}
        why = (
            "PEFT turned the expert names of target_modules into target_parameters on the fused expert tensors "
            "(its transformers-v5 MoE conversion)"
            if not user_params
            else "method.target_parameters names them"
        )
        text = (
            f"expert parameters wrapped: {sum(r.count for r in experts)} 3-D expert tensors get adapters "
            f"(lora.ParamWrapper, {n:,} adapter parameters, {_pct(n, adapter_total)} of the adapter): {why}"
        )
        if rank and any(r != rank for r in ranks):
            text += f"; ranks {ranks} (PEFT doubles r and alpha on a fused gate_up_proj)"
        text += (
            "; ParamWrapper allows no lora_dropout (hint: to leave the experts alone, list the attention modules in "
            "method.target_modules instead of all-linear)"
        )
        out.notes.append(text)
    if routers:
        n = sum(r.parameters for r in routers)
        out.figures["routers_adapted"] = {"tensors": sum(r.count for r in routers), "adapter_parameters": n}
        out.notes.append(
            f"router adapted: {', '.join(sorted({r.module for r in routers}))} ({sum(r.count for r in routers)} "
            f"router weights, {n:,} adapter parameters) get adapters from the same conversion of the name 'gate' "
            "(hint: routers are usually left frozen; name the modules you mean in method.target_modules)"
        )

    # -- Linear layers left without adapters under all-linear --------------------------------------------------------
    if all_linear:
        out_emb = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
        missed: dict[str, list[int]] = {}
        for name, m in root.named_modules():
            if type(m) is not torch.nn.Linear or m is out_emb or _LORA_CHILD.search(name):
                continue
            if (
                others
                and any(name == o or name.startswith(o + ".") for o in others)
                and doc.get("method", "exclude_modules").known
            ):
                continue  # excluded on purpose
            missed.setdefault(_pattern(name), []).append(_numel(m.weight))
        if missed:
            total = sum(sum(v) for v in missed.values())
            out.figures["linear_not_adapted"] = {k: {"count": len(v), "parameters": sum(v)} for k, v in missed.items()}
            names = ", ".join(f"{k} x{len(v)}" for k, v in sorted(missed.items()))
            why = (
                "PEFT moved their names (gate_proj/up_proj/down_proj) to the fused expert tensors of this MoE type "
                "(hint: PEFT 0.21 cannot target them by name here; check the adapters in method.x-breakdown)"
                if experts
                else "PEFT's all-linear did not reach them (hint: name them in method.target_modules)"
            )
            out.notes.append(f"Linear layers without adapters under all-linear: {names} ({total:,} parameters): {why}")

    # -- 3-D expert tensors without adapters; left unquantized by bitsandbytes -----------------------------------------
    wrapped_shapes = {tuple(r.shape) for r in experts}
    bare = {n: p for n, p in frozen.items() if p.dim() == 3 and tuple(p.shape) not in wrapped_shapes}
    if bare:
        n_bare = sum(_numel(p) for p in bare.values())
        pats = sorted({_pattern(n) for n in bare})
        out.figures["experts_not_adapted"] = {"tensors": len(bare), "parameters": n_bare}
        text = (
            f"3-D expert tensors without adapters: {len(bare)} tensors ({', '.join(pats)}; {n_bare:,} parameters, "
            f"{_pct(n_bare, frozen_total)} of the frozen base): all-linear adapts nn.Linear layers only"
        )
        targets_hint = sorted({".".join(p.split(".")[-3:]) for p in pats})
        text += f" (hint: method.target_parameters: {targets_hint} adapts them)"
        out.notes.append(text)
    unquantized = [p for p in frozen.values() if p.dim() == 3 and id(p) not in quantized_ids]
    if quant in ("bnb4", "int8") and unquantized:
        unq = sum(_numel(p) for p in unquantized)
        out.figures["experts_unquantized"] = {"tensors": len(unquantized), "parameters": unq}
        out.notes.append(
            f"experts not quantized: bitsandbytes leaves {len(unquantized)} 3-D expert tensors ({unq:,} parameters, "
            f"{_pct(unq, frozen_total)} of the frozen base) in the loaded dtype: it quantizes nn.Linear layers only"
        )
    return out


__all__ = ["Coverage", "coverage", "language_prefixes"]
