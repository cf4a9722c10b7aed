"""From a built model to FSDP2 units and parameter descriptors (the torch side of :mod:`.state`), and the adapters
in their declared dtype before any wrapper (FSDP2, FSDP1, DeepSpeed) meets them (:func:`adapters_in_declared_dtype`).

The units are the ones a ``fully_shard`` per decoder layer + root wrap gives: every module whose class is in
the model's ``_no_split_modules`` (transformers' decoder-layer classes, what accelerate's FSDP auto-wrap
uses) is one unit; every other parameter belongs to the root unit. Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.shard.state import ROOT, ParamDesc, packed_4bit_shape
from ledgerspec.derivations.stack import quant_storage


def _no_split_classes(model: Any) -> set[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = getattr(base, "_no_split_modules", None) or []
    return {str(n) for n in names}


def decoder_layers(model: Any) -> list[Any]:
    """The modules that get their own ``fully_shard``: outermost instances of the no-split classes."""
    import torch.nn as nn

    classes = _no_split_classes(model)
    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, module))
    if not found:  # no declared layer classes: the longest ModuleList (the decoder stack)
        sizes: list[tuple[int, Any]] = [(len(m), m) for m in model.modules() if isinstance(m, nn.ModuleList)]
        if sizes:
            return list(max(sizes, key=lambda s: s[0])[1])
    return [m for _, m in found]


def unit_names(model: Any) -> list[str]:
    layers = {id(m) for m in decoder_layers(model)}
    return [name for name, m in model.named_modules() if id(m) in layers]


def descriptors(model: Any) -> list[ParamDesc]:
    """One :class:`ParamDesc` per distinct parameter and buffer of ``model`` (tied weights once)."""
    units = unit_names(model)
    out: list[ParamDesc] = []

    def unit_of(name: str) -> str:
        for u in units:
            if name.startswith(u + "."):
                return u
        return ROOT

    for name, p in model.named_parameters():
        out.append(
            ParamDesc(
                name,
                tuple(int(d) for d in p.shape),
                str(p.dtype).removeprefix("torch."),
                bool(p.requires_grad),
                unit_of(name),
            )
        )
    for name, b in model.named_buffers():
        out.append(
            ParamDesc(
                name,
                tuple(int(d) for d in b.shape),
                str(b.dtype).removeprefix("torch."),
                False,
                unit_of(name),
                kind="buffer",
            )
        )
    return out


def adapters_in_declared_dtype(model: Any, adapter_dtype: str | None) -> int:
    """Cast every trainable meta parameter to ``adapter.dtype`` BEFORE ``fully_shard``; returns how many changed.

    A user's run casts the adapter (``model.to(bf16)``, PEFT's ``autocast_adapter_dtype=False``, ...) before
    accelerate or the user wraps the model, so ``fully_shard`` meets parameters already in their training dtype.
    FSDP2 records that dtype when it shards (``FSDPParam.init_dtype_attrs``: ``self.orig_dtype =
    self.sharded_param.dtype``, torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_param.py``), all-gathers and
    reduce-scatters in it (no ``MixedPrecisionPolicy``: ``param_dtype`` and ``reduce_dtype`` stay None), and AdamW
    creates its state with ``torch.zeros_like(p)`` on the sharded parameter (``optim/adam.py``, ``_init_group``), so
    the state follows the parameter's dtype: bf16 adapters have bf16 gradients and bf16 ``exp_avg``/``exp_avg_sq``.

    Casting after ``fully_shard`` (``p.data = p.data.to(bf16)`` on the sharded DTensor, what the single-device
    workload does at injection) leaves FSDP2's padded shard storage and recorded dtype at float32: the gradient
    then arrives in one dtype and AdamW's state in another, a step no real run takes (the meta kernel of
    ``aten.lerp_`` refused it: issue 16).
    """
    import torch

    if adapter_dtype is None:  # PEFT's default: float32 adapters, as PEFT built them
        return 0
    target = getattr(torch, adapter_dtype)
    changed = 0
    for p in model.parameters():
        if p.requires_grad and p.is_meta and p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)
            changed += 1
    return changed


_PEFT_PREFIX = "base_model.model."


def document_descriptors(doc: Document, offline: bool = True, trust_remote_code: bool = False) -> list[ParamDesc]:
    """The descriptors of the document's training stack, from the resolver's census (meta device, no memory).

    4-bit weights become their packed storage (``(n + 1) // (2 * s)`` x 1 in the ``bnb_4bit_quant_storage``
    dtype), which FSDP2 shards like any parameter; their quantization constants (absmax, code, nested
    state) are not parameters and stay whole on every rank, so they are replicated descriptors.
    """
    from ledgerspec.derivations.stack import build
    from ledgerspec.derivations.stack.census import census

    source = build.load_config(doc, offline=offline, trust_remote_code=trust_remote_code)
    c = census(doc, source, trust_remote_code=trust_remote_code)
    base = build.build_meta_model(doc, source, trust_remote_code=trust_remote_code)
    prefix = "" if c.full else _PEFT_PREFIX  # full fine-tuning: the model's own names, no PEFT wrapper
    units = [prefix + u for u in unit_names(base)]

    def unit_of(name: str) -> str:
        for u in units:
            if name.startswith(u + "."):
                return u
        return ROOT

    out: list[ParamDesc] = []
    for r in c.tensors:
        unit = unit_of(r.name)
        if r.quantized and c.quant.kind == "bnb4":
            q = c.quant.weight_bytes(r.shape)
            out.append(
                ParamDesc(r.name, packed_4bit_shape(r.numel, c.quant.storage_dtype), c.quant.storage_dtype, False, unit)
            )
            out.append(ParamDesc(r.name + ".quant_state", (q.constants,), "uint8", False, unit, kind="buffer"))
        elif r.quantized and c.quant.kind == "gptq":
            out += _gptq_descriptors(r, c.quant, unit)
        elif r.quantized:
            raise ValueError(
                f"{r.name}: FSDP2 per-rank state is calculated for 4-bit (nf4/fp4) QLoRA, not {c.quant.kind}"
            )
        else:
            out.append(ParamDesc(r.name, r.shape, r.dtype, r.trainable, unit, kind="buffer" if r.buffer else "param"))
    return out


def _gptq_descriptors(r: Any, plan: Any, unit: str) -> list[ParamDesc]:
    """A GPTQ ``QuantLinear`` as fms-acceleration hands it to FSDP (:func:`ledgerspec.derivations.engine.gptq.
    as_fsdp_parameters`): ``qweight`` and ``qzeros`` frozen parameters, their int32 rows viewed in the float dtype of
    the scales (twice the columns for a 2-byte dtype); ``scales`` and ``g_idx`` buffers, whole on every rank."""
    out_features, in_features = r.shape
    q = quant_storage.gptq_bytes(in_features, out_features, plan.bits, plan.blocksize, plan.scale_itemsize)
    dtype = {2: "float16", 4: "float32"}.get(plan.scale_itemsize, "float16")
    groups = q.absmax // (out_features * plan.scale_itemsize)
    module = r.name.removesuffix(".weight")
    words = 4 // plan.scale_itemsize  # float elements per int32
    return [
        ParamDesc(f"{module}.qweight", (q.data // (4 * out_features), out_features * words), dtype, False, unit),
        ParamDesc(f"{module}.qzeros", (groups, q.code // (4 * groups) * words), dtype, False, unit),
        ParamDesc(f"{module}.scales", (groups, out_features), dtype, False, unit, kind="buffer"),
        ParamDesc(f"{module}.g_idx", (q.offset,), "uint8", False, unit, kind="buffer"),  # int32 (in,), as bytes
    ]
