"""Each rank of a sharded step on the device: ``shard --estimate`` decided as ``estimate`` decides for one GPU.

A rank runs out of memory when its caching allocator cannot get another segment, not when its tensors reach the
card's size. :func:`ranks_on_device` takes the per-rank estimate of a sharded step with each simulated rank's
allocation stream at full depth (:func:`ledgerspec.derivations.shard.fsdp.simulate.estimate_per_rank` with
``streams=True``: every allocation on the stream FSDP made it on, so FSDP's all-gather, copy-in and reduce-scatter
buffers come from pools of their own, as the caching allocator keeps one pool per stream; DeepSpeed ZeRO's
:func:`ledgerspec.derivations.shard.zero.simulate.estimate_zero_per_rank` with ``streams=True``: its allocations on
one stream, :data:`ledgerspec.derivations.shard.zero.simulate.ONE_STREAM`) and replays each through
the allocator model against the capacity that rank's allocator can get: the device's total (CUDA's own when the
declared memory is a catalogue device's nominal one: :func:`ledgerspec.derivations.devices.target.cuda_total_of`)
minus what lies outside the allocator on that rank (:func:`ledgerspec.derivations.devices.target.outside_of`:
the ledger's ``outside_allocator.total``, else the catalogue for the named device with NCCL's buffers for the world
size). It is :func:`ledgerspec.derivations.devices.prediction.replay_on_device`, the single-GPU verdict, per rank:
the same free-and-retry, the same settings tried when fragmentation decides, and the same check that a margin is
not inside the outside-allocator catalogue's own range (``uncertain``: at the edge, it does not fit).

The host runs ahead of the device: FSDP1's ``record_stream`` frees are pending in the replay until the host waits
for the device (FSDP1's rate limiter, the Trainer's loss check): :func:`ledgerspec.derivations.shard.simulation.
device_waits`.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.devices.prediction import (
    DevicePrediction,
    _config,
    allocator_note,
    replay_on_device,
    workspaces_of,
)
from ledgerspec.derivations.devices.target import high_of, outside_of, stated, target_of

#: why a sharded verdict compares allocated tensors (the device-level one is not available), by what is declared
NOT_ON_DEVICE = {
    "cpu": "the CPU target has no caching allocator to replay",
}


def ranks_on_device(doc: Document, est: Any, device_memory: int, world: int, from_flag: bool = False) -> list[Any]:
    """Each rank's :class:`~ledgerspec.derivations.devices.prediction.DevicePrediction` for a device of
    ``device_memory`` bytes (``from_flag``: asked with ``--device-memory``), in rank order; ranks simulated as one
    share one replay. ``est``: a :class:`ledgerspec.derivations.shard.simulation.ShardEstimate` whose ranks hold
    their streams."""
    named = target_of(doc, device_memory, from_flag)
    figure = outside_of(doc, named, world)
    conf = (doc.get("software", "pytorch_cuda_alloc_conf").text() or "").strip()
    _config(doc, conf)
    by_step: dict[int, DevicePrediction] = {}
    out = []
    for r in est.ranks:
        if r.step is None:
            raise ValueError(f"rank {r.rank} has no allocation stream (estimate_per_rank(..., streams=True))")
        got = by_step.get(id(r.step))
        if got is None:
            # a paged optimizer's state for the catalogue's high end: this rank's, from its own estimate
            mine = stated(doc, named, figure, r.components.get("optimizer"), world)
            replayed = replay_on_device(
                doc,
                r.step,
                device_memory,
                mine.bytes,
                conf,
                est.target,
                cuda_total=named.cuda_total,
                outside_high=high_of(mine),
                workspaces=workspaces_of(doc, named),
            )
            got = by_step[id(r.step)] = DevicePrediction(named, mine, replayed, version_note=allocator_note(doc))
        out.append(got)
    return out


__all__ = ["NOT_ON_DEVICE", "ranks_on_device"]
