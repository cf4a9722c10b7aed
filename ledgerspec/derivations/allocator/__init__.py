"""``allocator``: a model of PyTorch's CUDA caching allocator (torch 2.13), to say what a step *reserves*.

The estimate predicts the bytes PyTorch tensors hold; a device runs out of memory when the caching allocator cannot
get another segment from ``cudaMalloc``. This room replays a step's allocations and frees through a model of the
allocator and reports reserved bytes over time, fragmentation, and whether (and where) an allocation would fail on
a device of a given capacity, after the allocator's free-and-retry path. Pure Python: no torch, except in
:mod:`.step`, which traces the estimate's step to get its events.

- :mod:`.config`: ``PYTORCH_CUDA_ALLOC_CONF`` as torch 2.13 parses it (:class:`AllocatorConfig`);
- :mod:`.caching`: :class:`CachingAllocator`, the model of ``DeviceCachingAllocator`` (pools, best fit, splitting,
  merging, garbage collection, release-and-retry, expandable segments, ``memory_stats`` and snapshot segments);
- :mod:`.replay`: :func:`replay`, an event stream through the model, peaks per phase and the first OOM;
- :mod:`.depth`: :func:`extend_stream`, the event stream of a full depth built, event by event, from three shallow
  probes' streams (or :class:`NotExtensible`, one line why);
- :mod:`.step`: :func:`replay_step`, the estimate's simulated step as an event stream (at a traced depth),
  replayed; :func:`reserved_step`, the entry point for reserved bytes: the step at the model's full depth (built
  from probes, else traced in full, saying why), replayed, per protocol phase, with the first out-of-memory.

Versions: the torch 2.13.0 wheel (``git_version`` cf30153c4c131c8164ee7798e5022d810682e2cb) ships the headers
``c10/core/AllocatorConfig.h``, ``c10/cuda/CUDAAllocatorConfig.h``, ``c10/cuda/CUDACachingAllocator.h`` and
``c10/core/CachingDeviceAllocator.h``, cited with exact line numbers. The ``.cpp`` sources are not in the wheel and
the 2.13 commit itself is not among the stored copies this was built from; the rules come from the two stored
versions of ``CUDACachingAllocator.cpp`` that bracket 2.13 (see :mod:`.caching`), which agree on every rule
modelled, and are cited by function and condition.
"""

from ledgerspec.derivations.allocator.caching import CachingAllocator, OutOfMemory
from ledgerspec.derivations.allocator.config import AllocatorConfig, AllocatorConfigError
from ledgerspec.derivations.allocator.depth import NotExtensible, extend_stream
from ledgerspec.derivations.allocator.replay import ReplayResult, replay
from ledgerspec.derivations.allocator.step import StepReplay, reserved_step

__all__ = [
    "AllocatorConfig",
    "AllocatorConfigError",
    "CachingAllocator",
    "NotExtensible",
    "OutOfMemory",
    "ReplayResult",
    "StepReplay",
    "extend_stream",
    "replay",
    "reserved_step",
]
