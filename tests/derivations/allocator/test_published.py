"""The allocator model against what PyTorch publishes: its own tests' expectations, and a real trace.

Data and sources: ``tests/data/allocator/README.md``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledgerspec.derivations.allocator.caching import CachingAllocator, OutOfMemory
from ledgerspec.derivations.allocator.config import MiB
from ledgerspec.derivations.allocator.replay import replay
from tests.support import TESTS

DATA = TESTS / "data" / "allocator"
EXPECTATIONS = json.loads((DATA / "pytorch-test_cuda-expectations.json").read_text())
TRACE = json.loads((DATA / "zdevito-resnet18-trace.json").read_text())
#: any device will do for the scenarios: they set a memory fraction of a fixed number of bytes
DEVICE = 80 * 1024 * MiB


def test_roundup_power2_divisions_as_test_allocator_settings_asserts() -> None:
    """test_allocator_settings: the growth of active_bytes.all.allocated for each torch.rand under each setting
    (84 MiB -> 84 MiB plain, 96 MiB with 4 divisions, 88 MiB with 8, 400 MiB -> 512 MiB with 2)."""
    steps = EXPECTATIONS["roundup"]["steps"]
    a = CachingAllocator(device_total=DEVICE)
    alive = []
    for step in steps:
        if step["settings"] is not None:
            a.set_allocator_settings(step["settings"])
        if step.get("empty_cache"):
            a.empty_cache()
        before = a.memory_stats()["active_bytes.all.allocated"]
        alive.append(a.malloc(step["nbytes"]))
        assert a.memory_stats()["active_bytes.all.allocated"] - before == step["growth"], step


@pytest.mark.parametrize("scenario", EXPECTATIONS["scenarios"], ids=lambda s: s["test"])
def test_pytorchs_oom_scenarios(scenario: dict[str, Any]) -> None:
    """test_max_split_expandable, test_garbage_collect_expandable, test_raises_oom: the allocation the test expects
    to fail fails, every other succeeds."""
    a = CachingAllocator(device_total=DEVICE, capacity=DEVICE)
    if scenario["memory_fraction_bytes"] is not None:
        a.set_memory_fraction(scenario["memory_fraction_bytes"] / DEVICE)
        assert a.allowed_memory_maximum == scenario["memory_fraction_bytes"]
    live: dict[str, Any] = {}
    for step in scenario["steps"]:
        kind = step[0]
        if kind == "settings":
            a.set_allocator_settings(step[1])
        elif kind == "empty_cache":
            a.empty_cache()
        elif kind == "alloc":
            live[step[1]] = a.malloc(step[2])
        elif kind == "alloc_oom":
            with pytest.raises(OutOfMemory):
                a.malloc(step[2])
        elif kind == "free":
            a.free(live.pop(step[1]))
    assert a.reserved >= a.allocated


def trace_events() -> list[tuple[Any, ...]]:
    seen: set[int] = set()
    events: list[tuple[Any, ...]] = []
    for element in TRACE["actions"]:
        if element in seen:
            events.append(("free", element))
        else:
            seen.add(element)
            events.append(("alloc", element, TRACE["elements_size"][element], 0))
    return events


def test_the_published_resnet18_trace_lays_out_its_first_blocks_as_the_gpu_did() -> None:
    """The post's ``_memory_viz.py stats`` of this trace: ``a = cudaMalloc(..., 2.0MiB); b = a[0:36.8KiB];
    c = a[37888:256.0B]; d = a[38400:256.0B]; e = a[38912:256.0B]; f = a[39424:256.0B]; g = a[39936:8.0B]``."""
    layout = TRACE["published_layout"]
    a = CachingAllocator(record_history=True)
    blocks = [a.malloc(size) for size in layout["sizes"]]
    assert a.trace is not None and a.trace[0]["action"] == layout["first_trace_entry"]["action"]
    assert a.trace[0]["size"] == layout["segment_size"]
    base = a.trace[0]["addr"]
    assert [b.ptr - base for b in blocks if b is not None] == layout["offsets"]


def test_the_published_resnet18_trace_replays() -> None:
    """The whole step (458 allocations of resnet18, batch 8, forward to SGD step) replays; what the model says it
    reserves is recorded here for reference, not checked against the GPU (the trace has no segment entries)."""
    result = replay(trace_events())
    assert result.oom is None and result.events == len(TRACE["actions"])
    assert result.peak_reserved >= result.peak_allocated > 0
    # the requested sizes rounded to 512 B, summed over the live ones, need no allocator model; allocated_bytes can
    # only be more: alloc_found_block counts the whole block, and should_split leaves up to 1 MiB (large pool)
    # unsplit behind a large request
    live: dict[int, int] = {}
    peak = 0
    for e in trace_events():
        if e[0] == "alloc":
            live[e[1]] = max(512, -(-e[2] // 512) * 512)
        else:
            del live[e[1]]
        peak = max(peak, sum(live.values()))
    assert peak <= result.peak_allocated <= peak + MiB * len(TRACE["elements_size"])
    on_a_small_device = replay(trace_events(), capacity=result.peak_allocated)
    assert on_a_small_device.oom is not None and on_a_small_device.oom.free_unusable >= 0
