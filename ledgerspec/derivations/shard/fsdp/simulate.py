"""The per-rank estimate under FSDP2 and FSDP1: a simulated training step per rank, fake tensors, fake process group.

"Does it fit on 2 x 24 GB?" before renting: for rank ``r`` of ``W``, a fake process group
(``torch.testing._internal.distributed.fake_pg.FakeStore``: collectives return at once, their output
buffers are the ones FSDP2 itself allocates) is initialised in this process and the estimate's workload
(:func:`ledgerspec.derivations.estimate.estimator.trace`'s: exact model, adapters, optimizer, checkpointing, the CUDA
attention model, 512-byte allocator rounding for the cuda target) is sharded with ``fully_shard`` per decoder
layer + root (:mod:`ledgerspec.derivations.shard.fsdp.workload`) and run through the measurement protocol
under ``FakeTensorMode`` with the dispatch-level tracker. What this rank holds is therefore what FSDP2 really
allocates: its padded shards, the all-gathered units while they compute (and the root kept gathered), the
unsharded gradients before reduce-scatter and the padded gradient shards after it, the optimizer state of
its rows, and the activations of its own microbatch (FSDP2 does not shard activations). Depth is handled
as in ``estimate`` (two probe depths, extrapolated linearly; the gathered units do not grow with depth).

Ranks whose every parameter has the same number of local rows hold the same bytes; one of each such group
is simulated and the others share its figures.

Not modelled: NCCL's communicator and internal buffers, CUDA context, cuBLAS workspaces, allocator caching
and fragmentation, and CUDA stream overlap (on a GPU the next unit's all-gather can be in flight while the
current one computes: up to one more unit's gathered parameters than simulated here).

QLoRA (``bnb_4bit_quant_storage`` = the loaded float dtype, the only layout FSDP2 can shard; other storage is
refused): the estimate's workload replaces every bitsandbytes ``Linear4bit`` by
:class:`ledgerspec.derivations.estimate.qlora.Fake4bitLinear` before ``fully_shard``, whose weight is a Parameter
of the packed shape ``((n + 1) // (2 * s), 1)`` in the storage dtype, the shape a loaded model holds
(:func:`ledgerspec.derivations.shard.state.packed_4bit_shape`, what ``measure --nproc`` shards). FSDP2 therefore
shards and pads it as it does the real one, all-gathers it with its layer, and the fake layer's forward receives
the gathered weight (and allocates bitsandbytes' dequantization temporaries); the quantization constants (absmax,
code, nested state) are buffers, whole on every rank, as in the real run.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.estimate.extrapolate import Plan
from ledgerspec.derivations.shard.options import (
    cpu_offload,
    fsdp1_options,
    is_fsdp1,
    mixed_precision,
    reshard_after_forward_switch,
)
from ledgerspec.derivations.shard.simulation import (
    COMPONENTS,
    Progress,
    RankEstimate,
    ShardEstimate,
    add_sides,
    fake_process_group,
    prepare_trace,
    probe_runner,
    simulated_rank,
    stream_runner,
)
from ledgerspec.derivations.shard.state import (
    ParamDesc,
    chunk_rows,
    kept_after_forward,
    qlora_shardable,
    unit_unsharded_bytes,
)

_err = ErrorAt("shard")


def rank_groups(descs: list[ParamDesc], world: int) -> dict[int, list[int]]:
    """``{representative rank: ranks}``: ranks with the same local rows of every parameter hold the same bytes."""
    layouts: dict[tuple[int, ...], list[int]] = {}
    rows = [chunk_rows(d.shape[0], world) for d in descs if d.kind == "param" and d.shape]
    for r in range(world):
        layouts.setdefault(tuple(x[r] for x in rows), []).append(r)
    return {members[0]: members for members in layouts.values()}


def simulate_rank(
    doc: Document,
    spec: Any,
    source: Any,
    target: str,
    world: int,
    rank: int,
    reshard_after_forward: bool | None,
    record: list[Any] | None = None,
) -> dict[str, int]:
    """One simulated FSDP2 protocol run for ``rank`` of ``world``: phase figures, activations, components.

    ``record``: a list that receives the run's allocation stream
    (:class:`ledgerspec.derivations.allocator.step.StepEvents`), each allocation on the stream FSDP made it on
    (:func:`ledgerspec.derivations.shard.simulation.stream_numbers`); the figures are the same either way."""
    import warnings

    from ledgerspec.derivations.engine.backends import TrackerBackend
    from ledgerspec.derivations.engine.protocol import run_protocol
    from ledgerspec.derivations.engine.tracker import by_component
    from ledgerspec.derivations.estimate.estimator import _estimate_workload_class, granularity
    from ledgerspec.derivations.shard.fsdp.workload import sharded_workload

    run_spec = spec.changed(accumulation=min(spec.accumulation, 2))  # as estimate.trace: enough for the peaks
    from ledgerspec.derivations.shard.fsdp.workload import fsdp1_workload
    from ledgerspec.derivations.shard.offload import fsdp as O
    from ledgerspec.derivations.shard.offload.sides import recording_sides, split_backend

    cls = (fsdp1_workload if is_fsdp1(doc) else sharded_workload)(_estimate_workload_class())
    offload = cpu_offload(doc) is not None  # issue 16: CPU offload, each storage on its side by its role
    if offload:
        cls = O.offloaded_workload(cls)
    sides: dict[str, tuple[int, int]] = {}
    with fake_process_group(rank, world), warnings.catch_warnings(), contextlib.ExitStack() as extra:
        warnings.simplefilter("ignore")  # DTensor's "random operators on a cpu mesh" warning: values do not matter
        workload = cls(doc, run_spec, source, spec.attention, target)
        workload.reshard_after_forward = reshard_after_forward
        if record is not None and is_fsdp1(doc):  # the device-level stream: units reach the device one at a time
            workload.load_per_unit = True
        if is_fsdp1(doc):  # transformers < 4.52 as declared: the checkpoint around each FSDP1 unit
            from ledgerspec.derivations.shard.fsdp.legacy_checkpoint import models_outside_checkpoint

            workload.checkpoint_outside = models_outside_checkpoint(doc)
        if record is not None:  # the same tracker, keeping its event log
            from ledgerspec.derivations.allocator.step import _event_backend_class
            from ledgerspec.derivations.shard.offload.sides import split_tracker_class
            from ledgerspec.derivations.shard.simulation import device_waits, stream_numbers

            backend = _event_backend_class()(granularity(target))
            if offload:  # the event log is the device's stream: host storages log nothing (offload.sides)
                backend.tracker = split_tracker_class()(granularity=granularity(target), events=True)
                backend.sides = {}
            numbers = stream_numbers()
            backend.tracker.stream_of = numbers
            reads_loss = spec.loop == "trainer" or config.read(doc).training.loss_item_each_step
            extra.enter_context(device_waits(backend, numbers, reads_loss))
            from ledgerspec.derivations.shard.fsdp import sync

            if is_fsdp1(doc) and fsdp1_options(doc).sync_module_states:  # each unit broadcast as FSDP1 wraps it
                workload.sync_module_states = True
                extra.enter_context(sync.broadcasting(backend.tracker, numbers.of(sync.NCCL_STREAM)))
        else:
            backend = (split_backend if offload else TrackerBackend)(fake=True, granularity=granularity(target))
        split: Any = backend.tracker
        if offload:
            workload.split = split
            split.grads_to_host = not is_fsdp1(doc)  # FSDP1's host gradient is its pinned _cpu_grad
            extra.enter_context(O.pinning_as_copies(split.hosting, always=True))
            extra.enter_context(O.hosting_resharded_params(split))
            if target == "cuda":  # the device copy of the shards before each all-gather
                extra.enter_context(O.fsdp1_staging_on_the_device() if is_fsdp1(doc) else O.staging_on_the_device())
            if is_fsdp1(doc):  # FSDP1's host gradient buffer is made on the host
                extra.enter_context(O.fsdp1_host_gradients(split))
                if record is not None:  # and the host waits for the gradients' copies to it
                    extra.enter_context(O.waiting_for_gradient_copies(split))
            sides = extra.enter_context(recording_sides(backend))
        with workload.stack:  # the declared transformers' loss: the workload's (EstimateWorkload.prepare)
            result = run_protocol(workload, backend, device="cpu", steps=1)
    if result.oom or not result.complete:
        raise _err(doc, ("identity",), f"the simulated FSDP2 step stopped early ({result.oom_message})")
    out = {name: rec.figure for name, rec in result.phases.items()}
    if record is not None:
        from ledgerspec.derivations.shard.simulation import recorded

        record.append(recorded(backend, run_spec, source, out))
    out["activations"] = result.activations_saved or 0
    # as a measurement reads them (measurer.measured_components): held in the training steps, e.g. after FSDP1 has
    # cast the buffers to MixedPrecision.buffer_dtype at the first forward
    held = by_component(result.phases["steady_state_peak"].census)
    out["component.frozen_base"] = held.get("frozen_base", 0)
    out["component.adapter"] = held.get("adapter", 0)
    out["component.gradients"] = by_component(result.phases["backward_peak"].census).get("gradients", 0)
    out["component.optimizer"] = by_component(result.phases["optimizer_step_peak"].census).get("optimizer", 0)
    if offload:
        add_sides(out, sides, split)
    return out


def estimate_per_rank(
    doc: Document,
    world: int,
    descs: list[ParamDesc],
    target: str = "cuda",
    layers: str = "auto",
    progress: Progress | None = None,
    offline: bool = True,
    streams: bool = False,
) -> ShardEstimate:
    """The per-rank estimate of ``doc`` on ``world`` FSDP2 ranks (``descs``: the full model's descriptors).
    ``streams``: also each simulated rank's allocation stream at full depth (:attr:`RankEstimate.step`, for the
    device-level verdict; one more probe per rank), the figures unchanged."""
    started = time.perf_counter()
    say = progress or (lambda _msg: None)

    def refuse(spec: Any) -> None:
        if spec.quant is not None:
            why = qlora_shardable(spec.quant.storage_dtype, spec.loaded_dtype)
            if why:  # `shard` checks the document first; this guards direct callers
                raise _err(doc, ("base_model", "quantization", "storage_dtype"), why)
        if is_fsdp1(doc):  # FSDP1's storage checks are replaced for fake tensors: only on the torch they were read in
            from ledgerspec.derivations.shard.fsdp.storage_checks import refuse_unchecked_torch

            refuse_unchecked_torch(doc)

    spec, source, est_plan = prepare_trace(doc, target, layers, offline, refuse)
    if is_fsdp1(doc):  # transformers < 4.52's checkpoint around each unit: the backward peak is not affine in depth
        from ledgerspec.derivations.shard.fsdp.legacy_checkpoint import depth_plan

        est_plan = depth_plan(doc, spec, est_plan)
    reshard = reshard_after_forward_switch(doc)
    from ledgerspec.derivations.shard import state as S

    mp = mixed_precision(doc)
    if is_fsdp1(doc):  # ranks hold equal flat shards; their optimizer elements can differ
        p1 = S.fsdp1(
            S.peft_fsdp1_units(descs),
            world,
            spec.optimizer,
            reshard is not False,
            mp.param_dtype if mp else None,
            buffer_dtype=mp.buffer_dtype if mp else None,
        )
        layouts: dict[tuple[int, ...], list[int]] = {}
        for rs in p1.ranks:
            key = (rs.frozen_base, rs.adapter, rs.gradients, rs.optimizer, rs.optimizer_host)
            layouts.setdefault(key, []).append(rs.rank)
        groups = {members[0]: members for members in layouts.values()}
        # FULL_SHARD keeps the root gathered into backward (as FSDP2's default), SHARD_GRAD_OP every unit
        units = p1.unit_unsharded
        kept = S.fsdp1_kept_after_forward(p1, reshard)
    else:
        groups = rank_groups(descs, world)
        units = unit_unsharded_bytes(descs, world, mp.param_dtype if mp else None)
        kept = kept_after_forward(units, reshard)  # gathered parameters in "held after the forward"

    def simulate(src: Any, rank: int, record: list[Any] | None = None) -> dict[str, int]:
        return simulate_rank(doc, spec, src, target, world, rank, reshard, record)

    rank_figures = probe_runner(doc, source, est_plan, say, f"rank {{rank}} of {world}", simulate)
    rank_step = stream_runner(doc, source, est_plan, say, f"rank {{rank}} of {world}", simulate)
    by_rank: dict[int, RankEstimate] = {}
    offloaded = cpu_offload(doc) is not None
    for rep, members in groups.items():
        figures, step = simulated_rank(rep, rank_figures, rank_step if streams else None, offloaded)
        for r in members:
            by_rank[r] = RankEstimate.of(
                r,
                figures,
                max(0, figures["activations"] - kept),
                {k: figures[f"component.{k}"] for k in COMPONENTS},
                rep,
            )
            by_rank[r].step = step
    ranks = [by_rank[r] for r in range(world)]
    notes = [f"simulated rank(s) {', '.join(str(r) for r in groups)}; the others hold the same local rows"]
    from ledgerspec.derivations.estimate import legacy_loss

    method = method_text(world, reshard, est_plan, spec, target, mp.describe() if mp else None, is_fsdp1(doc))
    if ranks and ranks[0].host_peak is not None:
        from ledgerspec.derivations.shard.offload.fsdp import OFFLOAD_METHOD, describe

        method = f"{describe('fsdp1' if is_fsdp1(doc) else 'fsdp2')}: {OFFLOAD_METHOD}; {method}"
    if legacy_loss.models_shift_copy(doc):
        method += "; " + legacy_loss.method_note(doc)
    from ledgerspec.derivations.stack import legacy_moe

    if legacy_moe.applies(doc, source.config):
        method += "; " + legacy_moe.method_note(doc, source.config)
    from ledgerspec.derivations.shard.fsdp import legacy_checkpoint

    if is_fsdp1(doc) and legacy_checkpoint.models_outside_checkpoint(doc) and spec.gradient_checkpointing:
        method += "; " + legacy_checkpoint.method_note(doc)
    if spec.gradient_checkpointing and fsdp1_options(doc).activation_checkpointing:
        method += "; the checkpoint inside each FSDP unit (parallelism.activation_checkpointing)"
    if spec.loop != "trainer" and config.read(doc).training.loss_item_each_step:
        method += "; the loop reads its loss after each backward, where the host waits for the device "
        method += "(training.loss_item_each_step)"
    return ShardEstimate(
        world,
        reshard,
        target,
        ranks,
        est_plan,
        method,
        time.perf_counter() - started,
        notes,
        "fsdp1" if is_fsdp1(doc) else "fsdp2",
    )


def method_text(
    world: int,
    reshard: bool | None,
    est_plan: Plan,
    spec: Any,
    target: str,
    policy: str | None = None,
    fsdp1: bool = False,
) -> str:
    from ledgerspec.derivations.estimate.estimator import method_text as single

    how = "FSDP2 default" if reshard is None else f"reshard_after_forward={str(reshard).lower()}"
    if policy:
        how += f", {policy}"
    if fsdp1:
        how = (
            "FSDP1 FullyShardedDataParallel, use_orig_params, "
            + (
                "accelerate's transformer-based wrap (full fine-tuning), "
                if getattr(spec, "full", False)
                else "PEFT's fsdp_auto_wrap_policy, "
            )
            + ("SHARD_GRAD_OP" if reshard is False else "FULL_SHARD")
            + (f", {policy}" if policy else "")
            + "; FSDP1's data_ptr storage checks asked of the storages (fake tensors have no data pointers)"
        )
    return (
        f"ledgerspec shard --estimate: one {'FSDP1' if fsdp1 else 'FSDP2'} training step per rank simulated under "
        f"torch FakeTensorMode with a fake process group of {world} ranks ("
        + ("" if fsdp1 else "fully_shard per decoder layer + root, ")
        + f"{how}): the rank's padded "
        "shards, all-gathered units during compute, unsharded gradients before reduce-scatter and padded "
        "gradient shards after it, optimizer state of its rows, activations of its own microbatch (not "
        "sharded); ignores NCCL communicator/internal buffers, CUDA context and allocator caching, and stream "
        "overlap (one prefetched unit's all-gather may be in flight on a GPU); "
        + (
            "the packed 4-bit weights sharded like any parameter, their quantization constants whole on every rank; "
            if spec.quant is not None
            else ""
        )
        + single(est_plan, spec, target)
    )


__all__ = ["estimate_per_rank", "method_text", "rank_groups", "simulate_rank"]
