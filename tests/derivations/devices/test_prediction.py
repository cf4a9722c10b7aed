"""The estimate's verdict on the device (issue 23): reserved bytes from the allocator model, plus what lies outside
the allocator, against the device's total; fits = the replay against the capacity completes.

The decision logic is checked on streams small enough to follow by hand with the allocator's rules (PyTorch 2.13's
``CUDACachingAllocator.cpp``, as :mod:`ledgerspec.derivations.allocator.caching` cites them): requests of 10 MiB or
more get a segment rounded up to 2 MiB, a free block is split when more than 1 MiB remains, ``cudaMalloc`` failing
makes the allocator free its unsplit cached segments and try again, expandable segments map 20 MiB pages of one
address range. No GPU ran these: the allocator model itself is checked against recorded streams in
``tests/derivations/allocator``. The tiny-model test at the end wires the whole ``estimate`` command.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import Document, from_text, load
from ledgerspec.derivations.allocator.step import StepEvents
from ledgerspec.derivations.devices import outside as O
from ledgerspec.derivations.devices import prediction as P
from ledgerspec.derivations.devices import target as T
from tests.support import CliRunner

MiB = 2**20
GiB = 2**30
#: the protocol's windows for one micro-step and one steady-state step
WINDOWS = [
    "0:frozen_params",
    "1:adapter",
    "2:optimizer",
    "3:activations",
    "4:temporary",
    "5:optimizer",
    "6:activations",
    "7:temporary",
    "8:optimizer",
]


def _doc(extra: str = "") -> Document:
    return from_text(
        "ledgerspec: ledger/v1\nsoftware:\n  attention_implementation: sdpa\n" + extra, "/tmp/x.ledger.yaml"
    )


def _step(forward: list[tuple[object, ...]], backward: list[tuple[object, ...]]) -> StepEvents:
    """A step whose forward window runs ``forward`` and whose first backward window runs ``backward``."""
    events: list[tuple[object, ...]] = []
    for label in WINDOWS:
        events.append(("phase", label))
        if label == "3:activations":
            events += forward
        elif label == "4:temporary":
            events += backward
    return StepEvents(events, list(WINDOWS), 1, {}, method="a hand-made stream")


#: forward: a 30 MiB tensor, freed (its segment stays cached, whole). Backward: two 12 MiB tensors split that cached
#: segment (12 | 12 | 6 free), the first is freed (12 free | 12 live | 6 free), then 16 MiB is asked for: no free
#: block is that large, the segment cannot be released (a tensor lives in it), a new 16 MiB segment is needed.
FRAGMENTING = _step(
    [("alloc", 1, 30 * MiB), ("free", 1)],
    [("alloc", 2, 12 * MiB), ("alloc", 3, 12 * MiB), ("free", 2), ("alloc", 4, 16 * MiB)],
)


def test_fragmentation_decides_when_the_tensors_fit_but_the_blocks_do_not() -> None:
    outside_bytes, capacity = 1 * GiB, 41 * MiB
    r = P.replay_on_device(_doc(), FRAGMENTING, outside_bytes + capacity, outside_bytes, "")
    # without a limit: 30 MiB reserved in the forward, 30 + 16 = 46 MiB in the backward
    assert r.free_peak_reserved == 46 * MiB
    assert r.phases["forward_peak"].reserved == 30 * MiB and r.phases["backward_peak"].reserved == 46 * MiB
    assert r.phases["backward_peak"].device == 46 * MiB + outside_bytes
    # against 41 MiB: 30 + 16 > 41, nothing can be released, out of memory in the backward
    assert not r.fits and r.oom is not None
    assert (r.oom.phase, r.oom.requested, r.oom.alloc_size) == ("backward_peak", 16 * MiB, 16 * MiB)
    assert (r.oom.reserved, r.oom.allocated, r.oom.fragmentation) == (30 * MiB, 12 * MiB, 18 * MiB)
    assert r.oom.short == 30 * MiB + 16 * MiB - capacity == 5 * MiB
    pred = P.DevicePrediction(T.Target(outside_bytes + capacity, None, "none"), O.Figure(outside_bytes, "X", "t"), r)
    assert pred.peak_allocated == 30 * MiB <= capacity  # the tensors alone fit
    assert pred.decided_by == "fragmentation" and pred.fragmentation == 18 * MiB
    assert pred.device_peak == 46 * MiB + outside_bytes and pred.margin == -5 * MiB
    # expandable segments: the 30 MiB tensor maps two 20 MiB pages (40 MiB, under 41); the 16 MiB request then finds
    # the 16 MiB free at the end of the same range: it fits, 1 MiB to spare
    tried = {t.setting: t for t in r.tried}
    assert tried["expandable_segments:True"].fits and tried["expandable_segments:True"].peak_reserved == 40 * MiB
    assert tried["expandable_segments:True"].margin == 1 * MiB
    # max_split_size_mb:20: the cached 30 MiB segment is oversize, so a 12 MiB request may not split it: a new 12 MiB
    # segment (42 > 41) fails, the oversize cached segment is released, 12 + 12 + 16 = 40 MiB: fits by 1 MiB
    assert tried["max_split_size_mb:20"].fits and tried["max_split_size_mb:20"].peak_reserved == 40 * MiB
    # a larger split limit leaves the 30 MiB segment splittable: the same out-of-memory, lacking 5 MiB
    assert not tried["max_split_size_mb:64"].fits and tried["max_split_size_mb:64"].margin == -5 * MiB
    best = pred.best_try
    assert best is not None and best.setting == "expandable_segments:True"  # the first of the two best
    lines = pred.lines()
    assert any("decided by fragmentation" in line for line in lines)
    assert lines[-1] == "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (software.pytorch_cuda_alloc_conf) to fit"
    block = pred.extension()
    assert block["verdict"]["decided_by"] == "fragmentation" and block["verdict"]["setting"]["margin"] == MiB
    assert block["device_peak"]["value"] == pred.device_peak
    assert block["verdict"]["compared"] == "x-estimate.device_peak"


def test_a_step_at_the_edge_names_the_setting_that_completes_with_the_high_end_too() -> None:
    """The fragmenting stream with 46 MiB for the allocator beside the typical figure (30 + 16 MiB: it completes)
    and 41 MiB beside the high end of the range (5 MiB more outside): there it runs out, decided by fragmentation
    (40 MiB of tensors at most). At the edge, so it does not fit; the settings are replayed against the high end's
    41 MiB, where expandable segments reserve 40 MiB (two 20 MiB pages) and complete: named, with that margin."""
    outside_bytes, capacity = 1 * GiB, 46 * MiB
    r = P.replay_on_device(
        _doc(), FRAGMENTING, outside_bytes + capacity, outside_bytes, "", outside_high=outside_bytes + 5 * MiB
    )
    pred = P.DevicePrediction(T.Target(outside_bytes + capacity, None, "none"), O.Figure(outside_bytes, "A", "t"), r)
    assert pred.completes and pred.uncertain and not pred.fits and pred.decided_by == "outside"
    tried = {t.setting: t for t in r.tried}
    assert all(t.at_high for t in r.tried)
    assert tried["expandable_segments:True"].fits and tried["expandable_segments:True"].margin == 1 * MiB
    assert not tried["max_split_size_mb:64"].fits  # splittable: the same out-of-memory as without a setting
    best = pred.best_try
    assert best is not None and best.setting == "expandable_segments:True"
    assert (
        "or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: with it the replay completes with the high end"
        in (pred.sentence())
    )
    assert pred.lines()[-1] == (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (software.pytorch_cuda_alloc_conf) to fit with either "
        "figure outside the allocator"
    )
    assert pred.extension()["verdict"]["setting"]["conf"] == "expandable_segments:True"


def test_the_out_of_memory_keeps_the_reserve_s_peak_before_it() -> None:
    """What ``torch.cuda.max_memory_reserved`` reads after the error: the reserve's peak, not what is left after the
    release. Forward: 20 and 12 MiB, the 20 freed (its segment cached whole; 32 reserved). Backward: 26 MiB finds no
    cached block that large and cudaMalloc cannot get it (32 + 26 > 41): the cached 20 MiB segment is released and the
    retry gets it (38 reserved). It is freed, then 30 MiB: cudaMalloc fails again (38 + 30), the cached 26 MiB
    segment is released, and the retry still lacks 1 MiB (12 + 30 > 41). The reserve was 38 MiB before the error,
    12 MiB after the release."""
    outside_bytes, capacity = 1 * GiB, 41 * MiB
    step = _step(
        [("alloc", 1, 20 * MiB), ("alloc", 2, 12 * MiB), ("free", 1)],
        [("alloc", 3, 26 * MiB), ("free", 3), ("alloc", 4, 30 * MiB)],
    )
    r = P.replay_on_device(_doc(), step, outside_bytes + capacity, outside_bytes, "", tries=False)
    assert r.oom is not None and (r.oom.reserved, r.oom.short) == (12 * MiB, 1 * MiB)
    assert r.oom.peak_reserved == 38 * MiB
    pred = P.DevicePrediction(T.Target(outside_bytes + capacity, None, "none"), O.Figure(outside_bytes, "X", "t"), r)
    assert "the reserve peaked at 38.00 MiB before it" in pred.lines()[0]


def test_a_setting_that_fits_only_with_the_typical_figure_outside_is_not_named() -> None:
    """The same fragmentation, with the catalogue's range outside the allocator reaching 2 MiB above the typical
    figure (39 MiB for the allocator). Expandable segments, 40 MiB reserved against 41, runs out against 39: at the
    edge, so it is not named. max_split_size_mb:20 fits there too: against 39 MiB the second 12 MiB request's new
    segment fails, the cached 12 MiB segment freed before it is released and the step ends with 28 MiB reserved
    (against 41 MiB that segment stayed, 40 MiB): it is the setting named. With a range of 1 MiB both fit."""
    outside_bytes, capacity = 1 * GiB, 41 * MiB
    total = outside_bytes + capacity
    r = P.replay_on_device(_doc(), FRAGMENTING, total, outside_bytes, "", outside_high=outside_bytes + 2 * MiB)
    tried = {t.setting: t for t in r.tried}
    assert tried["expandable_segments:True"].fits and tried["expandable_segments:True"].edge
    assert tried["max_split_size_mb:20"].fits and not tried["max_split_size_mb:20"].edge
    pred = P.DevicePrediction(T.Target(total, None, "none"), O.Figure(outside_bytes, "ASSUMPTION", "t"), r)
    assert pred.best_try is not None and pred.best_try.setting == "max_split_size_mb:20"
    lines = pred.lines()
    assert "with expandable_segments:True: at the edge, does not fit" in " ".join(lines)
    assert lines[-1] == "set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:20 (software.pytorch_cuda_alloc_conf) to fit"
    assert pred.extension()["verdict"]["tried"][0] == {
        "setting": "expandable_segments:True",
        "fits": False,
        "peak_reserved": 40 * MiB,
        "margin": MiB,
        "uncertain": True,
    }
    narrow = P.replay_on_device(_doc(), FRAGMENTING, total, outside_bytes, "", outside_high=outside_bytes + MiB)
    assert not any(t.edge for t in narrow.tried)
    best = P.DevicePrediction(T.Target(total, None, "none"), O.Figure(outside_bytes, "ASSUMPTION", "t"), narrow)
    assert best.best_try is not None and best.best_try.setting == "expandable_segments:True"


def test_settings_tried_in_a_helper_process_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a helper process (:class:`~ledgerspec.derivations.engine.beside.Helper`) half of the settings tried are
    replayed there: the same list, in the same order, as in turn."""
    import os

    from ledgerspec.derivations.engine import beside, protocol

    if not hasattr(os, "fork"):
        pytest.skip("a helper process needs fork")
    monkeypatch.setattr(protocol, "RUNS_STARTED", 0)
    monkeypatch.setattr(beside, "usable_cpus", lambda: 2)
    sent: list[tuple[str, int]] = []
    submit = beside.Helper.submit

    def recording(self: beside.Helper, fn: Any, *args: Any) -> Any:
        wait = submit(self, fn, *args)
        if self._pending is not None:  # sent to the child (its answer not collected yet)
            sent.append((fn.__name__, len(args[1])))
        return wait

    monkeypatch.setattr(beside.Helper, "submit", recording)
    outside_bytes, capacity = 1 * GiB, 41 * MiB
    in_turn = P.replay_on_device(_doc(), FRAGMENTING, outside_bytes + capacity, outside_bytes, "")
    with beside.Helper() as helper:
        there = P.replay_on_device(_doc(), FRAGMENTING, outside_bytes + capacity, outside_bytes, "", helper=helper)
    assert len(in_turn.tried) >= 2 and there.tried == in_turn.tried
    assert sent == [("try_settings", len(in_turn.tried) // 2)]  # the second half went to the helper


def test_free_and_retry_makes_it_fit_below_the_unlimited_reserve() -> None:
    """Two 12 MiB tensors, the first freed (its segment cached, whole), then 14 MiB: without a limit the allocator
    keeps the cached segment and takes a new one (38 MiB); against 30 MiB the new segment fails, the cached one is
    released and the retry succeeds: 26 MiB reserved."""
    step = _step([("alloc", 1, 12 * MiB), ("alloc", 2, 12 * MiB), ("free", 1)], [("alloc", 3, 14 * MiB)])
    r = P.replay_on_device(_doc(), step, 30 * MiB, 0, "")
    assert r.free_peak_reserved == 38 * MiB
    assert r.fits and r.oom is None and r.tried == []
    assert max(p.reserved for p in r.phases.values()) == 26 * MiB  # the device's own replay, not the unlimited one
    pred = P.DevicePrediction(T.Target(30 * MiB, None, "none"), O.Figure(0, "MEASURED", "t"), r)
    assert pred.margin == 4 * MiB and pred.decided_by == "none"
    # fits: the reserve above the allocated peak (12 + 14 MiB of tensors in the backward: every reserved byte)
    assert pred.peak_allocator_allocated == 26 * MiB and pred.fragmentation == 0


def test_a_margin_inside_the_outside_catalogues_range_is_at_the_edge_and_does_not_fit() -> None:
    """The same stream (38 MiB reserved without a limit, 26 MiB after the free-and-retry) on a 40 MiB device with
    2 MiB outside the allocator: it completes, margin 0. With 6 MiB outside (the catalogue's high end) the allocator
    gets 34 MiB: the new 14 MiB segment fails, the cached 12 MiB one is released, 12 + 14 = 26 MiB: it still fits.
    With 16 MiB outside it gets 24 MiB: 12 + 14 = 26 MiB does not fit: the margin is inside the catalogue's range, at
    the edge, and the verdict is that it does not fit (decided by the bytes outside the allocator)."""
    step = _step([("alloc", 1, 12 * MiB), ("alloc", 2, 12 * MiB), ("free", 1)], [("alloc", 3, 14 * MiB)])
    doc = _doc()
    still = P.replay_on_device(doc, step, 40 * MiB, 2 * MiB, "", outside_high=6 * MiB)
    assert still.fits and still.high_fits is True and still.outside_high == 6 * MiB
    r = P.replay_on_device(doc, step, 40 * MiB, 2 * MiB, "", outside_high=16 * MiB)
    assert r.fits and r.high_fits is False
    pred = P.DevicePrediction(T.Target(40 * MiB, None, "none"), O.Figure(2 * MiB, "ASSUMPTION", "t"), r)
    assert pred.completes and pred.uncertain and not pred.fits and pred.margin == 0
    assert pred.decided_by == "outside" and pred.oom is None
    assert pred.sentence().startswith("does NOT fit on the device, AT THE EDGE: it completes only with the typical")
    assert pred.lines()[0].startswith("reserve above the allocated peak: ")
    assert pred.extension()["verdict"]["uncertain"] is True and pred.extension()["verdict"]["fits"] is False
    assert P.DevicePrediction(T.Target(40 * MiB, None, "none"), O.Figure(2 * MiB, "ASSUMPTION", "t"), still).fits
    assert pred.extension()["verdict"]["outside_high"] == 16 * MiB
    # a margin larger than the range: no second replay is needed (no cudaMalloc passes the lower capacity)
    roomy = P.replay_on_device(doc, step, 80 * MiB, 2 * MiB, "", outside_high=16 * MiB)
    assert (
        roomy.high_fits is True
        and not P.DevicePrediction(T.Target(80 * MiB, None, "none"), O.Figure(0, "A", "t"), roomy).uncertain
    )
    # a figure the ledger holds has no range: nothing is asked
    held = P.replay_on_device(doc, step, 40 * MiB, 2 * MiB, "")
    assert (
        held.high_fits is None
        and "uncertain"
        not in P.DevicePrediction(
            T.Target(40 * MiB, None, "none"), O.Figure(2 * MiB, "MEASURED", "t"), held
        ).extension()["verdict"]
    )
    assert T.high_of(O.Figure(1, "MEASURED", "t")) is None


def test_tensors_alone_over_the_capacity_try_no_setting() -> None:
    step = _step([("alloc", 1, 30 * MiB)], [])
    r = P.replay_on_device(_doc(), step, 20 * MiB, 0, "")
    pred = P.DevicePrediction(T.Target(20 * MiB, None, "none"), O.Figure(0, "MEASURED", "t"), r)
    assert not pred.fits and pred.decided_by == "allocated" and r.tried == []
    assert any("no allocator setting changes that" in line for line in pred.lines())


def test_the_declared_allocator_settings_are_replayed_and_a_bad_one_is_refused_at_its_field() -> None:
    from ledgerspec.errors import LedgerspecError

    r = P.replay_on_device(_doc(), FRAGMENTING, 41 * MiB, 0, "expandable_segments:True")
    assert r.fits and r.alloc_conf == "expandable_segments:True"
    assert all(not t.setting.startswith("expandable") for t in r.tried)
    doc = _doc("  pytorch_cuda_alloc_conf: max_split_size_mb:1\n")
    with pytest.raises(LedgerspecError, match="max_split_size_mb too small") as info:
        P.replay_on_device(doc, FRAGMENTING, 41 * MiB, 0, "max_split_size_mb:1")
    assert info.value.line == 4


# -- which device, and what lies outside its allocator ----------------------------------------------------------


def test_the_device_is_named_by_the_target_then_the_catalogue_then_the_declared_gpu() -> None:
    named = _doc("result:\n  target_device: {name: My card, memory: 24 GiB}\n")
    assert T.target_of(named, 24 * GiB).named_by == "result.target_device.name"
    # --device-memory asking about another size than the target's: the name is not that device's
    other = T.target_of(named, 80 * GiB, from_flag=True)
    assert (other.name, other.named_by) == ("NVIDIA A100 80GB", "catalogue")  # 81920 MiB exactly
    rtx = T.target_of(_doc(), 24 * GiB)  # an RTX 3090's nvidia-smi total exactly (24576 MiB)
    assert rtx.name == "NVIDIA GeForce RTX 3090" and "as near" not in rtx.how
    assert "also within 1%: NVIDIA GeForce RTX 4090" in rtx.how  # the other card it could be, said
    ada = T.target_of(_doc(), 24 * 10**9)  # "24 GB" as sold: both cards, the first in the catalogue's order
    assert ada.name == "NVIDIA GeForce RTX 3090" and "as near: NVIDIA GeForce RTX 4090" in ada.how
    assert T.target_of(_doc(), 24564 * MiB).name == "NVIDIA GeForce RTX 4090"  # its nvidia-smi total
    decimal = T.target_of(_doc(), 80 * 10**9)  # "80 GB" as sold: two entries, the first in the catalogue's order
    assert decimal.name == "NVIDIA A100 80GB" and "as near: NVIDIA H100 80GB HBM3" in decimal.how
    # the rented cards of the catalogue are named by their memory too, and the 24 GB ones are said as near: a size
    # alone names the first card of the catalogue's order, and the line says which others it could be
    assert "as near: NVIDIA GeForce RTX 4090, NVIDIA A10G, NVIDIA L4 (to decide on one of them, name it: " in ada.how
    assert "name it: result.target_device.name)" in ada.how  # the size came from the ledger
    asked = T.target_of(_doc(), 24 * 10**9, from_flag=True)
    assert "(to decide on one of them, name it: --device-memory 'NAME')" in asked.how
    assert T.target_of(_doc(), 16 * 10**9).name == "Tesla T4"  # "16 GB" as sold (a V100 16GB is not catalogued)
    assert T.target_of(_doc(), 32 * 10**9).name == "NVIDIA GeForce RTX 5090"
    assert T.target_of(_doc(), 48 * GiB).name == "NVIDIA RTX A6000"  # 49140 MiB, within 1 %; the L40S is 46068
    declared = _doc("  gpu_name: NVIDIA RTX A2000\n")
    assert T.target_of(declared, 6 * GiB).named_by == "software.gpu_name"
    assert T.target_of(_doc(), 6 * GiB).named_by == "none"


def test_outside_the_allocator_the_ledger_figure_else_the_catalogue_for_the_named_device() -> None:
    held = _doc("outside_allocator:\n  total: {value: 900 MiB, source: ASSUMPTION, note: our card}\n")
    fig = T.outside_of(held, T.target_of(held, 24 * GiB))
    assert (fig.bytes, fig.source, fig.estimate) == (900 * MiB, "ASSUMPTION", None) and "our card" in fig.method
    doc = _doc()
    fig = T.outside_of(doc, T.target_of(doc, 24564 * MiB))
    expected = O.estimate(O.Stack(gpu_name="NVIDIA GeForce RTX 4090"))
    assert fig.estimate is not None and fig.estimate.arch == "sm_89" and fig.bytes == expected.typical
    assert fig.source == "ASSUMPTION"  # a published figure of someone else's card, not a measurement of this one


def test_what_the_ledger_holds_outside_the_allocator_is_of_its_own_ranks_and_card() -> None:
    """A figure measured on one A100 (``measure --device cuda`` writes the card's name and the total) is that rank's:
    asked about eight ranks (a ``--devices`` row, ``shard --nproc 8``) NCCL's buffers are not in it, asked about an
    H100 its context is another architecture's; both take the catalogue's figure for the rank asked about, as a
    ledger holding nothing would, and say why."""
    text = (
        "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA A100-SXM4-80GB}\nparallelism: {gpu_count: 1}\n"
        "measurement: {device: cuda, device_name: NVIDIA A100-SXM4-80GB}\n"
    )
    held = from_text(text + "outside_allocator: {total: {value: 1 GiB, source: MEASURED, method: m}}\n")
    bare = from_text(text)
    a100 = T.Target(80 * GiB, "NVIDIA A100-SXM4-80GB", "catalogue", "t")
    h100 = T.Target(80 * GiB, "NVIDIA H100 80GB HBM3", "catalogue", "t")
    assert (T.outside_of(held, a100).bytes, T.outside_of(held, a100).source) == (GiB, "MEASURED")
    assert T.outside_of(held, a100, 1).bytes == GiB  # its own count, asked for
    eight = T.outside_of(held, a100, 8)
    assert eight.estimate is not None and eight.bytes == T.outside_of(bare, a100, 8).bytes
    assert "of 1 rank(s), not 8" in eight.method
    other = T.outside_of(held, h100)
    assert (
        other.estimate is not None and other.estimate.arch == "sm_90" and other.bytes == T.outside_of(bare, h100).bytes
    )
    assert "(sm_80), not NVIDIA H100 80GB HBM3 (sm_90)" in other.method
    assert T.held_elsewhere(bare, h100, 8) is None  # nothing held: nothing to say
    # a part the ledger holds follows the same rule
    part = from_text(text + "outside_allocator: {context: {value: 700 MiB, source: MEASURED}}\n")
    assert T.outside_of(part, a100).estimate.part("context").typical == 700 * MiB  # type: ignore[union-attr]
    assert T.outside_of(part, h100).bytes == T.outside_of(bare, h100).bytes
    # the ledger's own device, however it is named: a free-form target name on its declared memory keeps the figure
    mine = from_text(
        "ledgerspec: ledger/v1\nresult: {target_device: {name: 24 GB card (RTX 3090 / 4090), memory: 24GiB}}\n"
        "measurement: {device: cuda, device_name: NVIDIA GeForce RTX 4090}\n"
        "outside_allocator: {total: {value: 900 MiB, source: MEASURED, method: m}}\n"
    )
    own = T.target_of(mine, 24 * GiB)
    assert own.name == "24 GB card (RTX 3090 / 4090)" and T.outside_of(mine, own).bytes == 900 * MiB
    # another memory, a card whose architecture is not known: nothing says it is another card, the figure is kept
    assert T.outside_of(mine, T.Target(16 * GiB, "My lab card", "catalogue", "t")).bytes == 900 * MiB
    # a CPU measurement's device name (the processor) is not a GPU's: the declared card decides
    cpu = from_text(
        text.replace("device: cuda, device_name: NVIDIA A100-SXM4-80GB", "device: cpu, device_name: x86_64")
        + "outside_allocator: {total: {value: 1 GiB, source: ASSUMPTION, note: ours}}\n"
    )
    assert T.outside_of(cpu, a100).bytes == GiB and T.held_elsewhere(cpu, h100) is not None


# -- the whole command on a tiny model --------------------------------------------------------------------------


@pytest.mark.slow  # traces a model
def test_estimate_decides_on_the_device_and_keeps_the_allocated_figures(
    tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capacity between the allocated peak (with the cuBLAS workspaces) and the reserved peak: the allocated peak
    says it fits, the allocator replay says it does not; the allocated figures are the plain estimate's to the
    byte."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.allocator.step import reserved_step
    from ledgerspec.derivations.estimate.estimator import estimate
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    path = tmp_path / "t.ledger.yaml"
    outside_text = "outside_allocator:\n  total: {value: 256 MiB, source: ASSUMPTION, note: a test figure}\n"
    path.write_text(ledger_text(microbatch=2, seq=128) + outside_text)
    plain = estimate(load(path))
    # the device replay adds the cuBLAS handles' workspaces to the stream (8,519,680 B each, pytorch/pytorch#95668)
    workspaces = ((8_519_680,), (8_519_680,))
    free = reserved_step(load(path), workspaces=workspaces)
    peak_reserved = max(p.reserved for p in free.phases.values())
    needed = plain.peak_allocated + sum(map(sum, workspaces))  # the tensors and the workspaces must fit
    assert needed < peak_reserved
    capacity = (needed + peak_reserved) // 2
    device = 256 * MiB + capacity
    monkeypatch.setenv("LEDGERSPEC_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = cli("estimate", path, "--device-memory", str(device))
    assert code == 1, err  # does not fit
    assert "does NOT fit on the device" in out and "allocated only: fits" in out
    assert "decided by fragmentation" in out
    doc = load(path)
    assert doc.get("x-estimate", "phases").value == plain.phases  # the allocated figures, unchanged
    assert doc.get("x-estimate", "peak_allocated").size() == plain.peak_allocated
    assert doc.get("x-estimate", "peak_reserved").size() == peak_reserved  # the unlimited replay: it ran out
    assert doc.get("x-estimate", "device_peak").size() == peak_reserved + 256 * MiB
    assert doc.get("x-estimate", "device_peak").source == "ASSUMPTION"
    assert doc.get("x-estimate", "fits").switch() is False and doc.get("result", "fits").switch() is False
    verdict = doc.get("x-estimate", "verdict").value
    assert verdict["capacity"] == capacity and verdict["decided_by"] == "fragmentation"
    # the fragmentation is the replay's own reserved - allocated at its out-of-memory (the same stream, replayed here)
    tight = reserved_step(load(path), capacity=capacity, device_total=device, workspaces=workspaces)
    assert tight.oom is not None
    assert verdict["oom"]["fragmentation"] == tight.oom.reserved - tight.oom.allocated == verdict["fragmentation"]
    assert verdict["oom"]["phase"] == tight.oom.phase
    # the status ladder and the report's verdict read the device-level figure
    _, validated, _ = cli("validate", "-v", path)
    first = validated.splitlines()[0]
    assert "DOES NOT FIT" in first and "x-estimate.device_peak" in first and "decided by fragmentation" in first
    # asked again: the estimate cache answers, the same verdict; a plain estimate is in the cache too
    code, again, _ = cli("estimate", path, "--device-memory", str(device), "--dry-run")
    assert code == 1 and "from the estimate cache" in again
    assert again.split("time:")[0] == out.split("time:")[0]
    from ledgerspec.derivations.estimate.cache import EstimateCache

    cached = estimate(load(path), store=EstimateCache(tmp_path / "cache"))
    assert cached.cached_from is not None and cached.phases == plain.phases


def test_the_devices_comparison_says_no_at_the_edge_where_the_catalogues_high_figure_runs_out() -> None:
    """``estimate --devices`` replays each device as ``estimate`` does, the catalogue's high figure included: one
    9 GiB tensor on an A100 (sm_80: context + lazily loaded modules outside the allocator, typical 450 + 256 MiB,
    high 650 + 768 MiB) with 10 GiB of CUDA total leaves the allocator 9,534 MiB (fits) or 8,822 MiB (does not):
    at the edge, so it does not fit; with 12 GiB it fits either way."""
    from ledgerspec.derivations.devices.catalogue import Device
    from ledgerspec.derivations.devices.comparison import _on_device

    step = _step([("alloc", 1, 9 * GiB)], [])
    verdict = _on_device(_doc(), {1: [step]})
    tight = Device("NVIDIA A100-SXM4-80GB", "80 GB", 10 * GiB, 0, "test", capacity=10 * GiB)
    v = verdict(tight, 1)
    fits, margin, uncertain = v.fits, v.headroom, v.uncertain
    # the two cuBLAS workspaces (8,519,680 B each) share one 20 MiB segment: the first takes a new one (a request of
    # 1 to 10 MiB), the second fits in what it leaves
    assert not fits and uncertain and margin == 10 * GiB - 9 * GiB - 20 * MiB - (450 + 256) * MiB
    roomy = Device("NVIDIA A100-SXM4-80GB", "80 GB", 12 * GiB, 0, "test", capacity=12 * GiB)
    assert verdict(roomy, 1).fits is True and verdict(roomy, 1).uncertain is False


def test_the_devices_comparison_takes_a_paged_state_from_the_estimate() -> None:
    """A paged optimizer's state counts in the catalogue's high end. ``--devices`` takes it from each stream's
    estimate (an intake has no ``ledger.optimizer``; a sharded rank holds its own share): the same high end as a
    ledger stating that state, whatever the ledger states."""
    from ledgerspec.derivations.devices.catalogue import Device
    from ledgerspec.derivations.devices.comparison import _on_device

    step = _step([("alloc", 1, 8 * GiB)], [])
    paged = "optimizer: {name: paged_adamw_8bit}\n"
    ledger = "ledger:\n  optimizer: {{value: {}, source: CALCULATED, method: m}}\n"
    intake, stating = _doc(paged), _doc(paged + ledger.format(GiB))
    wrong = _doc(paged + ledger.format(8 * GiB))
    card = Device("NVIDIA A100-SXM4-80GB", "80 GB", 10 * GiB, 0, "test", capacity=10 * GiB)
    # the paged state decides: 8 GiB + the typical outside fit; with 1 GiB of paged state resident they do not
    assert _on_device(stating, {1: [step]})(card, 1).uncertain is True
    assert _on_device(intake, {1: [step]})(card, 1).uncertain is False  # no state known: the high end lacks it
    for doc in (intake, stating, wrong):
        assert _on_device(doc, {1: [step]}, {id(step): GiB})(card, 1) == _on_device(stating, {1: [step]})(card, 1)


def test_a_devices_row_decided_by_fragmentation_says_how_much() -> None:
    """``estimate --devices``: a device whose allocator can get 61 MiB beside the ledger's 1 GiB outside it runs the
    fragmenting stream out of memory with 18 MiB free in blocks that could not serve the 16 MiB request (above), plus
    what the cuBLAS workspaces leave of their 20 MiB segment (two of 8,519,680 B: 3.75 MiB): the row keeps that
    figure, the table prints it, ``x-devices`` records it."""
    from ledgerspec.derivations.devices.catalogue import Device
    from ledgerspec.derivations.devices.comparison import Row, _on_device

    doc = _doc("outside_allocator:\n  total: {value: 1GiB, source: MEASURED}\n")
    card = Device("Test card", "1 GB", GiB + 61 * MiB, 0, "a test", capacity=GiB + 61 * MiB)
    v = _on_device(doc, {1: [FRAGMENTING]})(card, 1)
    left = 20 * MiB - 2 * 8_519_680
    assert (v.fits, v.decided_by, v.uncertain, v.headroom) == (False, "fragmentation", False, -5 * MiB)
    assert v.fragmentation == 18 * MiB + left
    row = Row(card, 1, 30 * MiB, v.fits, v.headroom, None, decided_by=v.decided_by, fragmentation=v.fragmentation)
    assert row.to_extension()["fragmentation"] == 18 * MiB + left
    from ledgerspec.faces.commands.estimate.devices import fits_cell

    assert fits_cell(row) == "NO (fragmentation: 21.75 MiB free but unusable)"
    roomy = Device("Roomy card", "2 GB", 2 * GiB, 0, "a test", capacity=2 * GiB)
    # it fits: nothing decided by fragmentation
    assert _on_device(doc, {1: [FRAGMENTING]})(roomy, 1).fragmentation is None
