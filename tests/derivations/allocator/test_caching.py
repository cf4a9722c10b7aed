"""The caching-allocator model, rule by rule, with outcomes derived by hand from ``CUDACachingAllocator.cpp``.

Each test names the functions whose conditions give its numbers (``malloc``, ``round_size``,
``get_allocation_size``, ``get_free_block``, ``should_split``, ``alloc_found_block``, ``free_block``,
``try_merge_blocks``, ``alloc_block``, ``release_available_cached_blocks``, ``release_cached_blocks``,
``garbage_collect_cached_blocks``, ``find_expandable_block``/``map_block``/``unmap_block``); constants from
``c10/core/AllocatorConfig.h`` of the torch 2.13 wheel (lines 16-25: kSmallBuffer 2 MiB, kMinBlockSize 512,
kSmallSize 1 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB) and line 340 (large segments of 20 MiB).
"""

from __future__ import annotations

import pytest

from ledgerspec.derivations.allocator.caching import CachingAllocator, OutOfMemory, roundup_power2_next_division
from ledgerspec.derivations.allocator.config import AllocatorConfig, MiB


def blocks_of(alloc: CachingAllocator) -> list[list[tuple[int, str]]]:
    return [[(b["size"], b["state"]) for b in s["blocks"]] for s in alloc.segments()]


def test_one_byte_is_a_512_byte_block_in_a_2_mib_small_segment() -> None:
    """round_size: ``size < kMinBlockSize`` -> 512; get_pool: ``size <= kSmallSize`` -> small; get_allocation_size:
    small -> kSmallBuffer; should_split (small pool): ``remaining >= kMinBlockSize`` -> split; alloc_found_block
    counts the new inactive split block (inactive_split_bytes += remaining)."""
    a = CachingAllocator()
    first = a.malloc(1)
    second = a.malloc(1)
    assert first is not None and second is not None and second.ptr == first.ptr + 512
    assert blocks_of(a) == [[(512, "active_allocated"), (512, "active_allocated"), (2 * MiB - 1024, "inactive")]]
    s = a.memory_stats()
    assert s["allocated_bytes.small_pool.current"] == 1024 and s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["requested_bytes.all.current"] == 2 and s["segment.all.current"] == 1 and s["num_device_alloc"] == 1
    assert s["inactive_split.all.current"] == 1 and s["inactive_split_bytes.all.current"] == 2 * MiB - 1024
    assert a.malloc(0) is None and a.memory_stats()["allocation.all.current"] == 2  # allocate(0): no malloc


