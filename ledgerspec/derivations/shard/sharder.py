"""Write the calculated per-rank state into a document: ``parallelism.x-per-rank`` (CALCULATED figures).

FSDP2 per-rank figures for each rank plus ZeRO-1/2/3 (without and with CPU offload) for comparison, each a
long-form figure ``{value, source: CALCULATED, method}``. With ``estimate=True`` an ``estimate`` block is added:
each rank's predicted phases from a simulated FSDP2 step (:mod:`ledgerspec.derivations.shard.simulate`) and,
given a device memory, the fit verdict. The declared ``parallelism`` inputs are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledgerspec.contract import config, dtypes
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.contract.edit import Change, set_extension
from ledgerspec.contract.fsdp1_precision import declares_fsdp1, lora_input_dtype_conflict
from ledgerspec.derivations.shard import state as S
from ledgerspec.errors import EXIT_FINDINGS, EXIT_USAGE, LedgerspecError

EXTENSION = ("parallelism", "x-per-rank")


_err = ErrorAt("shard")


def world_size(doc: Document, nproc: int | None) -> int:
    if nproc is not None:
        if nproc < 1:
            raise LedgerspecError(f"--nproc must be >= 1, got {nproc}", doc.path, rule="shard", exit_code=EXIT_USAGE)
        return nproc
    gpus = doc.get("parallelism", "gpu_count").integer()
    if gpus is None or gpus < 1:
        raise _err(
            doc,
            ("parallelism",) if doc.get("parallelism").present else ("ledgerspec",),
            "no rank count: parallelism.gpu_count is missing or UNKNOWN",
            "pass --nproc N",
            exit_code=EXIT_USAGE,
        )
    return gpus


def shard_group(doc: Document, world: int) -> int:
    """The ranks one parameter is sharded over: ``parallelism.shard_group_size`` under hybrid sharding (FSDP1
    ``HYBRID_SHARD``, FSDP2 ``fully_shard`` on a 2-D (replicate, shard) device mesh; each rank then holds what it
    holds on that many ranks: its group's shard, replicated across the groups), else ``world``. A size that does
    not divide ``world`` is a usage error at its line."""
    path = ("parallelism", "shard_group_size")
    value = doc.get(*path)
    if not value.present or value.unknown:
        return world
    size = value.integer()
    if size is None or size < 1 or world % size:
        raise _err(
            doc,
            path,
            f"shard_group_size {value.value!r} must be a whole number that divides the {world} ranks",
            "the GPUs of one node, e.g. 8 of 16",
            exit_code=EXIT_USAGE,
        )
    from ledgerspec.derivations.shard.zero import zero_stage

    if size < world and zero_stage(doc) is not None:
        raise _err(
            doc,
            path,
            "hybrid sharding is modelled for FSDP (FSDP1 HYBRID_SHARD, FSDP2 on a (replicate, shard) mesh), not for "
            "DeepSpeed's hierarchical partitioning (hpZ, MiCS)",
            "set parallelism.strategy: fsdp1 or fsdp2, or drop shard_group_size",
            exit_code=EXIT_USAGE,
        )
    return size


def check_qlora(doc: Document, rule: str = "shard", code: int = EXIT_FINDINGS) -> None:
    """QLoRA is shardable only with ``bnb_4bit_quant_storage`` equal to the loaded float dtype (``shard`` and
    ``measure --nproc`` both refuse other layouts here, each under its own rule name and exit code)."""
    cfg = config.read(doc)
    if not cfg.quantized:
        return
    q = config.QUANT
    if cfg.quantization.type == "int8":
        name = "FSDP1" if is_fsdp1(doc) else "FSDP2"
        raise _err(
            doc, (*q, "type"), f"{name} per rank covers 4-bit (nf4/fp4) QLoRA, not int8", exit_code=code, rule=rule
        )
    storage = doc.get(*q, "storage_dtype")
    why = S.qlora_shardable(cfg.quantization.storage_dtype, cfg.loaded_dtype)
    if why:
        path = (*q, "storage_dtype") if storage.present else (q if doc.get(*q).present else ("base_model",))
        raise _err(
            doc,
            path,
            why,
            "set base_model.quantization.storage_dtype to the loaded dtype "
            "(BitsAndBytesConfig(bnb_4bit_quant_storage=...)), as FSDP-QLoRA recipes do",
            exit_code=code,
            rule=rule,
        )


#: how an unset ``reshard_after_forward`` is reported (as ``measure --nproc`` records it)
FSDP2_DEFAULT = "fsdp2 default"

MIXED_PRECISION = ("parallelism", "mixed_precision_policy")


@dataclass(frozen=True)
class MixedPrecision:
    """``parallelism.mixed_precision_policy``: FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.

    torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_api.py``: ``param_dtype`` is the dtype of the unsharded
    parameter (all-gather, forward and backward compute, the unsharded gradient); ``reduce_dtype`` the dtype of the
    reduce-scatter (None: the gradient's, i.e. ``param_dtype``); ``FSDPParam.init_dtype_attrs`` drops either when
    it equals what the parameter already has, and never casts non-floating parameters. accelerate 1.15
    (``FullyShardedDataParallelPlugin.set_mixed_precision``) sets ``param_dtype = reduce_dtype = output_dtype`` to
    the ``mixed_precision`` dtype and (``fsdp_utils.fsdp2_prepare_model``) upcasts the trainable parameters to
    float32 before ``fully_shard``; declare ``adapter.dtype: float32`` for that.
    """

    param_dtype: str | None
    reduce_dtype: str | None
    #: FSDP1's ``MixedPrecision.buffer_dtype`` (``_runtime_utils._root_pre_forward`` casts the floating buffers to
    #: it at the first forward, ``_cast_buffers_to_dtype_and_device``); FSDP2's policy has no such field
    buffer_dtype: str | None = None

    def describe(self) -> str:
        buffers = f", buffer_dtype={self.buffer_dtype}" if self.buffer_dtype else ""
        return f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}{buffers})"


def mixed_precision(doc: Document) -> MixedPrecision | None:
    """The declared policy, None when absent (FSDP2's default); a dtype that is not floating is an error."""
    if not doc.get(*MIXED_PRECISION).present:
        return None
    out: dict[str, str | None] = {}
    for key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = doc.get(*MIXED_PRECISION, key)
        text = value.text()
        if text is None:
            out[key] = None
            continue
        name = dtypes.canonical(text)
        if name is None or not name.startswith(("float", "bfloat")):
            raise _err(
                doc,
                (*MIXED_PRECISION, key),
                f"{key} must be a floating dtype (float32, bfloat16, float16), got {text!r}",
                exit_code=EXIT_USAGE,
            )
        out[key] = name
    if out["buffer_dtype"] is not None and not is_fsdp1(doc):
        raise _err(
            doc,
            (*MIXED_PRECISION, "buffer_dtype"),
            "buffer_dtype is FSDP1's (MixedPrecision); FSDP2's MixedPrecisionPolicy has none: its buffers keep "
            "their dtype",
            "drop buffer_dtype, or set parallelism.strategy: fsdp1",
            exit_code=EXIT_USAGE,
        )
    if all(v is None for v in out.values()):
        return None
    return MixedPrecision(out["param_dtype"], out["reduce_dtype"], out["buffer_dtype"])


def cpu_offload(doc: Document) -> tuple[str, ...] | None:
    """Where the document turns CPU offload on (``parallelism.cpu_offload`` or ``memory_options.cpu_offload``)."""
    for path in (("parallelism", "cpu_offload"), ("memory_options", "cpu_offload")):
        if doc.get(*path).switch():
            return path
    return None


def is_fsdp1(doc: Document) -> bool:
    """``parallelism.strategy: fsdp1`` (or, without a strategy, ``memory_options.sharding: fsdp1``): FSDP1 as the
    Trainer/accelerate run it (``fsdp_version: 1``)."""
    return declares_fsdp1(doc)


def check_fsdp1_mixed_precision(doc: Document, rule: str = "shard", code: int = EXIT_USAGE) -> None:
    """Refuse, before any step runs, FSDP1 ``MixedPrecision(param_dtype)`` without autocast over adapters in another
    dtype: every real run fails at the first LoRA forward, and the simulation cannot be trusted to (its meta ``mm``
    does not check dtypes); see :mod:`ledgerspec.contract.fsdp1_precision` for the source lines."""
    conflict = lora_input_dtype_conflict(doc)
    if conflict is not None:
        raise _err(doc, conflict.path, conflict.message, conflict.hint, exit_code=code, rule=rule)


#: ``parallelism.backward_prefetch`` words -> ``torch.distributed.fsdp.BackwardPrefetch`` member (None: no prefetch)
BACKWARD_PREFETCH = {"backward_pre": "BACKWARD_PRE", "backward_post": "BACKWARD_POST", "no_prefetch": None}


@dataclass(frozen=True)
class Fsdp1Options:
    """FSDP1's wrapping options as accelerate passes them to ``FullyShardedDataParallel`` (accelerate 1.15
    ``Accelerator.prepare_model``), with the defaults of transformers' ``TrainingArguments`` (5.x
    ``_fsdp_plugin_args``: ``backward_prefetch`` 'NO_PREFETCH', ``forward_prefetch`` false, ``use_orig_params``
    true) and accelerate's ``limit_all_gathers`` true."""

    backward_prefetch: str | None = None  # a BackwardPrefetch member name
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True

    def describe(self) -> str:
        return (
            f"backward_prefetch={self.backward_prefetch or 'None'}, forward_prefetch={self.forward_prefetch}, "
            f"limit_all_gathers={self.limit_all_gathers}, use_orig_params={self.use_orig_params}"
        )


def fsdp1_options(doc: Document) -> Fsdp1Options:
    """The declared FSDP1 options (absent ones at the Trainer's defaults); a bad value is a usage error at its line."""
    path = ("parallelism", "backward_prefetch")
    text = doc.get(*path).text()
    prefetch = None
    if text is not None:
        key = text.strip().lower().replace("-", "_")
        if key not in BACKWARD_PREFETCH:
            raise _err(
                doc,
                path,
                f"backward_prefetch {text!r} is not one of {', '.join(BACKWARD_PREFETCH)}",
                exit_code=EXIT_USAGE,
            )
        prefetch = BACKWARD_PREFETCH[key]

    def switch(name: str, default: bool) -> bool:
        value = doc.get("parallelism", name)
        if not value.present or value.text() is None:
            return default
        on = value.switch()
        if on is None:
            raise _err(doc, ("parallelism", name), f"{name} must be true or false", exit_code=EXIT_USAGE)
        return on

    return Fsdp1Options(
        prefetch,
        switch("forward_prefetch", False),
        switch("limit_all_gathers", True),
        switch("use_orig_params", True),
    )


def _reshard(doc: Document) -> bool:
    value = doc.get("parallelism", "reshard_after_forward").switch()
    return True if value is None else value


@dataclass
class ShardResult:
    plan: S.Fsdp2Plan | S.Fsdp1Plan
    zero: dict[str, S.ZeroState]
    extension: dict[str, Any]
    change: Change | None
    estimate: Any = None  # sharding_estimate.ShardEstimate with estimate=True
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
            "optimizer": _fig(z.optimizer, how),
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
    strategy = (
        "fsdp1 (FullyShardedDataParallel, use_orig_params, PEFT's fsdp_auto_wrap_policy: decoder layers + each "
        f"trainable leaf module + root, {'FULL_SHARD' if plan.reshard_after_forward else 'SHARD_GRAD_OP'})"
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
    mp = mixed_precision(doc)
    param_dtype = mp.param_dtype if mp else None
    plan: S.Fsdp2Plan | S.Fsdp1Plan
    try:
        if is_fsdp1(doc):
            units = S.peft_fsdp1_units(descs)
            plan = S.fsdp1(
                units,
                world,
                optimizer,
                reshard_after_forward=_reshard(doc),
                param_dtype=param_dtype,
                use_orig_params=fsdp1_options(doc).use_orig_params,
                buffer_dtype=mp.buffer_dtype if mp else None,
            )
        else:
            plan = S.fsdp2(descs, world, optimizer, reshard_after_forward=_reshard(doc), param_dtype=param_dtype)
    except ValueError as exc:
        where = ("optimizer", "name") if "optimizer" in str(exc) else ("identity",)
        if "uniform dtype" in str(exc):
            where = ("adapter", "dtype") if doc.get("adapter", "dtype").present else ("parallelism", "strategy")
        raise _err(doc, where, str(exc)) from None
    t = S.totals(descs, optimizer)
    from ledgerspec.contract import config

    cfg = config.read(doc)
    master = sum(p.nbytes // p.itemsize * 4 for p in descs if p.trainable and p.kind == "param")
    zero = {
        f"zero{stage}{'_offload' if off else ''}": S.zero(
            stage,
            world,
            t["frozen"],
            t["trainable"],
            t["gradients"],
            t["optimizer"],
            offload=off,
            replicated_bytes=t["replicated"],
            master_bytes=master,
            accumulation=cfg.workload.gradient_accumulation or 1,
            recompute=bool(cfg.gradient_checkpointing),
        )
        for stage in (1, 2, 3)
        for off in (False, True)
    }
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
    plan, zero = compute(doc, descs, group)
    ext = extension(plan, zero, doc.get("optimizer", "name").text() or "")
    if group < world:
        how = (
            f"HYBRID_SHARD{'' if _reshard(doc) else '_ZERO2'}"
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
    if doc.get("parallelism", "reshard_after_forward").switch() is None and not is_fsdp1(doc):
        # FSDP2's default: layers reshard after forward, the root stays gathered into backward (the same compute
        # peak as true, which the calculated plan uses; the estimate simulates the default itself)
        ext["reshard_after_forward"] = FSDP2_DEFAULT
    from ledgerspec.derivations.shard.zero import zero_stage

    if offload is not None and zero_stage(doc) is None:  # issue 16: what FSDP moves to the host (shard.offload);
        # ZeRO's offload is its zeroN_offload row, not FSDP's CPUOffload
        from ledgerspec.derivations.shard import offload as O

        ext["cpu_offload"] = O.extension(plan, descs, "fsdp1" if is_fsdp1(doc) else "fsdp2", ".".join(offload))
    est = None
    if estimate:
        from ledgerspec.derivations.shard.simulate import estimate_per_rank, extension_block

        if device_memory is None:
            device_memory = doc.get("result", "target_device", "memory").size()
        if zero_stage(doc) is not None:  # DeepSpeed ZeRO-2/3: DeepSpeed's own engine per rank (issue 16)
            from ledgerspec.derivations.shard.zero_simulate import estimate_zero_per_rank

            est = estimate_zero_per_rank(doc, world, target=target, layers=layers, offline=offline)
        else:
            est = estimate_per_rank(doc, group, descs, target=target, layers=layers, offline=offline)
        ext["estimate"] = extension_block(est, device_memory)
    change = set_extension(doc, EXTENSION, ext)
    return ShardResult(plan, zero, ext, change, est, device_memory)
