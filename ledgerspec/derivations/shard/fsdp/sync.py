"""FSDP1's ``sync_module_states``: each unit's parameters and buffers broadcast from rank 0 as FSDP1 wraps it.

What a GPU run does (torch 2.13 as installed, git cf30153c; ``distributed/fsdp/_init_utils.py``):
``_init_param_handle_from_module`` (563-642) first materialises the unit (``param_init_fn``, or moves it to the
device), then, with ``sync_module_states`` (619-641), calls ``_sync_module_params_and_buffers`` (1110-1167): the
unit's buffers not yet broadcast (``FSDP_SYNCED``; a nested unit's were broadcast with it), then its parameters not
yet flattened (``_get_orig_params``), go to ``_sync_params_and_buffers`` (``distributed/utils.py`` 318-328) with
``PARAM_BROADCAST_BUCKET_SIZE`` (line 60, 250 MiB), which calls ``dist._broadcast_coalesced``; only then is the
unit flattened into its ``FlatParameter`` and sharded. In C++ (``torch/csrc/distributed/c10d/comm.cpp``
``broadcast_coalesced``) the tensors are cut into buckets by ``compute_bucket_assignment_by_size`` (one bucket list
per dtype and device, a bucket closed once it reaches the limit, so it may exceed it), and each bucket is flattened
into one new tensor (``flatten_dense_tensors``: ``at::cat`` of the flattened tensors, or a view of a bucket's only
tensor, no allocation) and broadcast; at most two buckets are in flight: before a third is flattened the oldest is
waited for, copied back into its tensors (views of the flat tensor, ``copy_`` in place) and destroyed, which frees
its flat tensor. On a GPU, ``ProcessGroupNCCL`` records the NCCL stream on the broadcast tensor
(``recordStream`` in ``collective``, unless ``TORCH_NCCL_AVOID_RECORD_STREAMS``), so each free is pending: the
block goes back to the pool once the NCCL stream has finished with it.

The simulated ranks wrap on the CPU, where FSDP1 refuses ``sync_module_states`` (its module states must not be on
the CPU: ``_check_module_states_for_sync_module_states``, 1170-1180). :func:`broadcasting` lifts that one check for
fake tensors (they stand for the device's) and lets FSDP1's own code run the rest: the real
``dist._broadcast_coalesced`` over the fake process group (whose broadcast returns at once), whose ``at::cat``
goes through the dispatcher into the tracker. So the buckets, their order and the in-flight rule are torch's own;
what is added here is what the CPU cannot show: each flat bucket (and a lone tensor broadcast in place) is used on
the NCCL stream, so its free is logged as pending, and the host is taken to have moved on (every pending free
completed: a ``sync``) when the next unit's wrapping starts and when the wrapping ends. That is an assumption: the
host waits for the device nowhere there (rank 0 copies each unit's host weights from pageable memory, which waits
for its compute stream, and that stream waited for the broadcast), but the broadcast of one unit takes about a
millisecond on NVLink, far less than the host spends on a unit. The 4-bit layers' quantization constants, buffers of
the simulation's fake 4-bit layer, are a ``QuantState``'s attributes in a real run, not buffers: not broadcast.

``tests/truths/sync_module_states_probe.py`` observes the real sequence (two gloo ranks on the CPU, real FSDP1 with
that check lifted, its own dispatch-mode log): ``tests/derivations/shard/test_sync_module_states.py`` compares.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.derivations.shard.patching import patched
from ledgerspec.derivations.stack.sources import source_digest
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

#: where a ledger declares it (read with the other FSDP1 options: :func:`..options.fsdp1_options`)
FIELD = ("parallelism", "sync_module_states")
#: stands for the NCCL stream in a simulated rank's stream numbers (:func:`..simulation.stream_numbers`)
NCCL_STREAM = object()

#: the torch functions whose behaviour :func:`broadcasting` relies on (one replaced, the others wrapped), with the
#: SHA-256 of their source per torch release they were read in (as :mod:`.storage_checks` records its own)
CHECKED = {
    "2.13.0": {
        "torch.distributed.fsdp._init_utils._sync_module_params_and_buffers": (
            "287805318af7cf9ae5c4958a818e573709478878b68adae00239013ee17cf4d2"
        ),
        "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states": (
            "2ccdfaba108b6e5d2879b2074afc5fe0c17c7ec9210b07b1b8cd975ae6b952ba"
        ),
        "torch.distributed.fsdp._init_utils._init_param_handle_from_module": (
            "238df9c273a5a4405793efff1addc9ecaf7d4bbe82d2ad9cde8923d42f79881c"
        ),
        "torch.distributed.utils._sync_params_and_buffers": (
            "b654d468f28b3c8e712798f1357d142934b53d662e50df6db5b702d661947d7a"
        ),
    },
}


def unchecked_function() -> str | None:
    """Why the installed torch's functions are not the ones :func:`broadcasting` was written against, or None."""
    import torch

    for qualname in CHECKED[next(iter(CHECKED))]:
        module, name = qualname.rsplit(".", 1)
        function = getattr(importlib.import_module(module), name, None)
        if source_digest(function) not in {known.get(qualname) for known in CHECKED.values()}:
            return (
                f"torch {torch.__version__}'s {qualname} is not the function the FSDP1 sync_module_states "
                f"simulation was read against (torch {', '.join(CHECKED)})"
            )
    return None


