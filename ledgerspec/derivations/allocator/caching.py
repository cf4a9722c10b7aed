"""A model of PyTorch's CUDA caching allocator (``DeviceCachingAllocator`` of ``c10/cuda/CUDACachingAllocator.cpp``).

Pure Python, no torch. It replays ``malloc``/``free`` calls and keeps what the real allocator keeps: blocks in a
small (<= 1 MiB) and a large pool per stream, segments got from ``cudaMalloc`` (or pages mapped into expandable
segments), block splitting and merging, the release-and-retry path when ``cudaMalloc`` fails, garbage collection,
and the statistics of ``torch.cuda.memory_stats()``.

Where each rule comes from: every method below names the C++ function it follows and quotes its condition. The
functions were read in the stored copy cyyever/pytorch@076f02792ce54ef5fe47818d061755430c9973e1
(``c10/cuda/CUDACachingAllocator.cpp``, a fork of main at 2.15.0a0) and in an earlier stored copy of the same
file that already has ``AcceleratorAllocatorConfig::large_segment_size`` (added by pytorch/pytorch#172056, January
2026) but not yet ``throw_on_cudamalloc_oom``; torch 2.13.0 (cf30153c) lies between the two (its headers, shipped
in the wheel, declare ``throw_on_cudamalloc_oom`` and ``large_segment_size``), and every rule modelled here reads
the same in both, except the two noted where they apply (the pre-emptive rejection of ``throw_on_cudamalloc_oom``,
present in 2.13's header; the rounding of ``allowed_memory_maximum``). The tool that stores those copies gives
character offsets, not line numbers, so rules are cited by function and by the condition they test.

Cross-stream uses: a block another stream used (``record_stream``) is freed with ``pending=True``: ``free`` then
``insert_events`` (``if (!block->stream_uses.empty())``): it no longer counts as allocated, but it goes back to its
pool only when the other stream's work up to the free has completed (``process_events`` at the next ``malloc``), which
the replay is told by :meth:`CachingAllocator.complete_pending`; ``release_cached_blocks`` (``empty_cache`` and the
out-of-memory path) first waits for all of them (``synchronize_and_free_events``).

What is not modelled: CUDA graph private pools and
``MemPool``s, IPC, ``cudaMallocAsync``, the free-memory callbacks, and where the driver places a segment (addresses
are handed out upwards, never reused, so ties between equal-size free blocks go to the older segment, as
``BlockComparatorSizeCounterAddress`` also orders them by segment registration first).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.derivations.allocator.config import (
    SIZE_MAX,
    AllocatorConfig,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
)

#: ``NativeCachingAllocator::allocate``: "Tried to allocate more than 1EB memory"
ONE_EXA_BYTES = 1152921504606846976
#: where the model hands out device addresses (any 2 MiB-aligned base will do)
_ADDRESS_BASE = 0x7F0000000000
POOLS = ("all", "small_pool", "large_pool")
STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)


# -- statistics (c10/core/CachingDeviceAllocator.h, struct DeviceStats) ---------------------------------------------


@dataclass(slots=True)
class Stat:
    """``c10::CachingAllocator::Stat``: current, peak, and the totals ever added and removed."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def increase(self, amount: int) -> None:
        current = self.current + amount
        self.current = current
        if current > self.peak:
            self.peak = current
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current


class StatArray:
    """One :class:`Stat` per pool kind: ``all`` (AGGREGATE), ``small_pool``, ``large_pool``."""

    def __init__(self) -> None:
        self.by_pool = {p: Stat() for p in POOLS}
        # the same Stat objects, read without a dict lookup (the replay's hottest path)
        self._all = self.by_pool["all"]
        self._small, self._large = self.by_pool["small_pool"], self.by_pool["large_pool"]

    # Stat.increase and Stat.decrease written out for the aggregate and the pool: the replay's hottest path (five
    # arrays change per allocation and per free; two calls fewer each)
    def increase(self, small: bool, amount: int) -> None:
        s = self._all
        current = s.current + amount
        s.current = current
        if current > s.peak:
            s.peak = current
        s.allocated += amount
        s = self._small if small else self._large
        current = s.current + amount
        s.current = current
        if current > s.peak:
            s.peak = current
        s.allocated += amount

    def decrease(self, small: bool, amount: int) -> None:
        s = self._all
        s.current -= amount
        s.freed += amount
        s = self._small if small else self._large
        s.current -= amount
        s.freed += amount

    def change(self, small: bool, amount: int) -> None:
        if amount > 0:
            self.increase(small, amount)
        elif amount < 0:
            self.decrease(small, -amount)

    @property
    def all(self) -> Stat:
        return self._all


@dataclass
class DeviceStats:
    """``DeviceStats`` (CachingDeviceAllocator.h lines 14-70 of torch 2.13), the parts this model changes."""

    arrays: dict[str, StatArray] = field(default_factory=lambda: {name: StatArray() for name in STATS})
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_sync_all_streams: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0
    num_oom_rejections: int = 0
    oversize_allocations: Stat = field(default_factory=Stat)
    oversize_segments: Stat = field(default_factory=Stat)

    def __getitem__(self, name: str) -> StatArray:
        return self.arrays[name]


