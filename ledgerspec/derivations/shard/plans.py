"""The FSDP plan a document declares: each rank's calculated state under FSDP2 or FSDP1, the reference model beside
it where the objective keeps a separate one.

One builder for the two places that calculate it: ``shard`` (:func:`ledgerspec.derivations.shard.sharder.compute`)
and the calculated row that ``measure --nproc`` writes beside each measured rank
(:func:`ledgerspec.derivations.measure.dist._calculated`), which used to build its own plan and missed what the
former reads (full fine-tuning's wrap, ``use_orig_params``).
"""

from __future__ import annotations

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.derivations.shard import state as S
from ledgerspec.derivations.shard.options import (
    fsdp1_options,
    is_fsdp1,
    mixed_precision,
    reshard_after_forward_switch,
    separate_reference,
)


def reshard_after_forward(doc: Document) -> bool:
    """``parallelism.reshard_after_forward`` (absent: True, both strategies' default for the plan)."""
    value = reshard_after_forward_switch(doc)
    return True if value is None else value


def fsdp_plan(doc: Document, descs: list[S.ParamDesc], world: int, optimizer: str) -> S.Fsdp2Plan | S.Fsdp1Plan:
    """The plan of ``descs`` (the model's parameter descriptors) on ``world`` ranks as ``doc`` declares it. Raises
    ValueError where a strategy cannot shard them (the callers say where in the document)."""
    mp = mixed_precision(doc)
    param_dtype = mp.param_dtype if mp else None
    reshard = reshard_after_forward(doc)
    if is_fsdp1(doc):
        # full fine-tuning: accelerate's transformer-based wrap (decoder layers + root), not PEFT's policy
        units = descs if config.read(doc).full else S.peft_fsdp1_units(descs)

        def fsdp1(params: list[S.ParamDesc]) -> S.Fsdp1Plan:
            return S.fsdp1(
                params,
                world,
                optimizer,
                reshard_after_forward=reshard,
                param_dtype=param_dtype,
                use_orig_params=fsdp1_options(doc).use_orig_params,
                buffer_dtype=mp.buffer_dtype if mp else None,
            )

        plan = fsdp1(units)
        if separate_reference(doc):  # wrapped per decoder layer (TRL's prepare_fsdp: transformer-based wrap)
            return S.with_fsdp1_reference(plan, fsdp1([d for d in descs if not d.trainable]))
        return plan
    plan2 = S.fsdp2(descs, world, optimizer, reshard_after_forward=reshard, param_dtype=param_dtype)
    if separate_reference(doc):  # one fully_shard of its root (TRL's prepare_fsdp)
        return S.with_reference(plan2, descs, world, reshard)
    return plan2


__all__ = ["fsdp_plan", "reshard_after_forward"]
