"""Read the exact tensors of a training configuration off a meta-device model (no weights, no memory).

``census`` builds the base model on the meta device, marks the weights transformers would quantize
(its own ``get_keys_to_not_convert`` + ``should_convert_module`` rules, plus ``skip_modules`` and
``_keep_in_fp32_modules``), applies ``prepare_model_for_kbit_training``'s fp32 upcast when declared,
injects the exact adapters with PEFT (on meta) and records every parameter and buffer: shape, dtype,
trainable or frozen, quantized or not. Imports torch & co. only inside functions.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import config, dtypes
from ledgerspec.contract.document import Document
from ledgerspec.derivations.stack import quant_storage
from ledgerspec.derivations.stack.bnb_storage import BNB4_BLOCKSIZE, QuantizedBytes, bnb4_bytes, int8_bytes
from ledgerspec.derivations.stack.build import (
    ModelSource,
    _err,
    build_meta_model,
    cast_module_dtypes,
    inject_adapters,
    torch_dtype,
)
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

#: a status callback: ``progress("reading the model config")``
Progress = Callable[[str], None]


@dataclass(frozen=True)
class QuantPlan:
    """How the frozen base is quantized (None kind: not quantized).

    ``kind``: ``bnb4`` | ``int8`` (bitsandbytes), ``gptq`` | ``awq`` | ``hqq`` | ``torchao_nf4`` (Linear weights of
    other libraries, :mod:`ledgerspec.derivations.stack.quant_storage`), ``mxfp4`` (gpt-oss expert tensors).
    """

    kind: str | None
    quant_type: str | None = None
    double_quant: bool = False
    storage_itemsize: int = 1
    storage_dtype: str = "uint8"
    blocksize: int = BNB4_BLOCKSIZE
    skip_modules: tuple[str, ...] = ()
    bits: int = 4
    desc_act: bool = False
    dequantized: bool = False  # mxfp4 experts dequantized to the loaded dtype at load
    scale_itemsize: int = 2  # scales/zeros of gptq, awq, hqq (the model dtype); torchao's original dtype
    origin: str = ""  # where group size/bits came from, for the method text

    def weight_bytes(self, shape: tuple[int, ...]) -> QuantizedBytes:
        numel = 1
        for d in shape:
            numel *= d
        if self.kind == "int8":
            return int8_bytes(shape[0], numel // shape[0])
        if self.kind == "gptq":
            return quant_storage.gptq_bytes(shape[1], shape[0], self.bits, self.blocksize, self.scale_itemsize)
        if self.kind == "awq":
            return quant_storage.awq_bytes(shape[1], shape[0], self.bits, self.blocksize, self.scale_itemsize)
        if self.kind == "hqq":
            return quant_storage.hqq_bytes(numel, self.bits, self.blocksize, self.scale_itemsize)
        if self.kind == "torchao_nf4":
            return quant_storage.torchao_nf4_bytes(numel, self.scale_itemsize)
        if self.kind == "mxfp4":  # transformers' GptOssExperts layout (E, in, out): 32-value blocks along ``in``
            return quant_storage.mxfp4_bytes(numel, numel // shape[1])
        return bnb4_bytes(numel, self.double_quant, self.storage_itemsize, self.blocksize)

    def describe(self, n: int, total: int) -> str:
        """The method text of the quantized bytes (``n`` tensors, ``total`` bytes)."""
        if self.kind == "gptq":
            return (
                f"{n} Linear weights of the decoder layers GPTQ {self.bits}-bit, group size {self.blocksize}"
                f"{', desc_act' if self.desc_act else ''}{self.origin}: int32 qweight + int32 qzeros + scales "
                f"({self.scale_itemsize} B) + int32 g_idx (AutoGPTQ/GPTQModel QuantLinear) = {total:,} B"
            )
        if self.kind == "awq":
            return (
                f"{n} Linear weights of the decoder layers AWQ {self.bits}-bit GEMM, group size {self.blocksize}"
                f"{self.origin}: int32 qweight + int32 qzeros + fp16 scales (AutoAWQ WQLinear_GEMM) = {total:,} B"
            )
        if self.kind == "mxfp4":
            return (
                f"{n} expert tensors MXFP4 as transformers loads them for the triton kernels: packed FP4 codes "
                f"(2 a byte) + one E8M0 scale byte per 32 values = {total:,} B (fp32 expert biases counted below; "
                "swizzle padding of the scales not modelled)"
            )
        if self.kind == "hqq":
            return (
                f"{n} Linear weights HQQ {self.bits}-bit, group size {self.blocksize}: packed codes + scale and "
                f"zero per group ({self.scale_itemsize} B each; documented layout, unverified) = {total:,} B"
            )
        if self.kind == "torchao_nf4":
            return (
                f"{n} Linear weights torchao NF4Tensor (block 64, scaler block 256): packed codes + int8 scalers + "
                f"factors + lookup table (documented layout, unverified) = {total:,} B"
            )
        return ""


@dataclass(frozen=True)
class TensorRecord:
    """One unique tensor of the training stack."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # canonical torch dtype name, e.g. "bfloat16"
    itemsize: int
    trainable: bool
    buffer: bool = False
    quantized: bool = False
    persistent: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class BreakdownRow:
    """Where a group of adapter tensors went: one row per module pattern, kind, shape and rank."""

    module: str
    kind: str
    count: int
    shape: tuple[int, ...]
    rank: int | None
    parameters: int

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"module": self.module, "kind": self.kind, "count": self.count, "shape": list(self.shape)}
        if self.rank is not None:
            row["rank"] = self.rank
        row["parameters"] = self.parameters
        return row