# -- blocks, pools, segments ----------------------------------------------------------------------------------------


class ExpandableSegment:
    """``ExpandableSegment``: a reserved virtual range (enough for 9/8 of the device's memory) mapped page by page,
    2 MiB pages for the small pool and ``large_segment_size`` pages for the large pool."""

    def __init__(self, ptr: int, page: int, pages: int, stream: int) -> None:
        self.ptr = ptr
        self.page = page
        self.max_pages = pages
        self.stream = stream

    @property
    def size(self) -> int:
        return self.page * self.max_pages

    def left(self, p: int) -> int:
        """``segmentLeft``: the page holding address ``p``."""
        return (p - self.ptr) // self.page

    def right(self, p: int) -> int:
        """``segmentRight``: the first page boundary at or after ``p``."""
        return -(-(p - self.ptr) // self.page)


class Block:
    """``struct Block``: a piece of a segment, allocated or free, linked to its neighbours."""

    __slots__ = (
        "allocated",
        "event_count",
        "expandable",
        "gc_count_base",
        "mapped",
        "next",
        "prev",
        "ptr",
        "requested_size",
        "size",
        "small",
        "stream",
    )

    def __init__(
        self, stream: int, size: int, small: bool, ptr: int, expandable: ExpandableSegment | None = None
    ) -> None:
        self.stream = stream
        self.size = size
        self.small = small
        self.ptr = ptr
        self.expandable = expandable
        self.allocated = False
        #: outstanding events of other streams' uses: a freed block waiting for them (``pending``) is not free yet
        self.event_count = 0
        self.mapped = True
        self.requested_size = 0
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_count_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """``Block::splice``: insert this block between ``before`` and ``after``."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def key(self) -> tuple[int, int, int]:
        """The free-list order (``BlockComparatorSizeCounterAddress``): stream, size, then address."""
        return (self.stream, self.size, self.ptr)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block({state}, size={self.size}, ptr={self.ptr:#x}, stream={self.stream})"


class BlockPool:
    """``struct BlockPool``: the free blocks of one pool kind, best-fit ordered, plus the unmapped tails of its
    expandable segments (ordered by stream and address, ``BlockComparatorAddress``)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self._keys: list[tuple[int, int, int]] = []
        self._blocks: dict[tuple[int, int, int], Block] = {}
        self.unmapped: dict[int, Block] = {}
        self.get_free_blocks_call_count = 0

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: also stamps the block's garbage-collection age base."""
        block.gc_count_base = self.get_free_blocks_call_count
        k = block.key()
        bisect.insort(self._keys, k)
        self._blocks[k] = block

    def erase(self, block: Block) -> None:
        k = block.key()
        i = bisect.bisect_left(self._keys, k)
        if i < len(self._keys) and self._keys[i] == k and self._blocks.get(k) is block:
            del self._keys[i]
            del self._blocks[k]
        else:  # pragma: no cover - a bookkeeping error in the model, never user input
            raise AssertionError(f"{block} is not in the pool")

    def erase_at(self, i: int) -> None:
        """``erase`` of the block at position ``i`` (found by :meth:`lower_bound` and :meth:`at`)."""
        del self._blocks[self._keys.pop(i)]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect.bisect_left(self._keys, (stream, size, -1))

    def at(self, i: int) -> Block | None:
        return self._blocks[self._keys[i]] if 0 <= i < len(self._keys) else None

    def blocks(self) -> list[Block]:
        return [self._blocks[k] for k in self._keys]

    def __len__(self) -> int:
        return len(self._keys)

    def gc_count(self, block: Block) -> int:
        return self.get_free_blocks_call_count - block.gc_count_base

    def unmapped_in_order(self, stream: int) -> list[Block]:
        return sorted((b for b in self.unmapped.values() if b.stream == stream), key=lambda b: b.ptr)


class OutOfMemory(RuntimeError):
    """``torch.OutOfMemoryError`` as the model raises it: what was asked, what the allocator held then."""

    def __init__(
        self,
        requested: int,
        alloc_size: int,
        allocated: int,
        reserved: int,
        capacity: int | None,
        stream: int,
        rejected: bool = False,
    ) -> None:
        self.requested = requested
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        self.stream = stream
        self.rejected = rejected
        cap = "unlimited" if capacity is None else f"{capacity} B"
        if rejected:
            text = (
                f"CUDA out of memory (model). Allocation was preemptively rejected because it would exceed "
                f"per_process_memory_fraction limit. Requested size: {requested} B"
            )
        else:
            text = (
                f"CUDA out of memory (model). Tried to allocate {alloc_size} B ({requested} B requested); "
                f"capacity for the allocator {cap}; {allocated} B is allocated by PyTorch, and "
                f"{reserved - allocated} B is reserved by PyTorch but unallocated"
            )
        super().__init__(text)

    @property
    def free_unusable(self) -> int:
        """Reserved but unallocated bytes the allocator could not use (fragmentation), after its release attempts."""
        return self.reserved - self.allocated


@dataclass(slots=True)
class _Params:
    """``AllocParams``: one request in flight."""

    stream: int
    size: int
    pool: BlockPool
    alloc_size: int
    expandable: bool
    block: Block | None = None
    rejected: bool = False


class CachingAllocator:
    """One device's caching allocator.

    ``capacity``: the bytes ``cudaMalloc`` can get for this allocator (the device's memory minus what lies outside
    it: the CUDA context, other processes, NCCL and cuBLAS workspaces); None: unlimited. ``device_total``: the
    device's total memory (``totalGlobalMem``), which ``per_process_memory_fraction`` and the expandable segments'
    address reservation are relative to; defaults to ``capacity``. ``record_history``: keep a trace like
    ``torch.cuda.memory._snapshot()['device_traces'][0]`` (:attr:`trace`).
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity: int | None = None,
        device_total: int | None = None,
        record_history: bool = False,
    ) -> None:
        self.config = config if config is not None else AllocatorConfig()
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        self.stats = DeviceStats()
        #: the allocated bytes' aggregate counter (``allocated``), held for the hot path
        self._allocated_now = self.stats["allocated_bytes"].all
        self.small_blocks = BlockPool(small=True)
        self.large_blocks = BlockPool(small=False)
        self.active_blocks: set[Block] = set()
        self.expandable_segments: list[ExpandableSegment] = []
        #: ``total_allocated_memory``: every byte got from cudaMalloc or mapped (what ``reserved_bytes`` counts)
        self.total_allocated_memory = 0
        self.allowed_memory_maximum: int | None = None
        self._next_address = _ADDRESS_BASE
        self.trace: list[dict[str, Any]] | None = [] if record_history else None
        #: freed blocks another stream used, in the order freed, waiting for that stream (``cuda_events``)
        self.pending: list[Block] = []
        # DeviceCachingAllocator's constructor: setMemoryFraction(per_process_memory_fraction)
        self.set_memory_fraction(self.config.per_process_memory_fraction)

    # -- settings ------------------------------------------------------------------------------------------------
    def set_allocator_settings(self, text: str) -> None:
        """``torch.cuda.memory._set_allocator_settings(text)``: parsed on top of the current settings."""
        self.config = AllocatorConfig.parse(text, self.config)

    def set_memory_fraction(self, fraction: float) -> None:
        """``setMemoryFraction``: below 1, ``allowed_memory_maximum = round(fraction * totalGlobalMem)``; 1 lifts it.

        The earlier stored copy truncates, the later one rounds (``std::round``); PyTorch's own test of this
        (``test_max_split_expandable``: ``int(round(fraction_allowed * all_memory)) == total_allowed``) expects the
        rounding, so this rounds."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction: {fraction}. Please set within [0, 1].")
        self.allowed_memory_maximum = None
        if fraction < 1.0:
            if self.device_total is None:
                raise ValueError("a memory fraction needs the device's total memory (device_total)")
            self.allowed_memory_maximum = math.floor(fraction * self.device_total + 0.5)

    @property
    def gc_enabled(self) -> bool:
        """``malloc``/``get_free_block``: garbage collection runs only with a memory fraction set
        (``allowed_memory_maximum.has_value() && garbage_collection_threshold() > 0.0``)."""
        return self.allowed_memory_maximum is not None and self.config.garbage_collection_threshold > 0.0

    # -- public API ----------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        """``NativeCachingAllocator::allocate`` then ``DeviceCachingAllocator::malloc``: a block of at least
        ``nbytes`` on ``stream``. Zero bytes allocate nothing (``allocate``: ``if (size != 0)``; returns None).
        Raises :class:`OutOfMemory`."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if nbytes >= ONE_EXA_BYTES:
            raise OutOfMemory(nbytes, nbytes, self.allocated, self.reserved, self.capacity, stream)
        if nbytes == 0:
            return None
        size = self.round_size(nbytes)
        pool = self.small_blocks if size <= kSmallSize else self.large_blocks  # get_pool
        p = _Params(stream, size, pool, self.get_allocation_size(size), self.config.expandable_segments)
        found = self._get_free_block(p)
        if not found:
            if self.gc_enabled:
                self._garbage_collect_cached_blocks()
            found = self._alloc_block(p, is_retry=False)
            if not found and not p.rejected:
                # malloc's retry chain: release enough oversize cached blocks, else every unsplit cached block
                found = (self._release_available_cached_blocks(p) and self._alloc_block(p, is_retry=False)) or (
                    self._release_cached_blocks() and self._alloc_block(p, is_retry=True)
                )
        if not found:
            if not p.rejected:
                self.stats.num_ooms += 1
                self._record("oom", 0, size, stream)
            raise OutOfMemory(
                nbytes, p.alloc_size, self.allocated, self.reserved, self.capacity, stream, rejected=p.rejected
            )
        assert p.block is not None
        split = self._should_split(p.block, size, p.expandable)
        return self._alloc_found_block(p, nbytes, split)

    def free(self, block: Block | None, pending: bool = False) -> None:
        """``free_locked``: ``free_block`` at once, or with ``pending`` (another stream used the block:
        ``insert_events``) no longer allocated but kept out of the pool until :meth:`complete_pending`. None is a
        no-op."""
        if block is None:
            return
        if not block.allocated:
            raise ValueError(f"{block} is not allocated")
        block.allocated = False
        self._count_freed(block)
        self._record("free_requested", block.ptr, block.requested_size, block.stream)
        if pending:
            block.event_count = 1
            self.pending.append(block)
            return
        self._free_block(block)

    def complete_pending(self, keep: int = 0) -> None:
        """``process_events``: the other streams have completed the work recorded before the last ``keep`` pending
        frees; every earlier pending block goes back to its pool (``free_block``), oldest first."""
        done = len(self.pending) - max(0, keep)
        if done <= 0:
            return
        finished, self.pending = self.pending[:done], self.pending[done:]
        for block in finished:
            block.event_count = 0
            self._free_block(block)

    def empty_cache(self) -> None:
        """``emptyCache``: ``release_cached_blocks``."""
        self._release_cached_blocks()

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``."""
        for array in self.stats.arrays.values():
            for stat in array.by_pool.values():
                stat.reset_peak()
        self.stats.oversize_allocations.reset_peak()
        self.stats.oversize_segments.reset_peak()

    @property
    def allocated(self) -> int:
        return self._allocated_now.current

    @property
    def reserved(self) -> int:
        return self.stats["reserved_bytes"].all.current

    def memory_stats(self) -> dict[str, int]:
        """Keys and values as ``torch.cuda.memory_stats()`` names them (``allocated_bytes.all.peak``, ...)."""
        out: dict[str, int] = {}
        for name, array in self.stats.arrays.items():
            for pool, stat in array.by_pool.items():
                for metric in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{metric}"] = getattr(stat, metric)
        for name in ("oversize_allocations", "oversize_segments"):
            stat = getattr(self.stats, name)
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{metric}"] = getattr(stat, metric)
        for name in (
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "num_oom_rejections",
        ):
            out[name] = getattr(self.stats, name)
        out["max_split_size"] = -1 if self.config.max_split_size == SIZE_MAX else self.config.max_split_size
        return out

    def segments(self) -> list[dict[str, Any]]:
        """``snapshot()`` as ``torch.cuda.memory._snapshot()['segments']`` has it: one entry per cudaMalloc segment
        (per contiguous mapped range of an expandable segment), by address, with its blocks."""
        heads = [
            b
            for b in self._all_blocks()
            if b.mapped and (b.prev is None or not b.prev.mapped)  # snapshot: skip blocks whose prev is mapped
        ]
        out = []
        for head in sorted(heads, key=lambda b: b.ptr):
            blocks = []
            b: Block | None = head
            total = allocated = requested = 0
            while b is not None and b.mapped:
                state = "active_allocated" if b.allocated else "active_pending_free" if b.event_count else "inactive"
                blocks.append({"address": b.ptr, "size": b.size, "requested_size": b.requested_size, "state": state})
                total += b.size
                if b.allocated:
                    allocated += b.size
                    requested += b.requested_size
                b = b.next
            out.append(
                {
                    "address": head.ptr,
                    "total_size": total,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": requested,
                    "stream": head.stream,
                    "segment_type": "small" if head.small else "large",
                    "is_expandable": head.expandable is not None,
                    "blocks": blocks,
                }
            )
        return out

    def free_bytes_unusable(self) -> int:
        """Reserved bytes no allocation holds now (``reserved - allocated``)."""
        return self.reserved - self.allocated

    # -- sizes ---------------------------------------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        """``round_size``: below kMinBlockSize (512) it is 512; with ``roundup_power2_divisions`` d > 1 for the
        size's interval and ``size > kMinBlockSize * d``, the next of d steps between the powers of two
        (``roundup_power2_next_division``); else the next multiple of 512."""
        if size < kMinBlockSize:
            return kMinBlockSize
        if self.config.plain_rounding:
            return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)
        divisions = self.config.roundup_divisions(size)
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
        return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)

    def get_allocation_size(self, size: int) -> int:
        """``get_allocation_size``: ``size <= kSmallSize`` -> kSmallBuffer (2 MiB); ``size < kMinLargeAlloc``
        (10 MiB) -> ``large_segment_size()`` (20 MiB); else a multiple of kRoundLarge (2 MiB)."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return self.config.large_segment_size
        return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)

    # -- the search ----------------------------------------------------------------------------------------------
    def _get_free_block(self, p: _Params) -> bool:
        """``get_free_block``: the smallest free block of the stream that fits (``pool.blocks.lower_bound``), with
        the expandable-segment preference and the two oversize rules:
        ``(p.size() < max_split_size) && (block->size >= max_split_size)`` -> none, and
        ``(p.size() >= max_split_size) && (block->size >= p.size() + max_non_split_rounding_size)`` -> none."""
        pool = p.pool
        if self.gc_enabled:
            pool.get_free_blocks_call_count += 1
        i = pool.lower_bound(p.stream, p.size)
        block = pool.at(i)
        if block is None or block.stream != p.stream:
            return False
        if block.expandable is not None:
            if p.expandable:
                # best fit by the size a block can grow to (its free size plus an unmapped tail behind it)
                def expandable_size(b: Block) -> int:
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

                nxt = pool.at(i + 1)
                while (
                    block.expandable is not None
                    and nxt is not None
                    and nxt.stream == p.stream
                    and expandable_size(nxt) < expandable_size(block)
                ):
                    i += 1
                    block = nxt
                    nxt = pool.at(i + 1)
            else:  # expandable segments turned off since: only non-expandable blocks
                i += 1
                while (b := pool.at(i)) is not None and b.expandable is not None and b.stream == p.stream:
                    i += 1
                b = pool.at(i)
                if b is None or b.stream != p.stream:
                    return False
                block = b
        limit = self.config.max_split_size
        if p.size < limit and block.size >= limit:
            return False
        if p.size >= limit and block.size >= p.size + self.config.max_non_split_rounding_size:
            return False
        pool.erase_at(i)  # the block at i (pool.at(i)): no second search
        p.block = block
        return True

    def _should_split(self, block: Block, size: int, expandable: bool) -> bool:
        """``should_split``: small pool or expandable segments: ``remaining >= kMinBlockSize``; large pool:
        ``(size < max_split_size) && (remaining > kSmallSize)``."""
        remaining = block.size - size
        if block.small or expandable:
            return remaining >= kMinBlockSize
        return size < self.config.max_split_size and remaining > kSmallSize

    def _alloc_found_block(self, p: _Params, orig_size: int, split: bool) -> Block:
        """``alloc_found_block``: split off the first ``size`` bytes (the rest goes back to the pool), mark it
        allocated, count it."""
        assert p.block is not None
        block = p.block
        size = p.size
        already_split = block.is_split()
        if split:
            remaining = block
            block = Block(p.stream, size, remaining.small, remaining.ptr, remaining.expandable)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            p.pool.insert(remaining)
            if already_split and block.expandable is None:
                # an already-split inactive block is shrunk by size bytes
                self._count_inactive_split(block.small, 0, -block.size)
            elif block.expandable is None:
                # a new split inactive block is created from a previously unsplit block
                self._count_inactive_split(block.small, 1, remaining.size)
        elif already_split and block.expandable is None:
            # an already-split block is becoming active
            self._count_inactive_split(block.small, -1, -block.size)
        block.allocated = True
        block.requested_size = orig_size
        self._record("alloc", block.ptr, orig_size, block.stream)
        self.active_blocks.add(block)
        self._count_allocated(block)
        return block

    # -- freeing -------------------------------------------------------------------------------------------------
    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``), back into the pool, update the
        inactive-split counts (not for expandable segments) and the active counts."""
        self._record("free_completed", block.ptr, block.requested_size, block.stream)
        original_size = block.size
        requested = block.requested_size
        pool = self._pool_of(block)
        net_blocks = 0
        net_size = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge_blocks(block, candidate, pool)
            if subsumed > 0:
                net_blocks -= 1
                net_size -= subsumed
        self.active_blocks.discard(block)
        pool.insert(block)
        if block.is_split():
            net_blocks += 1
            net_size += block.size
        if block.expandable is None:
            self._count_inactive_split(block.small, net_blocks, net_size)
        self._count_inactive(block.small, original_size, requested)

    # -- the statistics a block's life changes (LeanAllocator: only the allocated bytes) ---------------------------
    def _count_allocated(self, block: Block) -> None:
        """``alloc_found_block``'s counters: one allocation and one active block more, their bytes, the bytes
        requested, and an oversize allocation (``size >= max_split_size``)."""
        arrays, small, size = self.stats.arrays, block.small, block.size
        arrays["allocation"].increase(small, 1)
        arrays["allocated_bytes"].increase(small, size)
        arrays["active"].increase(small, 1)
        arrays["active_bytes"].increase(small, size)
        arrays["requested_bytes"].increase(small, block.requested_size)
        if size >= self.config.max_split_size:
            self.stats.oversize_allocations.increase(1)

    def _count_freed(self, block: Block) -> None:
        """``free``'s counters: one allocation fewer (the block stays active until ``free_block``)."""
        arrays = self.stats.arrays
        arrays["allocation"].decrease(block.small, 1)
        arrays["allocated_bytes"].decrease(block.small, block.size)
        if block.size >= self.config.max_split_size:
            self.stats.oversize_allocations.decrease(1)

    def _count_inactive(self, small: bool, size: int, requested: int) -> None:
        """``free_block``'s counters: one active block fewer, its bytes and the bytes it was requested for."""
        arrays = self.stats.arrays
        arrays["active"].decrease(small, 1)
        arrays["active_bytes"].decrease(small, size)
        arrays["requested_bytes"].decrease(small, requested)

    def _count_inactive_split(self, small: bool, blocks: int, nbytes: int) -> None:
        """The inactive split blocks (free pieces of a split segment; not counted for expandable segments)."""
        arrays = self.stats.arrays
        arrays["inactive_split"].change(small, blocks)
        arrays["inactive_split_bytes"].change(small, nbytes)

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: absorb a free neighbour with the same mapping state; returns its size (0: none)."""
        if src is None or src.allocated or src.event_count > 0 or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            del pool.unmapped[id(src)]
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- getting memory from CUDA --------------------------------------------------------------------------------
    def _cuda_malloc(self, size: int) -> int | None:
        """cudaMalloc: fails when the allocator's reserve plus ``size`` exceeds the capacity."""
        if self.capacity is not None and self.total_allocated_memory + size > self.capacity:
            return None
        return self._take_addresses(size)

    def _take_addresses(self, size: int) -> int:
        ptr = self._next_address
        self._next_address += -(-size // kSmallBuffer) * kSmallBuffer
        return ptr

    def _alloc_block(self, p: _Params, is_retry: bool) -> bool:
        """``alloc_block``: a new segment of ``alloc_size`` bytes (or pages mapped into an expandable segment).

        ``allowed_memory_maximum`` (a memory fraction) is checked first
        (``total_allocated_memory + size > allowed_memory_maximum`` -> fail), then, with
        ``throw_on_cudamalloc_oom``, the pre-emptive rejection (``total_allocated_memory + size >
        per_process_memory_fraction * device_total`` -> rejected, no retry), then cudaMalloc or
        ``try_allocate_expandable_block``."""
        size = p.alloc_size
        if is_retry:
            self.stats.num_alloc_retries += 1
        if self.allowed_memory_maximum is not None and self.total_allocated_memory + size > self.allowed_memory_maximum:
            return False
        if self.config.throw_on_cudamalloc_oom:
            total = self.device_total if self.device_total is not None else math.inf
            if self.total_allocated_memory + size > self.config.per_process_memory_fraction * total:
                self.stats.num_oom_rejections += 1
                p.rejected = True
                return False
        if p.expandable:
            p.block = self._try_allocate_expandable_block(p.stream, p.pool, p.size)
            return p.block is not None
        ptr = self._cuda_malloc(size)
        if ptr is None:
            return False
        self.total_allocated_memory += size
        p.block = Block(p.stream, size, p.pool.small, ptr)
        self.stats["segment"].increase(p.pool.small, 1)
        self.stats["reserved_bytes"].increase(p.pool.small, size)
        if size >= self.config.max_split_size:
            self.stats.oversize_segments.increase(1)
        self.stats.num_device_alloc += 1
        self._record("segment_alloc", ptr, size, p.stream)
        return True

    def _release_available_cached_blocks(self, p: _Params) -> bool:
        """``release_available_cached_blocks``: only with a ``max_split_size`` set
        (``max_split_size() == numeric_limits<size_t>::max()`` -> false). cudaFree the smallest cached block of at
        least ``max(size, max_split_size)``; if there is none (or it is expandable), cudaFree oversize blocks from
        the largest smaller one down until that many bytes are freed (expandable blocks are skipped)."""
        limit = self.config.max_split_size
        if limit == SIZE_MAX:
            return False
        pool = p.pool
        key_size = max(p.size, limit)
        i = pool.lower_bound(p.stream, key_size)
        block = pool.at(i)
        if block is None or block.stream != p.stream or block.expandable is not None:
            # no single block is large enough: free oversize blocks, starting with the largest
            if i == 0:
                return False
            released = 0
            i -= 1
            while (
                released < key_size and (cur := pool.at(i)) is not None and cur.size >= limit and cur.stream == p.stream
            ):
                first = i == 0
                if not first:
                    i -= 1
                if cur.expandable is None:
                    released += cur.size
                    self._release_block(cur)
                if first:
                    break
            return released >= key_size
        self._release_block(block)
        return True

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` (default pool, no capture): ``synchronize_and_free_events`` (every pending
        block back to its pool), then ``release_blocks`` of the large and the small pool."""
        self.complete_pending(0)
        self.stats.num_sync_all_streams += 1
        self._release_blocks(self.large_blocks)
        self._release_blocks(self.small_blocks)
        return True

    def _release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: cudaFree every unsplit free block; unmap the free pages of expandable segments and
        drop a segment left with nothing mapped."""
        to_unmap = []
        for block in pool.blocks():
            if block.expandable is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if block.prev is None and block.next is None:
                self._release_expandable_segment(block)

    def _release_block(self, block: Block) -> None:
        """``release_block``: cudaFree one whole segment."""
        self.stats.num_device_free += 1
        self._record("segment_free", block.ptr, block.size, block.stream)
        self.total_allocated_memory -= block.size
        self.stats["segment"].decrease(block.small, 1)
        self.stats["reserved_bytes"].decrease(block.small, block.size)
        if block.size >= self.config.max_split_size:
            self.stats.oversize_segments.decrease(1)
        self._pool_of(block).erase(block)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above ``garbage_collection_threshold * allowed_memory_maximum``
        reserved, free unsplit large cached blocks at least as old (in ``get_free_block`` calls since they were
        cached) as the average, until the excess is reclaimed or nothing is freed."""
        if self.allowed_memory_maximum is None:
            return
        threshold = int(self.config.garbage_collection_threshold * self.allowed_memory_maximum)
        if self.total_allocated_memory <= threshold:
            return
        target = self.total_allocated_memory - threshold
        reclaimed = 0
        pool = self.large_blocks
        candidates = [b for b in pool.blocks() if not b.is_split()]
        total_age = sum(pool.gc_count(b) for b in candidates)
        count = len(candidates)
        if count == 0:
            return
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in pool.blocks():
                if not block.is_split() and block.expandable is None and pool.gc_count(block) >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= pool.gc_count(block)
                    count -= 1
                    self._release_block(block)

    # -- expandable segments -------------------------------------------------------------------------------------
    def _find_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block | None:
        """``find_expandable_block``: the lowest address of the stream's expandable segments where ``size`` bytes
        of free and unmapped space follow each other; else a new segment (a virtual reservation for 9/8 of the
        device, in pages of 2 MiB or ``large_segment_size``), None when even that is too small."""

        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated and b.event_count == 0

        def has_space(b: Block | None) -> bool:
            total = 0
            while total < size and b is not None and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        for c in pool.unmapped_in_order(stream):
            start: Block = c.prev if c.prev is not None and allocatable(c.prev) else c
            if has_space(start):
                return start
        page = kSmallBuffer if pool.small else self.config.large_segment_size
        total = self.device_total if self.device_total is not None else 1 << 46
        pages = -(-(total + total // 8) // page)
        es = ExpandableSegment(self._take_addresses(page * pages), page, pages, stream)
        if es.size < size:
            return None
        self.expandable_segments.append(es)
        candidate = Block(stream, es.size, pool.small, es.ptr, es)
        candidate.mapped = False
        pool.unmapped[id(candidate)] = candidate
        return candidate

    def _map_block(self, to_map: Block, size: int) -> bool:
        """``map_block``: map the pages under the first ``size`` bytes of an unmapped block (``ExpandableSegment::
        map``: page by page, all or nothing), split the unmapped rest off, merge with free mapped neighbours."""
        es = to_map.expandable
        assert es is not None and not to_map.mapped
        begin, end = es.left(to_map.ptr), es.right(to_map.ptr + size)
        if begin == end:
            return False
        mapped = (end - begin) * es.page
        # cuMemCreate of one page each; the first that fails releases those created in this call (all or nothing)
        if self.capacity is not None and self.total_allocated_memory + mapped > self.capacity:
            return False
        pool = self._pool_of(to_map)
        del pool.unmapped[id(to_map)]
        to_map.mapped = True
        if mapped < to_map.size:
            remaining = Block(to_map.stream, to_map.size - mapped, to_map.small, to_map.ptr + mapped, es)
            remaining.mapped = False
            remaining.splice(to_map, to_map.next)
            pool.unmapped[id(remaining)] = remaining
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total_allocated_memory += mapped
        self.stats["reserved_bytes"].increase(to_map.small, mapped)
        self.stats.num_device_alloc += 1
        self._record("segment_map", es.ptr + begin * es.page, mapped, to_map.stream)
        return True

    def _try_allocate_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: find room, map what is unmapped of it, return one free block."""
        candidate = self._find_expandable_block(stream, pool, size)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.erase(candidate)
        return candidate

    def _unmap_block(self, block: Block) -> None:
        """``unmap_block``: give back the whole pages inside a free block; partial pages at either end stay as
        free mapped blocks."""
        es = block.expandable
        assert es is not None
        begin, end = es.right(block.ptr), es.left(block.ptr + block.size)
        if begin >= end:
            return
        pool = self._pool_of(block)
        pool.erase(block)
        start, length = es.ptr + begin * es.page, (end - begin) * es.page
        before = start - block.ptr
        if before > 0:
            before_free = Block(block.stream, before, block.small, block.ptr, es)
            before_free.splice(block.prev, block)
            pool.insert(before_free)
        after = block.size - (before + length)
        if after > 0:
            after_free = Block(block.stream, after, block.small, start + length, es)
            after_free.splice(block, block.next)
            pool.insert(after_free)
        block.ptr, block.size, block.mapped = start, length, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.unmapped[id(block)] = block
        self.total_allocated_memory -= length
        self.stats["reserved_bytes"].decrease(block.small, length)
        self.stats.num_device_free += 1
        self._record("segment_unmap", start, length, block.stream)

    def _release_expandable_segment(self, block: Block) -> None:
        """``release_expandable_segment``: a segment with nothing mapped any more is dropped."""
        es = block.expandable
        assert es is not None and block.size == es.size and not block.mapped
        self.expandable_segments.remove(es)
        del self._pool_of(block).unmapped[id(block)]

    # -- helpers -------------------------------------------------------------------------------------------------
    def _pool_of(self, block: Block) -> BlockPool:
        return self.small_blocks if block.small else self.large_blocks

    def _all_blocks(self) -> Iterator[Block]:
        yield from itertools.chain(self.small_blocks.blocks(), self.large_blocks.blocks(), self.active_blocks)

    def _record(self, action: str, addr: int, size: int, stream: int) -> None:
        if self.trace is not None:
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": stream})


class LeanAllocator(CachingAllocator):
    """The same allocator, counting only what a replay reads: ``allocated`` and ``reserved`` (and the segment
    counters). The allocator's decisions never read its statistics, so every block, segment and out-of-memory is the
    same as :class:`CachingAllocator`'s; the per-block counters (allocations, active and inactive-split blocks, their
    bytes, the bytes requested, oversize allocations) are not kept: about a third of a replay's time.
    :meth:`memory_stats` has only the counters kept.

    Its :meth:`malloc` and :meth:`free` also write out, in one function each, the path almost every request of a
    training step takes under the default kind of settings (no expandable segments, no garbage collection, no
    history): a request served by a cached block of its stream, and a free returned to its pool at once. Each
    condition that path tests is the general path's own (:meth:`CachingAllocator._get_free_block`,
    :meth:`~CachingAllocator._should_split`, :meth:`~CachingAllocator._alloc_found_block`,
    :meth:`~CachingAllocator._free_block`, :meth:`~CachingAllocator._try_merge_blocks`); anything else (a request
    no cached block serves, a free another stream used (``pending``), an expandable block) takes the general path,
    from its start: the written-out path changes nothing before it hands over. About a third less time per replay."""

    #: whether the written-out paths apply (:meth:`_refresh_fast`)
    _fast = False

    def set_allocator_settings(self, text: str) -> None:
        super().set_allocator_settings(text)
        self._refresh_fast()

    def set_memory_fraction(self, fraction: float) -> None:
        super().set_memory_fraction(fraction)
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        """The written-out paths need: no expandable segments (``should_split``'s other rule, the expandable search),
        no garbage collection (``get_free_block`` counts its calls then), no history (:meth:`_record`)."""
        self._fast = self.trace is None and not self.gc_enabled and not self.config.expandable_segments

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        """:meth:`CachingAllocator.malloc`; a request the smallest cached block of its stream serves is served here."""
        if not self._fast or not 0 < nbytes < ONE_EXA_BYTES:
            return super().malloc(nbytes, stream)
        config = self.config
        if config.plain_rounding:  # round_size
            size = kMinBlockSize if nbytes < kMinBlockSize else -(-nbytes // kMinBlockSize) * kMinBlockSize
        else:
            size = self.round_size(nbytes)
        small = size <= kSmallSize
        pool = self.small_blocks if small else self.large_blocks
        keys = pool._keys
        i = bisect.bisect_left(keys, (stream, size, -1))  # get_free_block: pool.blocks.lower_bound
        if i == len(keys):
            return super().malloc(nbytes, stream)
        key = keys[i]
        block = pool._blocks[key]
        found = key[1]
        limit = config.max_split_size
        if (
            key[0] != stream
            or block.expandable is not None
            or (size < limit and found >= limit)
            or (size >= limit and found >= size + config.max_non_split_rounding_size)
        ):
            return super().malloc(nbytes, stream)
        pool.erase_at(i)
        remaining_size = found - size  # should_split (no expandable segments)
        if remaining_size >= kMinBlockSize if small else (size < limit and remaining_size > kSmallSize):
            remaining = block  # alloc_found_block: split off the first size bytes
            block = Block(stream, size, small, remaining.ptr)
            before = remaining.prev
            block.prev = before
            if before is not None:
                before.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size = remaining_size
            pool.insert(remaining)
        block.allocated = True
        block.requested_size = nbytes
        self.active_blocks.add(block)
        self._allocated_now.current += block.size
        return block

    def free(self, block: Block | None, pending: bool = False) -> None:
        """:meth:`CachingAllocator.free`; a block of a non-expandable segment freed at once is returned here."""
        if pending or block is None or not self._fast or block.expandable is not None or not block.allocated:
            super().free(block, pending)
            return
        block.allocated = False
        self._allocated_now.current -= block.size
        pool = self.small_blocks if block.small else self.large_blocks  # free_block
        src = block.prev  # try_merge_blocks: [src block]
        if src is not None and not src.allocated and src.event_count == 0:  # the same segment: mapped, both
            pool.erase(src)
            block.ptr = src.ptr
            block.prev = before = src.prev
            if before is not None:
                before.next = block
            block.size += src.size
        src = block.next  # [block src]
        if src is not None and not src.allocated and src.event_count == 0:
            pool.erase(src)
            block.next = after = src.next
            if after is not None:
                after.prev = block
            block.size += src.size
        self.active_blocks.discard(block)
        pool.insert(block)

    def _count_allocated(self, block: Block) -> None:
        self._allocated_now.current += block.size

    def _count_freed(self, block: Block) -> None:
        self._allocated_now.current -= block.size

    def _count_inactive(self, small: bool, size: int, requested: int) -> None:
        pass

    def _count_inactive_split(self, small: bool, blocks: int, nbytes: int) -> None:
        pass

    def memory_stats(self) -> dict[str, int]:
        kept = ("segment.", "reserved_bytes.", "oversize_segments.", "num_", "max_split_size")
        out = {k: v for k, v in super().memory_stats().items() if k.startswith(kept)}
        out["allocated_bytes.all.current"] = self.allocated
        return out


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: a power of two stays; else the next of ``divisions`` equal steps between
    the powers of two around ``size`` (1200 with 4 divisions: 1024, 1280, 1536, 1792 -> 1280)."""
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("Only 2 or more divisions are supported")
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


__all__ = [
    "Block",
    "CachingAllocator",
    "DeviceStats",
    "LeanAllocator",
    "OutOfMemory",
    "Stat",
    "roundup_power2_next_division",
]
