"""Replay a stream of allocations and frees through the caching-allocator model.

Events (plain tuples, JSON-friendly):

- ``("alloc", id, nbytes, stream)``: a storage of ``nbytes`` (as requested, before rounding) on ``stream``;
  ``("alloc", id, nbytes, stream, False)``: a request no tensor tracker sees (a cuBLAS workspace,
  :mod:`.workspaces`), left out of the ``counted`` figures;
- ``("free", id)``: its release; ``("free", id, "pending")``: its release after another stream used it
  (``record_stream``): the block returns to the pool at a later ``sync``;
- ``("sync", keep)``: the other streams have caught up with all but the last ``keep`` pending releases;
- ``("phase", name)``: from here on the figures count for phase ``name`` (until the next marker);
- ``("settings", text)``: ``torch.cuda.memory._set_allocator_settings(text)``;
- ``("empty_cache",)``: ``torch.cuda.empty_cache()``.

The result says, per phase, the peak allocated and reserved bytes and what was held at its end (``allocated`` as the
allocator counts it: whole blocks, so a request served by a cached block less than 1 MiB larger counts that block;
``counted`` as the estimate's tracker counts it: each live request rounded up to 512 B), and the first
out-of-memory: which event, how much it asked for, what was allocated and reserved then, and how much of the
reserve was free but unusable (fragmentation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.derivations.allocator.caching import Block, CachingAllocator, LeanAllocator, OutOfMemory
from ledgerspec.derivations.allocator.config import AllocatorConfig, kMinBlockSize

Event = tuple[Any, ...]
#: the phase of the events before the first marker
START = "start"


@dataclass
class PhaseReplay:
    """One phase: peaks while it ran, and what was held when it ended."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    end_allocated: int = 0
    end_reserved: int = 0
    #: largest ``reserved - allocated`` seen in the phase (cached but unallocated bytes)
    peak_cached: int = 0
    #: the live requests, each rounded up to the replay's ``granularity`` (what the estimate's tracker counts): peak
    #: and at the end
    peak_counted: int = 0
    end_counted: int = 0


@dataclass
class ReplayOOM:
    """The first out-of-memory of a replay."""

    event: int  # index in the event list
    id: Any
    phase: str
    requested: int  # bytes asked for
    alloc_size: int  # bytes the allocator tried to get from cudaMalloc
    allocated: int  # after the release-and-retry path
    reserved: int
    capacity: int | None
    rejected: bool = False  # throw_on_cudamalloc_oom's pre-emptive rejection

    @property
    def free_unusable(self) -> int:
        """Reserved bytes no tensor held and that could not serve the request: fragmentation."""
        return self.reserved - self.allocated


@dataclass
class ReplayResult:
    phases: dict[str, PhaseReplay] = field(default_factory=dict)
    peak_allocated: int = 0
    peak_reserved: int = 0
    oom: ReplayOOM | None = None
    stats: dict[str, int] = field(default_factory=dict)
    segments: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0  # events replayed (up to and including the OOM)
    #: the blocks still allocated when the replay ended (by the events' ids): at an out-of-memory, what held the
    #: segments (``segments``' addresses are the blocks' ``ptr``)
    live: dict[Any, Block | None] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.oom is None