@dataclass
class Census:
    """The tensors of one configuration, read off the instantiated (meta) model."""

    architecture: str
    total_parameters: int
    tensors: list[TensorRecord]
    breakdown: list[BreakdownRow]
    quant: QuantPlan
    prepare_for_kbit: bool
    adapter_dtype: str
    timings: dict[str, float] = field(default_factory=dict)
    biases_in_compute_dtype: int = 0  # biases of 4-bit layers, cast to compute_dtype by their first forward
    #: what the adapters and the quantization cover, with figures (:mod:`ledgerspec.derivations.stack.coverage`)
    coverage: dict[str, Any] = field(default_factory=dict)
    #: findings for the user, each with its figures and a hint
    notes: list[str] = field(default_factory=list)
    #: bnb4: transformers < 5's 4-bit per-expert size minus the fused experts' size here (``stack.versions``)
    fused_experts: int = 0
    #: the MoE family whose transformers-4 layout was built for a declared transformers < 5 (``stack.legacy_moe``)
    legacy_moe: str | None = None
    #: ``method.kind: full``: no adapters; every parameter is trainable
    full: bool = False

    @property
    def trainable(self) -> list[TensorRecord]:
        return [t for t in self.tensors if t.trainable]

    @property
    def frozen(self) -> list[TensorRecord]:
        return [t for t in self.tensors if not t.trainable]


def quant_plan(doc: Document, source: ModelSource | None = None) -> QuantPlan:
    """The storage layout of the frozen base, from the one reading of the configuration
    (:func:`ledgerspec.contract.config.read`); a layout that cannot be sized is a one-line error."""
    q = config.read(doc).quantization
    if not q.quantized:
        return QuantPlan(None)
    path = config.QUANT
    if q.scheme == "int8":
        return QuantPlan("int8", "int8", skip_modules=q.skip_modules or ())
    if q.scheme in config.OTHER_SCHEMES:
        return _other_plan(doc, q, source)
    if q.scheme != "bnb4":
        raise _err(
            doc,
            (*path, "type") if doc.get(*path, "type").present else ("method", "kind"),
            f"QLoRA needs base_model.quantization.type (nf4, fp4, int8, {', '.join(config.OTHER_SCHEMES)}), "
            f"got {q.type or 'nothing'!r}",
            "a 4-bit base is not sized by its bit count alone: give the quantization type",
        )
    if q.double_quant is None:
        raise _err(
            doc,
            (*path, "double_quant") if doc.get(*path, "double_quant").present else path,
            "base_model.quantization.double_quant is needed (true or false) to size a 4-bit base",
        )
    storage = q.storage_dtype or config.DEFAULT_STORAGE
    size = dtypes.itemsize(storage)
    if size is None:
        raise _err(
            doc,
            (*path, "storage_dtype"),
            f"unknown storage dtype {storage!r}",
            "use uint8 (the bitsandbytes default), bfloat16, float16 or float32",
        )
    return QuantPlan(
        "bnb4",
        q.type,
        q.double_quant,
        size,
        dtypes.canonical(storage) or storage,
        q.blocksize or BNB4_BLOCKSIZE,
        q.skip_modules or (),
    )


#: defaults of the other libraries when neither the ledger nor the model config's ``quantization_config`` says
_GROUP_DEFAULTS = {"gptq": 128, "awq": 128, "hqq": 64, "torchao_nf4": 64}


