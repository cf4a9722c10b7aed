"""The minimum intake (spec, "The status ladder"): the fields without which nothing can be sized.

Read by the status ladder (INSUFFICIENT DATA until they are all known) and by every command that simulates a
step, before it imports torch. Pure: no I/O.
"""

from __future__ import annotations

from ledgerspec.contract import config as C
from ledgerspec.contract.document import Document
from ledgerspec.contract.optimizers import OPTIMIZERS, suggest
from ledgerspec.contract.values import Value

#: the quantization fields a bitsandbytes 4-bit intake must give ("4-bit" alone does not determine the base)
QLORA_FIELDS = ("type", "double_quant", "compute_dtype", "storage_dtype")


def quantization_fields(q: C.Quantization) -> tuple[str, ...]:
    """The ``base_model.quantization`` fields the minimum intake asks of a quantized base (none of a base that is not
    quantized): a base another library quantized (GPTQ, AWQ, ...) or LLM.int8 has no double quantization, compute or
    storage dtype to declare, so its ``type`` is all (its bits and group size are read from the ledger, else from
    the checkpoint's ``quantization_config``); any other, bitsandbytes 4-bit or a type not declared, all of
    :data:`QLORA_FIELDS`. One answer for the status ladder and rule LS030."""
    if not q.quantized:
        return ()
    return ("type",) if q.scheme in ("int8", *C.OTHER_SCHEMES) else QLORA_FIELDS


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def state(v: Value) -> str:
    """How an unknown value is unknown: missing, UNKNOWN or CONFIGURATION-SPECIFIC."""
    if not v.present:
        return "missing"
    return v.source or "UNKNOWN"


def minimum_intake_gaps(doc: Document) -> list[str]:
    """The fields of the minimum intake that are missing, UNKNOWN or CONFIGURATION-SPECIFIC, one line each."""
    gaps: list[str] = []

    def need(*path: str) -> None:
        v = doc.get(*path)
        if v.unknown:
            gaps.append(f"{dotted(path)} is {state(v)}")

    def need_one(*paths: tuple[str, ...]) -> None:
        if all(doc.get(*p).unknown for p in paths):
            gaps.append(" or ".join(dotted(p) for p in paths) + " is " + state(doc.get(*paths[0])))

    need("identity", "model_id")
    need_one(("identity", "revision"), ("identity", "config_sha256"))
    need("method", "kind")
    full = C.read(doc).full  # full fine-tuning has no adapters: no rank, targets or adapter dtype to give
    if not full:
        need("method", "rank")
        need_one(("method", "target_modules"), ("method", "target_parameters"))
    need("base_model", "loaded_dtype")
    for key in quantization_fields(C.read(doc).quantization):
        need(*C.QUANT, key)
    if not full:
        need("adapter", "dtype")
    need("workload", "microbatch")
    need_one(("workload", "max_length"), ("workload", "sequence_p95"))
    need("optimizer", "name")
    gaps += optimizer_gaps(doc)
    need("memory_options", "gradient_checkpointing")
    return gaps


def optimizer_gaps(doc: Document) -> list[str]:
    """Spec, minimum intake: for 8-bit or paged optimizers ``bits``/``paged`` must follow from the name or be
    given. A known name (:mod:`ledgerspec.contract.optimizers`) says both; an unknown one may be 8-bit, so its
    ``bits`` must be given unless the name spells them (``..._8bit``); ``paged`` is read from the name."""
    opt = C.read(doc).optimizer
    if not opt.name or opt.bits_known:
        return []
    guess = suggest(opt.name)
    hint = f"did you mean {guess!r}? " if guess else ""
    return [
        f"optimizer.name {opt.name!r} is not a known optimizer ({hint}known: {', '.join(OPTIMIZERS)}), so "
        "optimizer.bits does not follow from it and must be given"
    ]


__all__ = ["QLORA_FIELDS", "dotted", "minimum_intake_gaps", "optimizer_gaps", "quantization_fields", "state"]