def replay(
    events: Iterable[Event],
    config: AllocatorConfig | str | None = None,
    capacity: int | None = None,
    device_total: int | None = None,
    memory_fraction: float | None = None,
    stop_at_oom: bool = True,
    allocator: CachingAllocator | None = None,
    granularity: int = kMinBlockSize,
    statistics: bool = True,
) -> ReplayResult:
    """Replay ``events`` (see the module docstring) through a fresh :class:`CachingAllocator` (or ``allocator``).

    ``config``: an :class:`AllocatorConfig` or a ``PYTORCH_CUDA_ALLOC_CONF`` string. ``capacity``: the bytes cudaMalloc
    can get (None: unlimited). ``memory_fraction``: ``torch.cuda.set_per_process_memory_fraction`` (needs
    ``device_total``). With ``stop_at_oom`` (the default) the replay ends at the first out-of-memory, as a training
    step would; otherwise the failed allocation is skipped (its free too) and the replay goes on. ``granularity``:
    what each request is rounded up to in the ``counted`` figures (512, the estimate's tracker for a CUDA target).
    ``statistics``: keep every counter of ``torch.cuda.memory_stats()`` in :attr:`ReplayResult.stats` (False: a
    :class:`~.caching.LeanAllocator`, the same decisions and figures, only the counters it keeps, a third less time).
    """
    if isinstance(config, str):
        config = AllocatorConfig.parse(config)
    if allocator is not None:
        alloc = allocator
    else:
        alloc = (CachingAllocator if statistics else LeanAllocator)(config, capacity, device_total)
    if memory_fraction is not None:
        alloc.set_memory_fraction(memory_fraction)
    live: dict[Any, Block | None] = {}
    counts: dict[Any, int] = {}
    counted = 0
    failed: set[Any] = set()
    result = ReplayResult()
    phase = START
    current = result.phases.setdefault(phase, PhaseReplay())
    n = 0
    # the allocator's current allocated and reserved bytes (``alloc.allocated``/``reserved``), read directly: the
    # same Stat objects for the whole replay
    allocated_now, reserved_now = alloc.stats["allocated_bytes"].all, alloc.stats["reserved_bytes"].all
    # the current phase's peaks, kept in locals while it runs and written back when it ends (the replay's hot loop)
    peak_allocated = peak_reserved = peak_cached = peak_counted = 0
    malloc, free = alloc.malloc, alloc.free  # bound once: the hot loop's two calls
    for n, event in enumerate(events):
        kind = event[0]
        if kind == "alloc":
            key, nbytes = event[1], int(event[2])
            stream = int(event[3]) if len(event) > 3 else 0
            if key in live:
                raise ValueError(f"event {n}: id {key!r} is already allocated")
            try:
                live[key] = malloc(nbytes, stream)
                counts[key] = size = -(-nbytes // granularity) * granularity if len(event) < 5 or event[4] else 0
                counted += size
            except OutOfMemory as exc:
                if result.oom is None:
                    result.oom = ReplayOOM(
                        n, key, phase, exc.requested, exc.alloc_size, exc.allocated, exc.reserved, exc.capacity,
                        exc.rejected,
                    )  # fmt: skip
                if stop_at_oom:
                    break
                failed.add(key)
                continue
        elif kind == "free":
            key = event[1]
            if key in failed:
                failed.discard(key)
                continue
            if key not in live:
                raise ValueError(f"event {n}: id {key!r} is not allocated")
            free(live.pop(key), len(event) > 2 and event[2] == "pending")
            counted -= counts.pop(key)
            # a free lowers the allocated (and counted) bytes and never changes the reserve: only the cache can grow
            cached = reserved_now.current - allocated_now.current
            if cached > peak_cached:
                peak_cached = cached
            continue
        elif kind == "sync":
            alloc.complete_pending(int(event[1]))
        elif kind == "phase":
            current.peak_allocated, current.peak_reserved = peak_allocated, peak_reserved
            current.peak_cached, current.peak_counted = peak_cached, peak_counted
            _close(current, alloc, counted)
            phase = str(event[1])
            current = result.phases.setdefault(phase, PhaseReplay())
            peak_allocated = max(current.peak_allocated, alloc.allocated)
            peak_reserved = max(current.peak_reserved, alloc.reserved)
            peak_cached = current.peak_cached
            peak_counted = max(current.peak_counted, counted)
            continue
        elif kind == "settings":
            alloc.set_allocator_settings(str(event[1]))
        elif kind == "empty_cache":
            alloc.empty_cache()
        else:
            raise ValueError(f"event {n}: unknown event {kind!r}")
        allocated, reserved = allocated_now.current, reserved_now.current
        if allocated > peak_allocated:
            peak_allocated = allocated
        if reserved > peak_reserved:
            peak_reserved = reserved
        if reserved - allocated > peak_cached:
            peak_cached = reserved - allocated
        if counted > peak_counted:
            peak_counted = counted
    current.peak_allocated, current.peak_reserved = peak_allocated, peak_reserved
    current.peak_cached, current.peak_counted = peak_cached, peak_counted
    _close(current, alloc, counted)
    if phase != START and result.phases[START] == PhaseReplay():
        del result.phases[START]
    result.events = n + 1 if result.oom is None or not stop_at_oom else result.oom.event + 1
    result.stats = alloc.memory_stats()
    # the allocator's own peaks; without statistics the allocated bytes' peak is the phases' (the allocated bytes only
    # grow when a request succeeds, at its end), while the reserve, always counted, can pass its phases' peak inside a
    # request that fails (expandable segments map some pages, then release them)
    result.peak_reserved = result.stats["reserved_bytes.all.peak"]
    result.peak_allocated = result.stats.get(
        "allocated_bytes.all.peak", max(p.peak_allocated for p in result.phases.values())
    )
    result.segments = alloc.segments()
    result.live = live
    return result


def _close(phase: PhaseReplay, alloc: CachingAllocator, counted: int) -> None:
    phase.end_allocated = alloc.allocated
    phase.end_reserved = alloc.reserved
    phase.end_counted = counted


def events_from_trace(trace: Sequence[dict[str, Any]]) -> list[Event]:
    """The ``alloc``/``free`` events of a ``device_traces`` entry list (``torch.cuda.memory._snapshot()``):
    ``alloc`` entries become allocations keyed by address, ``free_requested`` their frees; the allocator's own
    entries (``segment_*``, ``free_completed``, ``oom``, ``snapshot``) are what a replay predicts, so they are left
    out. A block freed and allocated again at the same address gets a fresh id."""
    out: list[Event] = []
    current: dict[int, int] = {}
    serial = 0
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            serial += 1
            current[int(entry["addr"])] = serial
            out.append(("alloc", serial, int(entry["size"]), int(entry.get("stream", 0))))
        elif action == "free_requested":
            key = current.pop(int(entry["addr"]), None)
            if key is not None:
                out.append(("free", key))
    return out


__all__ = ["START", "Event", "PhaseReplay", "ReplayOOM", "ReplayResult", "events_from_trace", "replay"]