def _other_plan(doc: Document, q: config.Quantization, source: ModelSource | None) -> QuantPlan:
    """The plan of a base quantized by another library: bits and group size from the ledger, else from the model
    config's ``quantization_config`` (``bits``, ``group_size``, ``desc_act``, as GPTQ/AWQ checkpoints publish them)."""
    published: dict[str, Any] = {}
    qc = getattr(source.config, "quantization_config", None) if source is not None else None
    if isinstance(qc, dict):
        published = qc
    elif qc is not None and hasattr(qc, "to_dict"):
        published = qc.to_dict()
    scheme = q.scheme or ""
    origin: list[str] = []

    def declared_or_published(value: Any, key: str, kind: type, label: str) -> Any:
        if value is None and isinstance(published.get(key), kind):
            origin.append(label)
            return published[key]
        return value

    bits = declared_or_published(q.bits, "bits", int, "bits")
    group = declared_or_published(q.blocksize, "group_size", int, "group size")
    desc = declared_or_published(q.desc_act, "desc_act", bool, "desc_act")
    loaded = dtypes.itemsize(config.read(doc).loaded_dtype or "float16") or 2
    return QuantPlan(
        scheme,
        scheme,
        blocksize=group if group is not None else _GROUP_DEFAULTS.get(scheme, 0),
        skip_modules=q.skip_modules or (),
        bits=bits or 4,
        desc_act=bool(desc),
        dequantized=bool(q.dequantized),
        scale_itemsize=2 if scheme == "awq" else min(loaded, 4),
        origin=f" ({', '.join(origin)} from the model config's quantization_config)" if origin else "",
    )


def _quantized_tensors(model: Any, plan: QuantPlan) -> list[Any]:
    """The parameters the plan quantizes, as transformers' quantizer for that library replaces them."""
    if plan.kind in ("bnb4", "int8", "hqq", "torchao_nf4"):
        return [model.get_submodule(n).weight for n in _modules_to_quantize(model, plan)]
    if plan.kind in ("gptq", "awq"):  # the Linear layers of the decoder blocks (optimum's block_name_to_quantize)
        import torch

        from ledgerspec.derivations.stack.build import decoder_layers
        from ledgerspec.derivations.stack.legacy_moe import routers

        found = decoder_layers(model)
        if found is None:
            return []
        skip = plan.skip_modules
        dense = routers(model)  # a declared transformers 4's MoE routers stay float16 (GPTQModel's layer_modules)
        return [
            m.weight
            for n, m in found[1].named_modules()
            if type(m) is torch.nn.Linear and id(m) not in dense and not any(s and s in n for s in skip)
        ]
    if plan.kind == "mxfp4" and not plan.dequantized:  # transformers' replace_with_mxfp4_linear: GptOssMLP experts
        out = []
        for _name, m in model.named_modules():
            if type(m).__name__ == "GptOssExperts":
                out += [m.gate_up_proj, m.down_proj]
        return out
    return []


def _modules_to_quantize(model: Any, plan: QuantPlan) -> list[str]:
    """Names of the ``nn.Linear`` modules transformers replaces with bitsandbytes layers."""
    import torch
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = list(plan.skip_modules) if plan.skip_modules else get_keys_to_not_convert(model)
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    try:  # transformers.pytorch_utils.Conv1D (GPT-2 style) is converted as well
        from transformers.pytorch_utils import Conv1D

        linear_types: tuple[type, ...] = (Conv1D,)
    except ImportError:  # pragma: no cover
        linear_types = ()
    names = []
    for name, module in model.named_modules():
        if not name or not should_convert_module(name, skip):
            continue
        if type(module) is torch.nn.Linear or isinstance(module, linear_types):
            names.append(name)
    return names


