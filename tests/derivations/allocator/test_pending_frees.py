"""A block another stream used (``record_stream``) goes back to its pool only once that stream has caught up, as
``DeviceCachingAllocator`` does it (``c10/cuda/CUDACachingAllocator.cpp``): ``free`` calls ``insert_events`` when
``block->stream_uses`` is not empty, ``process_events`` returns the block when its events completed,
``try_merge_blocks`` skips a neighbour with ``event_count > 0``, and ``release_cached_blocks`` (``empty_cache``, the
out-of-memory path) first runs ``synchronize_and_free_events``. ``recordStream`` ignores the allocation stream."""

from __future__ import annotations

import pytest

from ledgerspec.derivations.allocator.caching import CachingAllocator
from ledgerspec.derivations.allocator.replay import replay

MiB = 2**20


def test_a_pending_block_is_not_reused_until_its_stream_caught_up() -> None:
    a = CachingAllocator()
    first = a.malloc(20 * MiB, stream=1)
    assert first is not None
    a.free(first, pending=True)
    assert a.allocated == 0 and a.reserved == 20 * MiB  # no longer allocated, still reserved
    second = a.malloc(20 * MiB, stream=1)  # the pending block cannot serve it: a new segment
    assert second is not None and second.ptr != first.ptr and a.reserved == 40 * MiB
    a.complete_pending(0)
    a.free(second)
    third = a.malloc(20 * MiB, stream=1)
    assert a.reserved == 40 * MiB and third is not None  # served from the cache now


def test_sync_keeps_the_last_pending_frees() -> None:
    a = CachingAllocator()
    blocks = [b for b in (a.malloc(4 * MiB) for _ in range(3)) if b is not None]
    assert len(blocks) == 3
    for b in blocks:
        a.free(b, pending=True)
    a.complete_pending(keep=1)  # the host waited for an event recorded before the last free
    assert a.pending == [blocks[2]]
    assert all(b.event_count == 0 for b in blocks[:2]) and blocks[2].event_count == 1


def test_a_pending_neighbour_is_not_merged() -> None:
    a = CachingAllocator()
    left = a.malloc(6 * MiB)  # both from one 20 MiB segment (kLargeBuffer)
    right = a.malloc(6 * MiB)
    assert left is not None and right is not None and left.next is right
    a.free(right, pending=True)
    a.free(left)  # its free neighbour is pending: not merged
    assert left.size == 6 * MiB
    a.complete_pending(0)  # free_block(right) absorbs both free neighbours: the whole segment again
    assert right.size == 20 * MiB and right.prev is None and right.next is None


def test_the_out_of_memory_path_waits_for_pending_frees_first() -> None:
    a = CachingAllocator(capacity=40 * MiB)
    first = a.malloc(30 * MiB)
    a.free(first, pending=True)
    again = a.malloc(30 * MiB)  # cudaMalloc fails; release_cached_blocks syncs the event, frees, retries
    assert again is not None and a.reserved <= 40 * MiB and a.pending == []


@pytest.mark.parametrize(("pending", "reserved"), [(False, 20 * MiB), (True, 40 * MiB)])
def test_replayed_events(pending: bool, reserved: int) -> None:
    free = ("free", 1, "pending") if pending else ("free", 1)
    events = [("alloc", 1, 20 * MiB, 1), free, ("alloc", 2, 20 * MiB, 1), ("sync", 0), ("free", 2)]
    assert replay(events).peak_reserved == reserved


def test_the_tracker_logs_a_use_on_another_stream_as_pending() -> None:
    torch = pytest.importorskip("torch")
    from ledgerspec.derivations.engine.tracker import MemoryTracker

    t = MemoryTracker(events=True)
    streams = iter([1, 1, 0])
    t.stream_of = lambda: next(streams)
    with t:
        x = torch.empty(1024)
        y = torch.empty(1024)
        z = torch.empty(1024)
        t.record_stream(x.untyped_storage(), 0)  # allocated on stream 1, used on 0: pending
        t.record_stream(y.untyped_storage(), 1)  # its own stream: ignored (``recordStream``)
        t.record_stream(z.untyped_storage(), 0)  # allocated on 0: ignored
        del x, y, z
        t.sync(1)
    assert t.events is not None
    assert [e for e in t.events if e[0] != "alloc"] == [("free", 0, "pending"), ("free", 1), ("free", 2), ("sync", 1)]
