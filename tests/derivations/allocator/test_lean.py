"""A replay without statistics (:class:`LeanAllocator`) takes the same decisions and gives the same figures.

The allocator never reads its statistics, so dropping the per-block counters must change nothing a replay reports:
every phase's figures, the out-of-memory, the segments and the counters it keeps. The streams: the published
resnet18 trace and random streams (mixed small and large requests, cross-stream frees, syncs, empty_cache, a
settings change, phase markers) under each kind of allocator setting, with and without a capacity that runs out.
Under the default kind of settings the lean allocator serves most requests and frees by a written-out path
(:meth:`LeanAllocator.malloc`): the same comparisons check it, and a step-like stream (layers' activations kept,
then freed in reverse, with temporaries between) that takes that path for nearly every event.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ledgerspec.derivations.allocator.caching import CachingAllocator, LeanAllocator
from ledgerspec.derivations.allocator.config import MiB
from ledgerspec.derivations.allocator.replay import Event, replay
from tests.derivations.allocator.test_published import trace_events

CONFIGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
]


def random_stream(seed: int, n: int = 3000, settings: bool = True) -> list[Event]:
    rng = random.Random(seed)
    events: list[Event] = [("phase", "load")]
    live: list[int] = []
    pending = 0
    for i in range(n):
        r = rng.random()
        if r < 0.5 or not live:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(MiB, 64 * MiB)])
            events.append(("alloc", i, size, rng.choice([0, 0, 0, 1])))
            live.append(i)
        elif r < 0.9:
            key = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.1:
                events.append(("free", key, "pending"))
                pending += 1
            else:
                events.append(("free", key))
        elif r < 0.95 and pending:
            events.append(("sync", rng.randrange(pending)))
        elif r < 0.97:
            events.append(("phase", f"window {i}"))
        elif r < 0.98:
            events.append(("empty_cache",))
        elif r < 0.985 and settings:
            events.append(("settings", "max_split_size_mb:64"))
    return events


def figures(events: list[Event], conf: str, capacity: int | None, statistics: bool) -> dict[str, Any]:
    r = replay(events, conf, capacity, device_total=8 * 1024 * MiB, stop_at_oom=False, statistics=statistics)
    return {
        "phases": r.phases,
        "oom": r.oom,
        "segments": r.segments,
        "events": r.events,
        "peaks": (r.peak_allocated, r.peak_reserved),
        "stats": r.stats,
    }


@pytest.mark.parametrize("conf", CONFIGS)
@pytest.mark.parametrize("capacity", [None, 600 * MiB], ids=["unlimited", "600MiB"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_replay_without_statistics_decides_and_reports_the_same(conf: str, capacity: int | None, seed: int) -> None:
    events = random_stream(seed)
    full = figures(events, conf, capacity, statistics=True)
    lean = figures(events, conf, capacity, statistics=False)
    kept = lean.pop("stats")
    assert kept and all(full["stats"][k] == v for k, v in kept.items())
    assert lean == {k: v for k, v in full.items() if k != "stats"}
    if capacity is not None and not conf.startswith("garbage"):
        assert full["oom"] is not None  # the capacity ran out: the release-and-retry path was taken


@pytest.mark.parametrize("conf", CONFIGS)
def test_the_peaks_a_replay_reports_are_the_allocators_own_counters(conf: str) -> None:
    """``peak_allocated``/``peak_reserved`` are read off the phases; the allocator's counters (kept by a replay with
    statistics) are the independent record of the same peaks."""
    for events in (random_stream(3), trace_events()):
        r = replay(events, conf, device_total=8 * 1024 * MiB, stop_at_oom=False)
        assert r.peak_allocated == r.stats["allocated_bytes.all.peak"] > 0
        assert r.peak_reserved == r.stats["reserved_bytes.all.peak"] > 0


def test_the_reserve_mapped_inside_a_request_that_fails_is_in_the_peak() -> None:
    """With expandable segments a request may map pages, fail to map the rest and release them: the reserve went
    above where the event before it ended. The replay's peak is the allocator's counter, with statistics or without
    (the phases' peaks, read between events, do not see it)."""
    events: list[Event] = [
        ("alloc", "a", 20 * MiB, 0),
        ("alloc", "b", 20 * MiB, 0),
        ("free", "a"),
        ("empty_cache",),
        ("alloc", "o", 40 * MiB, 1),
        ("free", "b"),
        ("alloc", "x", 100 * MiB, 0),
    ]
    for statistics in (True, False):
        r = replay(events, "expandable_segments:True", 90 * MiB, stop_at_oom=False, statistics=statistics)
        assert r.oom is not None and r.oom.id == "x"
        assert r.peak_reserved == r.stats["reserved_bytes.all.peak"] == 80 * MiB
        assert max(p.peak_reserved for p in r.phases.values()) == 60 * MiB


def step_like_stream(layers: int = 24, seed: int = 5) -> list[Event]:
    """A training step's shape: weights, then per layer saved activations and freed temporaries (forward), then
    per layer in reverse the saved ones freed and gradient temporaries (backward), twice."""
    rng = random.Random(seed)
    events: list[Event] = [("phase", "load")]
    serial = 0

    def alloc(size: int) -> int:
        nonlocal serial
        serial += 1
        events.append(("alloc", serial, size, 0))
        return serial

    weights = [alloc(rng.choice([16 * MiB + 4096, 64 * MiB, 3 * MiB + 17, 4096])) for _ in range(layers * 3)]
    for step in range(2):
        events.append(("phase", f"forward {step}"))
        saved: list[list[int]] = []
        for _ in range(layers):
            keep = [alloc(rng.choice([6 * MiB, 6 * MiB + 512, 24 * MiB, 700, 1 * MiB])) for _ in range(4)]
            temps = [alloc(rng.choice([12 * MiB, 5 * MiB + 3, 40 * MiB, 300])) for _ in range(3)]
            events.extend(("free", t) for t in reversed(temps))
            saved.append(keep)
        events.append(("phase", f"backward {step}"))
        for keep in reversed(saved):
            temps = [alloc(rng.choice([12 * MiB, 24 * MiB, 2 * MiB - 100])) for _ in range(3)]
            events.extend(("free", t) for t in temps + keep)
    events.extend(("free", w) for w in weights)
    return events


@pytest.mark.parametrize("conf", CONFIGS)
@pytest.mark.parametrize("capacity", [None, 1500 * MiB, 2200 * MiB], ids=["unlimited", "1500MiB", "2200MiB"])
@pytest.mark.parametrize("stream", ["step-like", "resnet18"])
def test_the_written_out_path_decides_and_reports_as_the_full_allocator(
    conf: str, capacity: int | None, stream: str
) -> None:
    events = step_like_stream() if stream == "step-like" else trace_events()
    full = figures(events, conf, capacity, statistics=True)
    lean = figures(events, conf, capacity, statistics=False)
    kept = lean.pop("stats")
    assert all(full["stats"][k] == v for k, v in kept.items())
    assert lean == {k: v for k, v in full.items() if k != "stats"}


def test_the_written_out_path_serves_a_steps_requests() -> None:
    """Under the default settings the general path (counted by wrapping the general allocator's malloc) serves only
    the requests no cached block can serve: each of them gets a new segment, and every other request of the
    step-like stream is served by the written-out path; the figures are the full allocator's."""
    general = 0
    original = CachingAllocator.malloc

    def counting(self: CachingAllocator, nbytes: int, stream: int = 0) -> Any:
        nonlocal general
        general += 1
        return original(self, nbytes, stream)

    events = step_like_stream()
    requests = sum(1 for e in events if e[0] == "alloc")
    lean = LeanAllocator()
    try:
        CachingAllocator.malloc = counting  # type: ignore[method-assign]
        r = replay(events, allocator=lean)
    finally:
        CachingAllocator.malloc = original  # type: ignore[method-assign]
    assert general == r.stats["num_device_alloc"] < requests / 4
    assert r.phases == replay(events).phases