def census(
    doc: Document, source: ModelSource, progress: Progress | None = None, trust_remote_code: bool = False
) -> Census:
    """Build, quantize (by the rules), upcast, inject on meta, and record every tensor."""
    import torch

    timings: dict[str, float] = {}
    say = progress or (lambda _msg: None)
    full = config.read(doc).full
    plan = quant_plan(doc, source)
    if full and plan.kind:
        raise full_of_quantized(doc)
    loaded = torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    t = time.perf_counter()
    say("building the model on the meta device")
    model = build_meta_model(doc, source, dtype=loaded, trust_remote_code=trust_remote_code)
    timings["build"] = time.perf_counter() - t

    t = time.perf_counter()
    total = sum(p.numel() for p in model.parameters())
    quantized_ids: set[int] = set()
    biases = []
    if plan.kind in ("bnb4", "int8"):
        for name in _modules_to_quantize(model, plan):
            module = model.get_submodule(name)
            quantized_ids.add(id(module.weight))
            if module.bias is not None:
                biases.append(module.bias)
    elif plan.kind:
        quantized_ids.update(id(p) for p in _quantized_tensors(model, plan))
        if plan.kind == "mxfp4" and not plan.dequantized:  # Mxfp4GptOssExperts holds its biases in fp32
            for m in model.modules():
                if type(m).__name__ == "GptOssExperts":
                    for b in (m.gate_up_proj_bias, m.down_proj_bias):
                        b.data = b.data.to(torch.float32)
    # PEFT's prepare_model_for_kbit_training upcasts nothing on a model marked quantization_method "gptq" (as GPTQ
    # loaders mark it; peft/tuners/../utils/other.py, `is_gptq_quantized`, lines 184 and 197-209 at 0.21.2)
    prepare = config.read(doc).prepare_kbit and not full and plan.kind != "gptq"
    if full:  # full fine-tuning: no adapters, every floating parameter trainable (the model's own weights)
        return _full_census(doc, source, model, total, loaded, timings, t)
    if prepare:  # peft.prepare_model_for_kbit_training: fp16/bf16 params that are not 4-bit go to fp32
        for p in model.parameters():
            if p.dtype in (torch.float16, torch.bfloat16) and id(p) not in quantized_ids:
                p.data = p.data.to(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    timings["quantize_rules"] = time.perf_counter() - t

    t = time.perf_counter()
    say("injecting adapters with PEFT")
    peft_model = inject_adapters(doc, model, on_meta=True)
    adapter_dtype_name, adapter_dtype = lora_dtype(doc)
    adapter_ids = _cast_adapters(peft_model, adapter_dtype)
    cast_module_dtypes(peft_model, config.read(doc).module_dtypes, skip=quantized_ids)
    if plan.kind == "bnb4":  # bnb Linear4bit.forward casts its bias to compute_dtype for good on the 1st call
        compute = torch_dtype(doc, ("base_model", "quantization", "compute_dtype"), "float32")
        for b in biases:
            b.data = b.data.to(compute)
    timings["inject"] = time.perf_counter() - t

    t = time.perf_counter()
    tensors = _records(peft_model, quantized_ids)
    breakdown = _breakdown(peft_model, adapter_ids)
    from ledgerspec.derivations.stack.coverage import coverage

    cover = coverage(doc, peft_model, breakdown, quantized_ids, plan.kind)
    timings["count"] = time.perf_counter() - t
    fused = 0
    if plan.kind == "bnb4":
        from ledgerspec.derivations.stack.versions import fused_experts_4bit_change

        fused = fused_experts_4bit_change(peft_model, plan.double_quant, plan.storage_itemsize)
    arch = type(model).__name__
    return Census(
        arch,
        total,
        tensors,
        breakdown,
        plan,
        prepare,
        dtypes.canonical(adapter_dtype_name) or adapter_dtype_name,
        timings,
        biases_in_compute_dtype=len(biases) if plan.kind == "bnb4" else 0,
        coverage=cover.figures,
        notes=[*source.notes, *cover.notes],
        fused_experts=fused,
        legacy_moe=_legacy_moe(model),
    )


def _legacy_moe(model: Any) -> str | None:
    from ledgerspec.derivations.stack.legacy_moe import MARK

    return getattr(model, MARK, None)


def full_of_quantized(doc: Document) -> Exception:
    """Full fine-tuning of a quantized base: one line at ``method.kind`` (rule LS032 says the same)."""
    return _err(
        doc,
        ("method", "kind"),
        "method.kind full trains every weight, but the base is quantized: quantized weights cannot be trained",
        "load the base unquantized (base_model.quantized: false) for full fine-tuning, or choose QLoRA",
    )


def _full_census(
    doc: Document, source: ModelSource, model: Any, total: int, loaded: Any, timings: dict[str, float], t: float
) -> Census:
    """The census of full fine-tuning: the model as transformers builds it, every floating parameter trainable
    (what ``Trainer`` optimizes when no adapter is injected: ``requires_grad`` is true after ``from_pretrained``)."""
    for p in model.parameters():
        p.requires_grad_(p.is_floating_point())
    cast_module_dtypes(model, config.read(doc).module_dtypes)  # frozen tensors only: none but buffers here
    timings["quantize_rules"] = time.perf_counter() - t
    t = time.perf_counter()
    tensors = _records(model, set())
    breakdown = _breakdown(model, set(), full=True)
    timings["count"] = time.perf_counter() - t
    trainable_dtypes = sorted({r.dtype for r in tensors if r.trainable})
    dtype = trainable_dtypes[0] if len(trainable_dtypes) == 1 else "mixed"
    return Census(
        type(model).__name__,
        total,
        tensors,
        breakdown,
        QuantPlan(None),
        False,
        dtype if trainable_dtypes else _dtype_name(loaded),
        timings,
        notes=list(source.notes),
        full=True,
    )


def lora_dtype(doc: Document) -> tuple[str, Any]:
    """The dtype of the LoRA tensors: ``adapter.dtype``, or ``adapter.x-lora-dtype`` when that says ``mixed``
    (fp32 LoRA plus a bf16 ``modules_to_save`` copy, say). Default float32: PEFT's autocast."""
    path: tuple[str, ...] = ("adapter", "dtype")
    if (doc.get(*path).text() or "").strip().lower() == "mixed":
        path = ("adapter", "x-lora-dtype")
    name = doc.get(*path).text() or "float32"
    return name, torch_dtype(doc, path, "float32")


_ADAPTER_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def _cast_adapters(model: Any, dtype: Any) -> set[int]:
    """Give LoRA tensors their real dtype (PEFT's ``autocast_adapter_dtype`` keeps them fp32 by default)."""
    quiet_bitsandbytes()
    from peft.tuners.lora import LoraLayer

    ids: set[int] = set()
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for attr in _ADAPTER_DICTS:
            holder = getattr(module, attr, None)
            if holder is None:
                continue
            for p in holder.parameters():
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
                ids.add(id(p))
    return ids


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _records(model: Any, quantized_ids: set[int]) -> list[TensorRecord]:
    out: list[TensorRecord] = []
    for name, p in model.named_parameters():
        out.append(
            TensorRecord(
                name,
                tuple(p.shape),
                _dtype_name(p.dtype),
                p.element_size(),
                p.requires_grad,
                quantized=id(p) in quantized_ids,
            )
        )
    for module_name, module in model.named_modules():
        for bname, b in module.named_buffers(recurse=False):
            if b is None:
                continue
            out.append(
                TensorRecord(
                    f"{module_name}.{bname}" if module_name else bname,
                    tuple(b.shape),
                    _dtype_name(b.dtype),
                    b.element_size(),
                    False,
                    buffer=True,
                    persistent=bname not in module._non_persistent_buffers_set,
                )
            )
    seen: set[str] = set()
    unique = []
    for r in out:  # named_parameters already drops tied duplicates; buffers may repeat across modules
        if r.name not in seen:
            seen.add(r.name)
            unique.append(r)
    return unique


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
_PREFIX = "base_model.model."


def _pattern(name: str) -> str:
    return _LAYER_INDEX.sub(".*", name.removeprefix(_PREFIX))


def _breakdown(model: Any, adapter_ids: set[int], full: bool = False) -> list[BreakdownRow]:
    """Group the trainable tensors by owning module pattern, kind, base shape and rank (``full``: the model's own
    weights, kind ``weight``)."""
    quiet_bitsandbytes()
    from peft.tuners.lora import LoraLayer

    groups: dict[tuple[str, str, tuple[int, ...], int | None], list[int]] = {}
    counted: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            own = [
                p
                for attr in _ADAPTER_DICTS
                if getattr(module, attr, None) is not None
                for p in getattr(module, attr).parameters()
            ]
            own = [p for p in own if p.requires_grad and id(p) not in counted]
            if not own:
                continue
            counted.update(id(p) for p in own)
            param_name = getattr(module, "parameter_name", None)
            base = module.get_base_layer()
            if param_name:
                shape = tuple(getattr(base, param_name).shape)
                kind = "lora-parameter"
            else:
                weight = getattr(base, "weight", None)
                shape = tuple(weight.shape) if weight is not None else ()
                kind = "dora" if any(getattr(module, "use_dora", {}).values()) else "lora"
            rank = next(iter(module.r.values()), None) if getattr(module, "r", None) else None
            key = (_pattern(name), kind, shape, rank)
            groups.setdefault(key, []).append(sum(p.numel() for p in own))
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in counted:
            continue
        counted.add(id(p))
        if ".modules_to_save." in name:
            owner = name.split(".modules_to_save.")[0]
            kind = "modules_to_save"
        elif name.endswith(".bias"):
            owner = name.removesuffix(".bias").replace(".base_layer", "")
            kind = "bias"
        else:
            owner = name.rsplit(".", 1)[0]
            kind = "weight" if full else "other"
        key = (_pattern(owner), kind, tuple(p.shape), None)
        groups.setdefault(key, []).append(p.numel())
    return [BreakdownRow(k[0], k[1], len(v), k[2], k[3], sum(v)) for k, v in groups.items()]


__all__ = ["BreakdownRow", "Census", "QuantPlan", "TensorRecord", "census", "quant_plan"]