def test_a_1_5_mib_request_splits_a_20_mib_segment() -> None:
    """get_allocation_size: ``size < kMinLargeAlloc`` -> large_segment_size (20 MiB); should_split (large pool):
    ``size < max_split_size && remaining > kSmallSize`` (18.5 MiB > 1 MiB) -> split."""
    a = CachingAllocator()
    a.malloc(3 * MiB // 2)
    assert blocks_of(a) == [[(3 * MiB // 2, "active_allocated"), (37 * MiB // 2, "inactive")]]
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB // 2


def test_large_requests_get_segments_rounded_to_2_mib() -> None:
    """get_allocation_size: ``kRoundLarge * ceil(size / kRoundLarge)`` from 10 MiB on; should_split needs more than
    kSmallSize left over, else the whole block is handed out (and counted as allocated)."""
    a = CachingAllocator()
    a.malloc(12 * MiB)
    assert blocks_of(a) == [[(12 * MiB, "active_allocated")]]
    a.malloc(12 * MiB + 1)  # round_size: 12 MiB + 512; segment 14 MiB; 2 MiB - 512 left > 1 MiB: split
    a.malloc(11 * MiB + 1)  # segment 12 MiB; 1 MiB - 512 left: not > kSmallSize, not split
    assert blocks_of(a)[1:] == [
        [(12 * MiB + 512, "active_allocated"), (2 * MiB - 512, "inactive")],
        [(12 * MiB, "active_allocated")],
    ]
    assert a.allocated == 12 * MiB + (12 * MiB + 512) + 12 * MiB
    assert a.reserved == 12 * MiB + 14 * MiB + 12 * MiB


def test_best_fit_within_the_stream() -> None:
    """get_free_block: ``pool.blocks.lower_bound(search_key)`` over (stream, size, ...): the smallest free block of
    the same stream that fits; another stream's free block is never used."""
    a = CachingAllocator()
    big, small = a.malloc(16 * MiB), a.malloc(12 * MiB)
    assert big is not None and small is not None
    where = small.ptr
    a.free(big)
    a.free(small)
    got = a.malloc(11 * MiB)  # both fit: the 12 MiB one is the best fit
    assert got is not None and got.ptr == where
    other = a.malloc(11 * MiB, stream=1)  # stream 1 has nothing cached: a new segment
    assert other is not None and a.memory_stats()["segment.all.current"] == 3


def test_a_freed_block_merges_with_free_neighbours() -> None:
    """free_block -> try_merge_blocks with prev and next; inactive_split counts a free block of a split segment, so
    merging them back into one unsplit block takes both counts to 0."""
    a = CachingAllocator()
    x, y, z = a.malloc(2 * MiB), a.malloc(2 * MiB), a.malloc(2 * MiB)  # one 20 MiB segment: x|y|z|14 MiB free
    assert blocks_of(a) == [[(2 * MiB, "active_allocated")] * 3 + [(14 * MiB, "inactive")]]
    a.free(y)
    s = a.memory_stats()
    assert s["inactive_split.all.current"] == 2 and s["inactive_split_bytes.all.current"] == 16 * MiB
    a.free(x)  # merges with y: one 4 MiB free block, still split (z follows)
    assert blocks_of(a) == [[(4 * MiB, "inactive"), (2 * MiB, "active_allocated"), (14 * MiB, "inactive")]]
    assert a.memory_stats()["inactive_split_bytes.all.current"] == 18 * MiB
    a.free(z)  # merges with both: the whole segment, unsplit
    assert blocks_of(a) == [[(20 * MiB, "inactive")]]
    s = a.memory_stats()
    assert s["inactive_split.all.current"] == 0 and s["inactive_split_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 0 and a.reserved == 20 * MiB
    a.empty_cache()  # release_cached_blocks -> release_blocks: an unsplit free block is cudaFree'd
    assert a.reserved == 0 and a.memory_stats()["num_device_free"] == 1


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    """max_split_size_mb:128. should_split: ``size < max_split_size`` is false for 200 MiB: not split. get_free_block:
    a request ``>= max_split_size`` takes a cached oversize block only if ``block.size < size +
    max_non_split_rounding_size`` (20 MiB): 190 MiB yes (200 < 210), 180 MiB no (200 >= 200); a request below
    max_split_size never takes an oversize block: 100 MiB gets a segment of its own."""
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:128"))
    a.free(a.malloc(200 * MiB))
    b = a.malloc(190 * MiB)
    assert b is not None and b.size == 200 * MiB and a.reserved == 200 * MiB  # the whole block, no new segment
    assert a.allocated == 200 * MiB and a.memory_stats()["oversize_allocations.current"] == 1
    a.free(b)
    c = a.malloc(100 * MiB)
    assert c is not None and c.size == 100 * MiB and a.reserved == 300 * MiB
    d = a.malloc(180 * MiB)
    assert d is not None and d.size == 180 * MiB and a.reserved == 480 * MiB
    assert a.memory_stats()["oversize_segments.current"] == 2  # 200 MiB and 180 MiB segments are >= 128 MiB


def test_cudamalloc_failure_frees_the_cache_and_retries() -> None:
    """alloc_block fails (60 + 70 > 100 MiB); release_available_cached_blocks returns false without a
    max_split_size; release_cached_blocks frees the unsplit 60 MiB segment; alloc_block(isRetry=true) succeeds and
    counts num_alloc_retries."""
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(70 * MiB)
    s = a.memory_stats()
    assert a.reserved == 70 * MiB and s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert s["num_device_free"] == 1 and s["num_sync_all_streams"] == 1


def test_out_of_memory_after_releasing_what_can_be_released() -> None:
    """A 30 MiB tensor sits in the 60 MiB segment (split: 30 MiB free behind it), so release_cached_blocks cannot
    free it; the retry fails, malloc raises, num_ooms counts it; the 30 MiB free but unusable is fragmentation."""
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))
    keep = a.malloc(30 * MiB)  # best fit: the cached 60 MiB block, split
    assert keep is not None and a.reserved == 60 * MiB
    with pytest.raises(OutOfMemory) as info:
        a.malloc(70 * MiB)
    oom = info.value
    assert (oom.requested, oom.alloc_size, oom.allocated, oom.reserved) == (70 * MiB, 70 * MiB, 30 * MiB, 60 * MiB)
    assert oom.free_unusable == 30 * MiB and not oom.rejected
    s = a.memory_stats()
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1


def test_release_available_cached_blocks_frees_oversize_blocks_largest_first() -> None:
    """max_split_size_mb:40, cached 50 MiB and 46 MiB blocks (45 MiB rounds to a 46 MiB segment), capacity 120 MiB:
    a 60 MiB request fails in cudaMalloc (96 + 60 > 120); release_available_cached_blocks finds no single block of
    max(60, 40) MiB, so it frees oversize blocks from the largest down until 60 MiB are freed (50, then 46); the
    next alloc_block is no retry (num_alloc_retries stays 0)."""
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"), capacity=120 * MiB)
    x, y = a.malloc(50 * MiB), a.malloc(45 * MiB)
    a.free(x)
    a.free(y)
    assert a.reserved == 96 * MiB
    a.malloc(60 * MiB)
    s = a.memory_stats()
    assert a.reserved == 60 * MiB and s["num_device_free"] == 2 and s["num_alloc_retries"] == 0


def test_garbage_collection_needs_a_memory_fraction() -> None:
    """malloc runs garbage_collect_cached_blocks only ``if (allowed_memory_maximum.has_value() &&
    garbage_collection_threshold() > 0.0)``. With a fraction of 0.5 of 100 MiB (50 MiB allowed) and a threshold of
    0.5 (25 MiB): 26 MiB reserved in two cached unsplit blocks, both of age 1 (get_free_block calls since they were
    cached), the average; both are freed (the pass does not stop at the target) before the new 16 MiB segment.
    Without the fraction the threshold does nothing."""
    config = AllocatorConfig.parse("garbage_collection_threshold:0.5")
    with_fraction = CachingAllocator(config, device_total=100 * MiB)
    with_fraction.set_memory_fraction(0.5)
    without = CachingAllocator(config, device_total=100 * MiB)
    for a in (with_fraction, without):
        x, y = a.malloc(12 * MiB), a.malloc(14 * MiB)
        a.free(x)
        a.free(y)
        a.malloc(16 * MiB)
    assert with_fraction.reserved == 16 * MiB and with_fraction.memory_stats()["num_device_free"] == 2
    assert without.reserved == 42 * MiB and without.memory_stats()["num_device_free"] == 0


def test_a_memory_fraction_limits_the_reserve() -> None:
    """alloc_block: ``total_allocated_memory + size > allowed_memory_maximum`` -> fail (then the retry path)."""
    a = CachingAllocator(device_total=100 * MiB)
    a.set_memory_fraction(0.5)
    a.malloc(30 * MiB)
    with pytest.raises(OutOfMemory):
        a.malloc(30 * MiB)
    assert a.reserved == 30 * MiB


def test_throw_on_cudamalloc_oom_rejects_without_releasing_the_cache() -> None:
    """alloc_block with throw_on_cudamalloc_oom: ``total_allocated_memory + size > per_process_memory_fraction *
    device_total`` -> rejected; malloc skips the retry chain, so the cached 60 MiB stay reserved; num_oom_rejections
    counts it, num_ooms does not. Without the option the cache is freed and the request succeeds."""
    rejecting = CachingAllocator(AllocatorConfig.parse("throw_on_cudamalloc_oom:True"), capacity=100 * MiB)
    rejecting.free(rejecting.malloc(60 * MiB))
    with pytest.raises(OutOfMemory) as info:
        rejecting.malloc(70 * MiB)
    assert info.value.rejected and rejecting.reserved == 60 * MiB
    s = rejecting.memory_stats()
    assert s["num_oom_rejections"] == 1 and s["num_ooms"] == 0
    plain = CachingAllocator(capacity=100 * MiB)
    plain.free(plain.malloc(60 * MiB))
    plain.malloc(70 * MiB)
    assert plain.reserved == 70 * MiB


def test_roundup_power2_divisions() -> None:
    """roundup_power2_next_division: 1200 with 4 divisions -> 1280 (the comment's own example). round_size uses it
    only ``if (divisions > 1 && size > kMinBlockSize * divisions)``: 1200 <= 2048, so 1200 rounds to 1536; 5 MiB + 1
    with 4 divisions in [4, 8) MiB steps of 1 MiB -> 6 MiB; a power of two stays."""
    assert roundup_power2_next_division(1200, 4) == 1280
    a = CachingAllocator(AllocatorConfig.parse("roundup_power2_divisions:4"))
    assert a.round_size(1200) == 1536
    assert a.round_size(5 * MiB + 1) == 6 * MiB
    assert a.round_size(8 * MiB) == 8 * MiB
    assert CachingAllocator().round_size(5 * MiB + 1) == 5 * MiB + 512


def test_expandable_segments_tile_growing_allocations_into_one_segment() -> None:
    """expandable_segments:True. find_expandable_block creates one segment per stream; map_block maps 20 MiB pages
    (large pool) as needed; should_split with expandable segments: ``remaining >= kMinBlockSize``. 3, 5, 7 MiB fit in
    the first page; 9 MiB maps a second page behind the free 5 MiB (which merges with it); 13 MiB fits in what is
    left: 40 MiB reserved in one contiguous segment. Without expandable segments 9 MiB gets a 20 MiB segment of its
    own (get_allocation_size: < 10 MiB) and 13 MiB a 14 MiB one, unsplit (1 MiB left is not > kSmallSize): 54 MiB in
    three segments."""
    sizes = [3 * MiB, 5 * MiB, 7 * MiB, 9 * MiB, 13 * MiB]
    grow = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    for n in sizes:
        grow.malloc(n)
    assert grow.reserved == 40 * MiB and grow.memory_stats()["num_device_alloc"] == 2
    assert grow.memory_stats()["segment.all.current"] == 0  # map_block does not count segments
    assert blocks_of(grow) == [[(n, "active_allocated") for n in sizes] + [(3 * MiB, "inactive")]]
    assert grow.segments()[0]["is_expandable"]
    plain = CachingAllocator()
    for n in sizes:
        plain.malloc(n)
    assert plain.reserved == 54 * MiB and plain.memory_stats()["segment.all.current"] == 3


def test_expandable_segments_unmap_free_pages_when_memory_runs_out() -> None:
    """Capacity 60 MiB. Stream 0 maps 40 MiB and frees it (cached, still mapped). Stream 1's 30 MiB needs two
    pages (40 + 40 > 60): map_block fails; release_cached_blocks -> release_blocks -> unmap_block gives the free
    pages back (a segment with nothing mapped is dropped); the retry maps stream 1's pages."""
    a = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"), capacity=60 * MiB, record_history=True)
    a.free(a.malloc(40 * MiB))
    assert a.reserved == 40 * MiB
    a.malloc(30 * MiB, stream=1)
    s = a.memory_stats()
    assert a.reserved == 40 * MiB and s["num_alloc_retries"] == 1 and s["num_device_free"] == 1
    assert a.trace is not None
    assert [e["action"] for e in a.trace if e["action"].startswith("segment")] == [
        "segment_map",
        "segment_unmap",
        "segment_map",
    ]
    assert [seg["stream"] for seg in a.segments()] == [1] and len(a.expandable_segments) == 1


def test_a_replay_counts_requests_as_the_tracker_and_blocks_as_the_allocator() -> None:
    """A cached 12 MiB block serves an 11.5 MiB request whole (should_split: 0.5 MiB left, not > kSmallSize): the
    allocator's allocated bytes count the block, the replay's ``counted`` the request rounded up to 512 B (what the
    estimate's tracker adds)."""
    from ledgerspec.derivations.allocator.replay import replay

    events = [
        ("phase", "a"),
        ("alloc", 1, 12 * MiB, 0),
        ("free", 1),
        ("phase", "b"),
        ("alloc", 2, 23 * MiB // 2 + 1, 0),  # round_size: 11.5 MiB + 512
        ("alloc", 3, 100, 0),  # small pool: a 512 B block
    ]
    result = replay(events)
    a, b = result.phases["a"], result.phases["b"]
    assert (a.peak_counted, a.end_counted, a.peak_allocated) == (12 * MiB, 0, 12 * MiB)
    assert b.peak_counted == b.end_counted == 23 * MiB // 2 + 512 + 512
    assert b.peak_allocated == b.end_allocated == 12 * MiB + 512
    assert b.peak_reserved == 12 * MiB + 2 * MiB
