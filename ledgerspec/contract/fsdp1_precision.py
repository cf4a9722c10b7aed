"""FSDP1 ``MixedPrecision`` without autocast: a configuration whose first forward fails (issue 16 item 2).

One pure reading of a document, shared by validate's rule LS061 and the refusals of ``shard --estimate`` and
``measure --nproc`` (the contract wing: checks and derivations both import it; no torch).

The failure, on the CPU (gloo) and on GPUs alike, with the versions this project runs (torch 2.13, peft 0.21.2,
accelerate 1.15):

1. PEFT's ``fsdp_auto_wrap_policy`` (``peft/utils/other.py:1294-1301``, which transformers' Trainer gives accelerate
   for a PEFT model, ``transformers/distributed/fsdp.py:276-279``) makes every trainable leaf, each
   ``lora_A``/``lora_B`` ``nn.Linear``, its own FSDP1 unit.
2. PEFT's LoRA forward casts the layer's input to the adapter's dtype as it sees it from OUTSIDE that unit:
   ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` (``peft/tuners/lora/layer.py:1101``; the bitsandbytes
   LoRA layers do the same). Outside its forward the unit is resharded, and ``lora_A.weight`` is the parameter in
   its own dtype (``use_orig_params``: the sharded view of the flat parameter; without it a view of the same dtype).
3. The unit then all-gathers in ``MixedPrecision.param_dtype`` and does not cast its input: FSDP1 casts a non-root
   unit's forward inputs only with ``cast_forward_inputs`` (``torch/distributed/fsdp/_runtime_utils.py:398-405``),
   whose default is False (``torch/distributed/fsdp/api.py:142-148``), and accelerate builds
   ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` without it
   (``accelerate/utils/dataclasses.py:2136-2143``).
4. ``F.linear`` (``torch/nn/modules/linear.py:134``) meets an input in the adapter's dtype and a weight in
   ``param_dtype``: ``RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16``.

Autocast (``training.mixed_precision: bf16``/``fp16``, what accelerate's ``mixed_precision`` turns on with the
policy) casts both operands of ``F.linear`` and the step runs; so does an adapter already in ``param_dtype``
(``adapter.dtype: bfloat16``). FSDP2 is not affected: the LoRA weights belong to their decoder layer's
``fully_shard`` group, unsharded in ``param_dtype`` when PEFT reads their dtype.

Under fake tensors the step does not fail where the real one does: the meta kernel of ``aten.mm``
(``torch/_meta_registrations.py:2513``, ``meta_mm``) checks shapes, not dtypes, and returns the input's dtype. With
non-reentrant checkpointing the recomputation then reads ``lora_A.weight.dtype`` while the unit is gathered (backward or
forward prefetch, ``SHARD_GRAD_OP``), gets ``param_dtype``, skips the cast, and ``torch.utils.checkpoint`` raises
``CheckpointError`` (recomputed values with different metadata); without it the simulation returned figures for a step
no real run takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledgerspec.contract import config as C
from ledgerspec.contract import dtypes
from ledgerspec.contract.document import Document

#: ``parallelism.strategy`` values that select FSDP1 (``FullyShardedDataParallel``); anything else is FSDP2
FSDP1_NAMES = C.FSDP1_NAMES
POLICY = ("parallelism", "mixed_precision_policy")

HINT = (
    "add training.mixed_precision: bf16 (autocast, what accelerate's mixed_precision turns on with the policy), or "
    "declare adapter.dtype equal to param_dtype, or use strategy fsdp2"
)


def declares_fsdp1(doc: Document) -> bool:
    """``parallelism.strategy: fsdp1`` (or, without a strategy, ``memory_options.sharding: fsdp1``): one of
    FSDP1's names (:func:`ledgerspec.contract.config.declared_strategy`)."""
    return C.declared_strategy(doc) in FSDP1_NAMES


@dataclass(frozen=True)
class Conflict:
    """Where the document sets the policy's ``param_dtype``, and why the declared step fails."""

    path: tuple[str, ...]
    message: str
    hint: str = HINT


def lora_input_dtype_conflict(doc: Document) -> Conflict | None:
    """The FSDP1 + ``MixedPrecision(param_dtype)`` + no autocast + adapters in another dtype conflict, or None."""
    if not declares_fsdp1(doc):
        return None
    param = doc.get(*POLICY, "param_dtype").text()
    param_dtype = dtypes.canonical(param) if param else None
    if param_dtype is None:  # no cast of the gathered units (or a bad dtype: reported where the policy is read)
        return None
    cfg = C.read(doc)
    if cfg.training.autocast_dtype is not None:
        return None
    adapter = dtypes.canonical(cfg.adapter_dtype) if cfg.adapter_dtype else "float32"  # PEFT's default: float32
    if adapter is None or adapter == param_dtype:  # unknown or mixed adapter dtypes: nothing to say
        return None
    return Conflict(
        (*POLICY, "param_dtype"),
        f"FSDP1 MixedPrecision(param_dtype={param_dtype}) without autocast fails at the first forward: PEFT casts "
        f"each LoRA input to the {adapter} adapter weight (read outside its own FSDP1 unit), the unit computes in "
        f"{param_dtype} and does not cast its input (cast_forward_inputs=False)",
    )


__all__ = ["FSDP1_NAMES", "Conflict", "declares_fsdp1", "lora_input_dtype_conflict"]