@dataclass
class Broadcasts:
    """What :func:`broadcasting` saw, per call of ``_sync_params_and_buffers`` (one per unit with states): the
    event-log span ``(first, end)`` of the call, the bytes of each tensor broadcast, in order."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    tensors: list[list[int]] = field(default_factory=list)
    #: pending frees not yet completed by a ``sync``
    pending: bool = False


@contextlib.contextmanager
def broadcasting(tracker: Any, nccl_stream: int) -> Iterator[Broadcasts]:
    """FSDP1's ``sync_module_states`` in a simulated rank whose tracker keeps an event log: FSDP1's CPU refusal
    lifted, every flat bucket (and every lone tensor broadcast in place) used on stream ``nccl_stream`` (its free
    pending), a ``sync`` when the next unit starts and when the outermost wrapping ends (see the module docstring).
    """
    why = unchecked_function()
    if why is not None:
        raise LedgerspecError(why, rule="shard", hint="run `ledgerspec measure --nproc` instead", exit_code=EXIT_USAGE)
    import torch.distributed as dist
    import torch.distributed.fsdp._init_utils as init_utils
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ledgerspec.derivations.estimate.qlora import fake_4bit_linear_class

    seen = Broadcasts()
    sync_module, sync_tensors = init_utils._sync_module_params_and_buffers, init_utils._sync_params_and_buffers
    check_device, fsdp_init = init_utils._check_single_device_module, FullyShardedDataParallel.__init__
    fake_4bit = fake_4bit_linear_class()
    depth = [0]

    def settle() -> None:
        if seen.pending:
            tracker.sync(0)
            seen.pending = False

    def unit_starts(*args: Any, **kwargs: Any) -> Any:
        settle()  # the host has moved on to the next unit
        return check_device(*args, **kwargs)

    def module_states(module: Any, params: Any, process_group: Any) -> None:
        for m in module.modules():  # a real run's QuantState tensors are attributes, not buffers
            if isinstance(m, fake_4bit):
                for b in m.buffers(recurse=False):
                    setattr(b, init_utils.FSDP_SYNCED, True)
        sync_module(module, params, process_group)

    def broadcast(process_group: Any, states: list[Any], bucket_size: int, src: int) -> None:
        first = len(tracker.events)
        tracker.used_by = nccl_stream
        try:
            sync_tensors(process_group, states, bucket_size, src)
        finally:
            tracker.used_by = None
        if states:
            buckets, _ = dist._compute_bucket_assignment_by_size(states, [bucket_size])
            for bucket in buckets:  # a bucket's only tensor is broadcast in place (flatten_dense_tensors: a view)
                if len(bucket) == 1 and states[bucket[0]].is_contiguous():
                    tracker.record_stream(states[bucket[0]].untyped_storage(), nccl_stream)
            seen.pending = True
        seen.spans.append((first, len(tracker.events)))
        seen.tensors.append([int(t.numel() * t.element_size()) for t in states])

    def wrap(self: Any, *args: Any, **kwargs: Any) -> None:
        depth[0] += 1
        try:
            fsdp_init(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            settle()  # the wrapping is done: the host goes on to the optimizer and the data

    with patched(
        (init_utils, "_check_module_states_for_sync_module_states", lambda _states: None),
        (init_utils, "_sync_module_params_and_buffers", module_states),
        (init_utils, "_sync_params_and_buffers", broadcast),
        (init_utils, "_check_single_device_module", unit_starts),
        (FullyShardedDataParallel, "__init__", wrap),
    ):
        yield seen


__all__ = ["CHECKED", "FIELD", "NCCL_STREAM", "Broadcasts", "broadcasting", "unchecked_function"]
