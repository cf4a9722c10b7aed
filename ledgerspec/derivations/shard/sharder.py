"""Write the calculated per-rank state into a document: ``parallelism.x-per-rank`` (CALCULATED figures).

The FSDP2 (or FSDP1) per-rank figures for each rank plus ZeRO-1/2/3 (without and with CPU offload) for comparison,
each a long-form figure ``{value, source: CALCULATED, method}``; with CPU offload declared, what FSDP moves to the
host (:mod:`ledgerspec.derivations.shard.offload.fsdp`). With ``estimate=True`` an ``estimate`` block is added: each
rank's predicted phases from a simulated step of the declared strategy (FSDP2 or FSDP1:
:mod:`ledgerspec.derivations.shard.fsdp.simulate`; DeepSpeed ZeRO: :mod:`ledgerspec.derivations.shard.zero.simulate`)
and, given a device memory, the fit verdict. The declared ``parallelism`` inputs are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.contract.edit import Change, set_extension
from ledgerspec.derivations.shard import state as S
from ledgerspec.derivations.shard.options import (
    FSDP2_DEFAULT,
    ZeroOptions,
    check_fsdp1_mixed_precision,
    check_qlora,
    cpu_offload,
    fsdp1_options,
    is_fsdp1,
    mixed_precision,
    no_shard,
    reshard_after_forward_switch,
    separate_reference,
    shard_group,
    world_size,
    zero_options,
    zero_stage,
)
from ledgerspec.derivations.shard.plans import fsdp_plan, reshard_after_forward
from ledgerspec.derivations.stack.optimizer_state import TensorShape, optimizer_spec, state_bytes

EXTENSION = ("parallelism", "x-per-rank")


_err = ErrorAt("shard")


@dataclass
class ShardResult:
    plan: S.Fsdp2Plan | S.Fsdp1Plan
    zero: dict[str, S.ZeroState]
    extension: dict[str, Any]
    change: Change | None
    estimate: Any = None  # simulation.ShardEstimate with estimate=True
    device_memory: int | None = None


def _fig(value: int, method: str) -> dict[str, Any]:
    return {"value": value, "source": "CALCULATED", "method": method}


def extension(plan: S.Fsdp2Plan | S.Fsdp1Plan, zero: dict[str, S.ZeroState], optimizer: str) -> dict[str, Any]:
    w = plan.world_size
    fsdp1 = isinstance(plan, S.Fsdp1Plan)
    pad = (
        f"FSDP1 flat parameter per unit (use_orig_params: 16-byte aligned, padded to a multiple of {w}), 1/{w} each"
        if fsdp1
        else f"FSDP2 dim-0 shards padded to ceil(d0/{w}) rows"
    )
    ranks = []
    for rs in plan.ranks:
        ranks.append(
            {
                "rank": rs.rank,
                "frozen_base": _fig(rs.frozen_base, f"{pad}; + buffers, quant constants (replicated)"),
                "adapter": _fig(rs.adapter, f"{pad}, trainable parameters"),
                "gradients": _fig(rs.gradients, f"{pad}, reduce-scatter output"),
                "optimizer": _fig(
                    rs.optimizer,
                    f"{optimizer} state on "
                    + ("each trainable parameter's elements in this shard" if fsdp1 else "the unpadded local rows"),
                ),
                "gathered_parameters": _fig(
                    rs.gathered,
                    f"{len(plan.gathered_units)} unit(s) all-gathered during compute"
                    + (f" (floating parameters in {plan.param_dtype})" if plan.param_dtype else "")
                    + ": "
                    + ", ".join(plan.gathered_units),
                ),
                "model_state": _fig(rs.with_gathered, "sum of the above; no activations or temporaries"),
            }
        )
    zero_out: dict[str, Any] = {}
    for key, z in zero.items():
        how = f"ZeRO-{z.stage}{' + CPU offload' if z.offload else ''}: ceil(bytes/{w}) when partitioned"
        zero_out[key] = {
            "parameters": _fig(z.parameters, how),
            "gradients": _fig(z.gradients, how),
            "optimizer": _fig(
                z.optimizer,
                how + f": the state of the fp32 partition + DeepSpeed's fp32 master partition ({z.master:,} B)",
            ),
            "device_total": _fig(z.device_total, how),
            "host": _fig(z.host, how + ", on the host"),
        }
        if z.offload:  # issue 16: what moves each step (DeepSpeed 0.19.8's copies: state.zero_offload_traffic)
            part = f"the rank's gradient partition, ceil(bytes/{w})"
            zero_out[key]["to_host_per_step"] = _fig(
                z.to_host,
                f"device -> host per optimizer step: {part} each micro-step when accumulating"
                + (" (and brought back to add to)" if z.stage < 3 else " (and back to the device)")
                + ", then in fp32 into the host's gradient",
            )
            zero_out[key]["to_device_per_step"] = _fig(
                z.to_device_per_step,
                "host -> device per optimizer step: "
                + (
                    "the gradient partition back to accumulate on the device, each micro-step"
                    if z.stage == 3
                    else "the accumulated gradients back from the second micro-step on, and the updated trainable "
                    "partition after the step (then all-gathered)"
                ),
            )
            if z.stage == 3:
                zero_out[key]["to_device_per_micro_step"] = _fig(
                    z.to_device_per_micro_step,
                    f"host -> device per micro-step, at most: every parameter partition (ceil(bytes/{w})) fetched "
                    "before its all-gather in forward, in backward and in the recompute under gradient "
                    "checkpointing (offload_param; persistent small parameters and those kept by "
                    "stage3_max_reuse_distance are not fetched again)",
                )
    wrap = (
        "accelerate's transformer-based wrap (full fine-tuning): decoder layers + root"
        if all(u.trainable for u in getattr(plan, "units", {}).values())
        else "PEFT's fsdp_auto_wrap_policy: decoder layers + each trainable leaf module + root"
    )
    strategy = (
        f"fsdp1 (FullyShardedDataParallel, use_orig_params, {wrap}, "
        f"{'NO_SHARD' if w == 1 else 'FULL_SHARD' if plan.reshard_after_forward else 'SHARD_GRAD_OP'})"
        if fsdp1
        else "fsdp2 (fully_shard per decoder layer + root)"
    )
    return {
        "strategy": strategy,
        "world_size": w,
        "reshard_after_forward": plan.reshard_after_forward,
        "calculated_by": S.CALCULATED_BY,
        "ranks": ranks,
        "zero": zero_out,
    }


def compute(
    doc: Document, descs: list[S.ParamDesc], world: int
) -> tuple[S.Fsdp2Plan | S.Fsdp1Plan, dict[str, S.ZeroState]]:
    optimizer = doc.get("optimizer", "name").text() or ""
    try:
        plan = fsdp_plan(doc, descs, world, optimizer)
    except ValueError as exc:
        where = ("optimizer", "name") if "optimizer" in str(exc) else ("identity",)
        if "uniform dtype" in str(exc):
            where = ("adapter", "dtype") if doc.get("adapter", "dtype").present else ("parallelism", "strategy")
        raise _err(doc, where, str(exc)) from None
    t = S.totals(descs, optimizer)
    cfg = config.read(doc)
    master = sum(p.nbytes // p.itemsize * 4 for p in descs if p.trainable and p.kind == "param")
    # DeepSpeed's optimizer steps the fp32 master partition: its state is that of fp32 parameters (issue 26)
    spec = optimizer_spec(optimizer)
    fp32 = [TensorShape(p.shape, max(p.itemsize, 4)) for p in descs if p.trainable and p.kind == "param"]
    ds_state = state_bytes(spec, fp32).device if spec is not None else t["optimizer"]
    # ZeRO-3's persistent parameters (at most stage3_param_persistence_threshold elements): whole on every device
    threshold = (
        zero_options(doc).param_persistence_threshold
        if zero_stage(doc) is not None
        else ZeroOptions(3).param_persistence_threshold
    )
    small = [p for p in descs if p.kind == "param" and p.numel <= threshold]
    persistent_frozen = sum(p.nbytes for p in small if not p.trainable)
    persistent_trainable = sum(p.nbytes for p in small if p.trainable)
    zero = {
        f"zero{stage}{'_offload' if off else ''}": S.zero(
            stage,
            world,
            t["frozen"],
            t["trainable"],
            t["gradients"],
            ds_state,
            offload=off,
            replicated_bytes=t["replicated"],
            master_bytes=master,
            accumulation=cfg.workload.gradient_accumulation or 1,
            recompute=bool(cfg.gradient_checkpointing),
            persistent_frozen=persistent_frozen,
            persistent_trainable=persistent_trainable,
        )
        for stage in (1, 2, 3)
        for off in (False, True)
    }
    if separate_reference(doc):  # DPO/KTO's reference model, as TRL's prepare_deepspeed holds it
        zero = {k: S.with_zero_reference(z, world, t["frozen"], t["replicated"]) for k, z in zero.items()}
    return plan, zero


def shard(
    doc: Document,
    nproc: int | None = None,
    offline: bool = True,
    trust_remote_code: bool = False,
    estimate: bool = False,
    target: str = "cuda",
    device_memory: int | None = None,
    layers: str = "auto",
) -> ShardResult:
    """Calculate the per-rank state of ``doc`` and write it into the document (in memory).

    ``estimate``: also simulate each rank's FSDP2 step and predict its phases; ``device_memory`` (default
    ``result.target_device.memory``) gives the fit verdict of every rank.
    """
    from ledgerspec.derivations.shard.model import document_descriptors

    world = world_size(doc, nproc)
    check_qlora(doc)
    if estimate:  # a step no real run takes (issue 16): one line before anything is simulated
        check_fsdp1_mixed_precision(doc)
    offload = cpu_offload(doc)
    try:
        descs = document_descriptors(doc, offline=offline, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise _err(doc, ("base_model",), str(exc)) from None
    group = shard_group(doc, world)
    whole = group < world and no_shard(doc, world)  # FSDP1's NO_SHARD: a group of one rank, every rank the whole model
    plan, zero = compute(doc, descs, group)
    if whole:  # the ZeRO rows it is compared with: over every rank
        zero = compute(doc, descs, world)[1]
    ext = extension(plan, zero, doc.get("optimizer", "name").text() or "")
    if whole:
        ext["no_shard"] = (
            f"FSDP1 NO_SHARD on {world} ranks: every rank holds every flat parameter whole, its gradient and its "
            "optimizer state (each unit's flat gradient all-reduced after its backward); one rank listed"
        )
    elif group < world:
        how = (
            f"HYBRID_SHARD{'' if reshard_after_forward(doc) else '_ZERO2'}"
            if is_fsdp1(doc)
            else f"FSDP2 on a ({world // group} replicate, {group} shard) device mesh, HSDP"
        )
        ext["hybrid"] = (
            f"{world} ranks in {world // group} shard groups of {group} ({how}): rank r holds what rank r mod "
            f"{group} holds, listed once"
        )
    mp = mixed_precision(doc)
    if mp is not None:
        ext["mixed_precision_policy"] = {"param_dtype": mp.param_dtype, "reduce_dtype": mp.reduce_dtype}
        if mp.buffer_dtype:
            ext["mixed_precision_policy"]["buffer_dtype"] = mp.buffer_dtype
    if is_fsdp1(doc):
        opts = fsdp1_options(doc)
        ext["fsdp1_options"] = {
            "backward_prefetch": opts.backward_prefetch,
            "forward_prefetch": opts.forward_prefetch,
            "limit_all_gathers": opts.limit_all_gathers,
            "use_orig_params": opts.use_orig_params,
        }
    if reshard_after_forward_switch(doc) is None and not is_fsdp1(doc):
        # FSDP2's default: layers reshard after forward, the root stays gathered into backward (the same compute
        # peak as true, which the calculated plan uses; the estimate simulates the default itself)
        ext["reshard_after_forward"] = FSDP2_DEFAULT
    if offload is not None and zero_stage(doc) is None:  # issue 16: what FSDP moves to the host (offload.fsdp);
        # ZeRO's offload is its zeroN_offload row, not FSDP's CPUOffload
        from ledgerspec.derivations.shard.offload import fsdp as O

        ext["cpu_offload"] = O.extension(plan, descs, "fsdp1" if is_fsdp1(doc) else "fsdp2", ".".join(offload))
    est = None
    recorded: list[Any] = []  # the result fields written beside the extension
    if estimate:
        from ledgerspec.derivations.shard.fsdp import estimate_per_rank
        from ledgerspec.derivations.shard.simulation import extension_block

        from_flag = device_memory is not None
        if device_memory is None:
            device_memory = doc.get("result", "target_device", "memory").size()
        # issue 23: with a device, the verdict is the allocator model's replay of each rank's stream plus what lies
        # outside the allocator, as `estimate` decides for one GPU; what is not replayed says why
        not_on_device = "cpu" if target != "cuda" else None
        on_device = device_memory is not None and not_on_device is None
        if zero_stage(doc) is not None:  # DeepSpeed ZeRO-2/3: DeepSpeed's own engine per rank (issue 16)
            from ledgerspec.derivations.shard.zero import estimate_zero_per_rank

            est = estimate_zero_per_rank(doc, world, target=target, layers=layers, offline=offline, streams=on_device)
        else:
            est = estimate_per_rank(doc, group, descs, target=target, layers=layers, offline=offline, streams=on_device)
            if whole:  # one rank simulated for all: each holds what a rank of one holds
                est.world_size = world
        if on_device:
            from ledgerspec.derivations.devices.per_rank import ranks_on_device

            assert device_memory is not None
            est.device = ranks_on_device(doc, est, device_memory, world, from_flag)
        elif device_memory is not None and not_on_device is not None:
            from ledgerspec.derivations.devices.per_rank import NOT_ON_DEVICE

            est.allocated_only = NOT_ON_DEVICE[not_on_device]
        ext["estimate"] = extension_block(est, device_memory)
        # the inputs it read, so that the ladder and LS006 see an edit since (contract.fingerprint.SHARD_INPUTS)
        from ledgerspec.contract.fingerprint import SHARD_INPUTS, digests

        ext["estimate"]["inputs"] = digests(doc, SHARD_INPUTS)
        # the ranks launched (--nproc): a hybrid shard group or NO_SHARD lists fewer rows (and world_size above is
        # the group's), and the verdict holds for a document of this many GPUs
        ext["estimate"]["world"] = world
        if device_memory is not None:  # as `estimate` records its answer: the device asked about, the run's answer
            from ledgerspec.contract.config import sharded_ranks
            from ledgerspec.contract.edit import set_plain

            memory = ("result", "target_device", "memory")
            if from_flag and doc.get(*memory).size() != device_memory:  # an equal value is no change (--check)
                recorded.append(set_plain(doc, memory, device_memory, force=True))
            fits = bool(ext["estimate"].get("fits"))
            if sharded_ranks(doc) == world and doc.get("result", "fits").switch() is not fits:
                # the declared ranks: this is the run's answer (not another count's)
                recorded.append(set_plain(doc, ("result", "fits"), fits, force=True))
    change = set_extension(doc, EXTENSION, ext)
    if change is None:  # the result fields it wrote are a change too (for --check, and to be saved)
        change = next((c for c in recorded if c is not None), None)
    return ShardResult(plan, zero, ext, change, est, device_memory)
