"""``resolve``: fill every figure that follows from the exact configuration, and write it back.

The figures come from the instantiated stack (see :mod:`ledgerspec.derivations.stack.census`): counts are
VERIFIED (read off the model PEFT produced), bytes CALCULATED from those tensors with the exact storage
rules of :mod:`~ledgerspec.derivations.stack.bnb_storage` and :mod:`~ledgerspec.derivations.stack.optimizer_state`.
Activations and temporary memory are not calculated here (``ledgerspec estimate``, ``measure``).

Besides the figures, resolve writes a few plain values (``identity.architecture``, ``gradients.dtype``,
``optimizer.state_format``, ``bits``, ``paged``). It records each one it wrote, as written, in the top-level
``x-resolve.written``; on the next run a value still equal to its record is resolve's own and is refreshed (or
removed when the configuration no longer has it), while any other value is the user's and is kept
(:mod:`ledgerspec.derivations.resolve.record`). ``x-resolve.inputs`` fingerprints the input fields resolve read
(:mod:`ledgerspec.contract.fingerprint`), so ``validate`` notices an input edited after resolve ran (LS006).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import Change, set_extension, set_figure, set_plain
from ledgerspec.contract.edit import to_ledger as to_ledger_header
from ledgerspec.contract.optimizers import suggest
from ledgerspec.contract.subtotal import write_subtotal
from ledgerspec.contract.writer import document_text
from ledgerspec.derivations.resolve.record import Record
from ledgerspec.derivations.stack.build import _err
from ledgerspec.derivations.stack.census import Census, Progress, TensorRecord, census
from ledgerspec.derivations.stack.optimizer_state import (
    DEFAULT_MIN_8BIT_SIZE,
    OPTIMIZERS,
    OptimizerSpec,
    OptimizerState,
    TensorShape,
    optimizer_spec,
    state_bytes,
)
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes
from ledgerspec.derivations.stack.versions import installed_stack


@dataclass
class Figures:
    """The derived numbers of one configuration (before they are written anywhere)."""

    total_parameters: int
    trainable_parameters: int
    adapter_bytes: int
    gradient_bytes: int
    gradient_dtype: str
    frozen_base_bytes: int
    frozen_quantized_bytes: int
    frozen_buffer_bytes: int
    optimizer: OptimizerState | None
    optimizer_spec: OptimizerSpec | None


@dataclass
class ResolveResult:
    """What ``resolve`` did: the updated document, the changes and where time went."""

    doc: Document
    original: str  # the document's text as read, before resolve
    changes: list[Change]
    figures: Figures
    census: Census
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """What the user should know about the figures (model class, coverage of adapters and quantization, the
        declared stack's known differences)."""
        from ledgerspec.contract.config import read
        from ledgerspec.contract.differences import stack_differences

        found = stack_differences(self.doc, read(self.doc).accepted_differences)
        return [*self.census.notes, *(f"declared stack: {d.message()}" for d in found if d.record == "x-resolve")]

    @property
    def text(self) -> str:
        """The document's new text (where it is; ``-o OUT`` elsewhere: :func:`ledgerspec.contract.writer.render_to`)."""
        return document_text(self.doc)

    @property
    def changed(self) -> bool:
        return self.text != self.original

    @property
    def applied(self) -> list[Change]:
        return [c for c in self.changes if c.skipped is None]

    @property
    def skipped(self) -> list[Change]:
        return [c for c in self.changes if c.skipped is not None]


def optimizer_of(doc: Document) -> tuple[OptimizerSpec | None, int]:
    """The optimizer of ``optimizer.name`` (None when not given) and its ``min_8bit_size``.

    An unknown name is an error at ``optimizer.name`` listing the supported names.
    """
    name = doc.get("optimizer", "name").text()
    min8 = doc.get("optimizer", "min_8bit_size").integer()
    if not name:
        return None, DEFAULT_MIN_8BIT_SIZE
    spec = optimizer_spec(name)
    if spec is None:
        guess = suggest(name)
        raise _err(
            doc,
            ("optimizer", "name"),
            f"unknown optimizer {name!r}" + (f"; did you mean {guess!r}?" if guess else ""),
            "supported: " + ", ".join(sorted(OPTIMIZERS)),
        )
    return spec, DEFAULT_MIN_8BIT_SIZE if min8 is None else min8


def compute_figures(c: Census, spec: OptimizerSpec | None, min_8bit_size: int) -> Figures:
    """All resolver figures from the census of the instantiated stack."""
    trainable = c.trainable
    frozen = c.frozen
    quantized = [t for t in frozen if t.quantized]
    q_bytes = sum(c.quant.weight_bytes(t.shape).total for t in quantized)
    buffer_bytes = sum(t.nbytes for t in frozen if t.buffer)
    frozen_bytes = q_bytes + sum(t.nbytes for t in frozen if not t.quantized)
    adapter = sum(t.nbytes for t in trainable)
    grad_dtypes = sorted({t.dtype for t in trainable})
    opt = state_bytes(spec, [TensorShape(t.shape, t.itemsize) for t in trainable], min_8bit_size) if spec else None
    return Figures(
        total_parameters=c.total_parameters,
        trainable_parameters=sum(t.numel for t in trainable),
        adapter_bytes=adapter,
        gradient_bytes=adapter,
        gradient_dtype=grad_dtypes[0] if len(grad_dtypes) == 1 else ("mixed" if grad_dtypes else "none"),
        frozen_base_bytes=frozen_bytes,
        frozen_quantized_bytes=q_bytes,
        frozen_buffer_bytes=buffer_bytes,
        optimizer=opt,
        optimizer_spec=spec,
    )


def _dtype_mix(tensors: list[TensorRecord]) -> str:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    return ", ".join(f"{n:,} {d}" for d, n in sorted(counts.items()))


def _methods(c: Census, f: Figures) -> dict[str, str]:
    trainable = c.trainable
    frozen = c.frozen
    m: dict[str, str] = {
        "total": f"sum of numel over the unique parameters of {c.architecture} built on the meta device "
        "(logical count; tied weights once)",
        "trainable": "requires_grad tensors after PEFT injection on the meta device "
        f"({len(trainable)} tensors; see method.x-breakdown)",
        "gradients": "one gradient per trainable tensor (frozen base has none)",
        "optimized": "all trainable tensors go to the optimizer's param_groups (Trainer default)",
        "adapter": f"trainable tensors x their dtype size: {_dtype_mix(trainable)}",
        "ledger_gradients": "gradient dtype = parameter dtype: same bytes as the trainable tensors",
    }
    if c.full:
        m["trainable"] = (
            f"full fine-tuning: every floating parameter of {c.architecture} built on the meta device is trainable "
            f"({len(trainable)} tensors, no adapters; see method.x-breakdown)"
        )
        m["gradients"] = "one gradient per parameter (full fine-tuning: every parameter has one)"
        m["adapter"] = f"the trainable model weights (no adapters) x their dtype size: {_dtype_mix(trainable)}"
    parts = []
    if c.quant.kind in ("gptq", "awq", "mxfp4", "hqq", "torchao_nf4"):
        n_q = sum(1 for t in frozen if t.quantized)
        parts.append(c.quant.describe(n_q, f.frozen_quantized_bytes))
    if c.quant.kind == "bnb4":
        n_q = sum(1 for t in frozen if t.quantized)
        dq = "double quant" if c.quant.double_quant else "no double quant"
        parts.append(
            f"{n_q} Linear weights bitsandbytes {c.quant.quant_type} ({dq}, {c.quant.storage_dtype} "
            f"storage, blocksize {c.quant.blocksize}): packed data + absmax + code tables = "
            f"{f.frozen_quantized_bytes:,} B"
        )
    elif c.quant.kind == "int8":
        n_q = sum(1 for t in frozen if t.quantized)
        parts.append(f"{n_q} Linear weights LLM.int8: int8 data + fp32 row scales = {f.frozen_quantized_bytes:,} B")
    rest = [t for t in frozen if not t.quantized and not t.buffer]
    parts.append(
        f"unquantized frozen parameters {_dtype_mix(rest) or 'none'}"
        + (" (fp32 after prepare_model_for_kbit_training)" if c.prepare_for_kbit else "")
        + (
            f", {c.biases_in_compute_dtype} biases of 4-bit layers in compute_dtype (Linear4bit.forward "
            "casts them on the first call)"
            if c.biases_in_compute_dtype
            else ""
        )
    )
    buffers = [t for t in frozen if t.buffer]
    non_persistent = sum(1 for t in buffers if not t.persistent)
    parts.append(
        f"buffers {f.frozen_buffer_bytes:,} B ({len(buffers)} tensors, {non_persistent} non-persistent "
        "such as rotary inv_freq: resident on the device, so counted)"
    )
    m["frozen"] = "; ".join(parts)
    if f.optimizer is not None and f.optimizer_spec is not None:
        o = f.optimizer
        text = f"{f.optimizer_spec.name}: {f.optimizer_spec.describe()}, per trainable tensor"
        if f.optimizer_spec.family == "bnb":
            text += f" ({o.tensors_8bit} tensors 8-bit, {o.tensors_32bit} fp32)"
            if o.shared:
                text += f"; shared quantile maps {o.shared:,} B once"
        if o.paged:
            text += f"; {o.paged:,} B of it in unified memory (paged, evictable to host)"
        if o.host:
            text += f"; plus {o.host:,} B of step scalars on the host (not counted)"
        m["optimizer"] = text
    return m


def _separate_reference(doc: Document, c: Census) -> bool:
    """DPO/KTO with a separate reference model (``training.objective_settings.reference: model``): TRL 1.16's
    ``ref_model``, a second copy of the base beside the policy (dpo_trainer.py:908-990, kto_trainer.py:919-998)."""
    from ledgerspec.contract import config

    t = config.read(doc).training
    return not c.full and t.objective in ("dpo", "kto") and t.dpo_reference == "model"


def write_figures(doc: Document, c: Census, f: Figures, sha256: str | None) -> list[Change]:
    """Write the figures into ``doc`` (in memory), precedence and comments respected."""
    changes: list[Change | None] = []
    m = _methods(c, f)
    record = Record(doc)
    changes.append(record.set(("identity", "architecture"), c.architecture))
    if sha256:
        changes.append(set_plain(doc, ("identity", "config_sha256"), sha256))
    changes.append(set_figure(doc, ("identity", "total_parameters"), f.total_parameters, "VERIFIED", m["total"]))
    if not c.full and len({t.dtype for t in c.trainable}) > 1:  # e.g. fp32 LoRA + a bf16 modules_to_save copy
        changes.append(set_extension(doc, ("adapter", "x-lora-dtype"), c.adapter_dtype))
        if (doc.get("adapter", "dtype").text() or "").lower() != "mixed":
            changes.append(set_plain(doc, ("adapter", "dtype"), "mixed", force=True))
    changes.append(
        set_figure(doc, ("method", "trainable_parameters"), f.trainable_parameters, "VERIFIED", m["trainable"])
    )
    changes.append(set_extension(doc, ("method", "x-breakdown"), [r.as_dict() for r in c.breakdown]))
    if c.coverage or doc.get("method", "x-coverage").present:  # stack.coverage: vision tower, experts, routers
        changes.append(set_extension(doc, ("method", "x-coverage"), {**c.coverage, "notes": list(c.notes)}))
    changes.append(set_figure(doc, ("gradients", "parameters"), f.trainable_parameters, "VERIFIED", m["gradients"]))
    changes.append(record.set(("gradients", "dtype"), f.gradient_dtype))
    if f.optimizer is not None and f.optimizer_spec is not None:
        changes.append(
            set_figure(doc, ("optimizer", "optimized_parameters"), f.trainable_parameters, "VERIFIED", m["optimized"])
        )
        spec = f.optimizer_spec
        changes.append(record.set(("optimizer", "state_format"), spec.describe()))
        if spec.family == "bnb":
            changes.append(record.set(("optimizer", "bits"), spec.bits))
            changes.append(record.set(("optimizer", "paged"), spec.paged))
    frozen, frozen_method = f.frozen_base_bytes, m["frozen"]
    if _separate_reference(doc, c):
        frozen *= 2
        frozen_method = (
            f"2 x {f.frozen_base_bytes:,} B: the policy's frozen base and a separate reference model, a second copy of "
            "the base as declared without adapters (objective_settings.reference: model; TRL's ref_model, held for the "
            f"whole run); each: {frozen_method}"
        )
    changes.append(set_figure(doc, ("ledger", "frozen_base"), frozen, "CALCULATED", frozen_method))
    changes.append(set_figure(doc, ("ledger", "adapter"), f.adapter_bytes, "CALCULATED", m["adapter"]))
    changes.append(set_figure(doc, ("ledger", "gradients"), f.gradient_bytes, "CALCULATED", m["ledger_gradients"]))
    if f.optimizer is not None:
        changes.append(set_figure(doc, ("ledger", "optimizer"), f.optimizer.device, "CALCULATED", m["optimizer"]))
    changes.append(write_subtotal(doc))
    # last: x-resolve fingerprints the inputs as written (adapter.dtype: mixed included)
    changes += record.finish(installed_stack(), stack_differences_of(doc, c))
    return [ch for ch in changes if ch is not None]


def stack_differences_of(doc: Document, c: Census) -> dict[str, dict[str, Any]]:
    """The known stack differences that apply to these figures (:mod:`ledgerspec.contract.differences`)."""
    from ledgerspec.derivations.stack.versions import installed_side, record

    out: dict[str, dict[str, Any]] = {}
    if c.legacy_moe:  # the declared transformers 4's MoE layout was built (stack.legacy_moe)
        out["transformers-moe-fused-experts"] = record("older")
    elif c.fused_experts:
        key = "transformers-moe-fused-experts"
        side = installed_side(key)
        out[key] = record(side, c.fused_experts if side == "newer" else None)
    return out


def _import_stack(progress: Progress, without_bitsandbytes: bool = False) -> None:
    """Import what resolving needs. ``without_bitsandbytes``: hide bitsandbytes from PEFT's import.

    The resolver never calls bitsandbytes (its storage rules are arithmetic), but ``import peft`` imports
    it, and it pulls in torch._inductor: ~1.5 s of a ~5 s run. Hiding it (for the rest of the process: PEFT
    imports its bnb layers lazily) leaves PEFT without them, so only a one-shot CLI process may ask for it.
    """
    progress("importing torch, transformers, peft")
    if without_bitsandbytes and "bitsandbytes" not in sys.modules and "peft" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # find_spec() -> None: PEFT skips it
    from ledgerspec.derivations.stack.imports import import_stack

    import_stack()  # the command line's first import: the garbage collector paused meanwhile (stack.imports)
    quiet_bitsandbytes()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from peft import LoraConfig  # noqa: F401


def resolve(
    doc: Document,
    offline: bool = False,
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    to_ledger: bool | None = None,
    one_shot_process: bool = False,
) -> ResolveResult:
    """Fill every derivable figure of ``doc`` (in memory) and return the result with the new text.

    ``to_ledger``: turn an intake into a ``ledger/v1`` document (default: yes for an intake; the CLI
    requires ``-o`` for that). Nothing is written to disk here; see :func:`ledgerspec.contract.writer`.
    ``one_shot_process``: the process exits after this call (the CLI), so imports may be trimmed.
    """
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    if doc.kind not in ("intake", "ledger"):
        raise _err(doc, ("ledgerspec",), "not a ledgerspec document (expected `ledgerspec: ledger/v1` or `intake/v1`)")
    spec, min8 = optimizer_of(doc)
    start = time.perf_counter()
    _import_stack(say, without_bitsandbytes=one_shot_process)
    timings["imports"] = time.perf_counter() - start

    from ledgerspec.derivations.stack.build import load_config

    t = time.perf_counter()
    say("reading the model config")
    source = load_config(doc, offline=offline, trust_remote_code=trust_remote_code)  # checks the sha256 pin
    timings["config"] = time.perf_counter() - t

    c = census(doc, source, progress=say, trust_remote_code=trust_remote_code)
    timings.update(c.timings)
    t = time.perf_counter()
    figures = compute_figures(c, spec, min8)
    changes: list[Change] = []
    original = ("\ufeff" if doc.bom else "") + doc.text
    header = to_ledger_header(doc) if doc.kind == "intake" and to_ledger is not False else None
    if header is not None:
        changes.append(header)
    changes += write_figures(doc, c, figures, source.sha256)
    timings["write"] = time.perf_counter() - t
    return ResolveResult(doc, original, changes, figures, c, timings)


__all__ = [
    "Figures",
    "ResolveResult",
    "compute_figures",
    "optimizer_of",
    "resolve",
    "write_figures",
]
