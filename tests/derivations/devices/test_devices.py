"""``estimate --devices``: the catalogue (data in the package, a user file on top) and the comparison."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ledgerspec.derivations.devices import compare
from ledgerspec.derivations.devices.catalogue import CATALOGUE, load_catalogue
from ledgerspec.derivations.estimate.fit import PHASES
from ledgerspec.derivations.estimate.fitmodel import AT_PEAK
from ledgerspec.errors import LedgerspecError
from tests.support.estimate_docs import ledger

#: totals as nvidia-smi prints them, from the sources the catalogue cites (MiB)
NVIDIA_SMI_MIB = {
    "NVIDIA GeForce RTX 3090": 24576,
    "NVIDIA GeForce RTX 4090": 24564,
    "NVIDIA L40S": 46068,
    "NVIDIA A100 40GB": 40960,
    "NVIDIA A100 80GB": 81920,
    "NVIDIA H100 80GB HBM3": 81559,
    "NVIDIA H200": 143771,
    "Tesla T4": 15360,  # robbyant-research/MagicQuill#57
    "NVIDIA GeForce RTX 5090": 32607,  # noonghunna/club-3090#617
    "NVIDIA A10G": 23028,  # NVIDIA/DCGM#232
    "NVIDIA L4": 23034,  # NVIDIA/TensorRT-LLM#2398, vllm-project/vllm#4959
    "NVIDIA RTX A6000": 49140,  # vllm-project/vllm#1201
}


def test_the_catalogue_has_the_common_accelerators_each_with_its_source() -> None:
    cat = load_catalogue()
    names = {d.name for d in cat.devices}
    assert set(NVIDIA_SMI_MIB) | {"AMD Instinct MI300X"} <= names
    for d in cat.devices:
        assert d.source.startswith("vendor: http") and "total:" in d.source, d.name
        assert 0 < d.reserve < d.total and d.usable == d.total - d.reserve
        sold = float(re.match(r"(\d+) GB", d.vendor_memory).group(1))  # type: ignore[union-attr]
        assert 0.9 < d.total / (sold * 2**30) < 1.1, d.name  # "24 GB" cards hold about 24 GiB
    for name, mib in NVIDIA_SMI_MIB.items():
        assert next(d for d in cat.devices if d.name == name).total == mib * 2**20, name
    # the H100's total as the modal-labs PR quotes it in bytes
    assert next(d for d in cat.devices if d.name == "NVIDIA H100 80GB HBM3").total == 85520809984
    assert "pytorch/pytorch/issues/34323" in cat.reserve_source


def test_a_user_file_adds_and_replaces_devices(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "devices:\n"
        "  - {name: NVIDIA GeForce RTX 4090, vendor_memory: 24 GB, total: 24564MiB, reserve: 600MiB, source: mine}\n"
        "  - {name: My Card, total: 16GiB, source: measured here}\n",
        encoding="utf-8",
    )
    cat = load_catalogue(str(mine))
    by = {d.name: d for d in cat.devices}
    assert by["NVIDIA GeForce RTX 4090"].reserve == 600 * 2**20 and by["NVIDIA GeForce RTX 4090"].source == "mine"
    assert by["My Card"].total == 16 * 2**30 and by["My Card"].reserve == load_catalogue().devices[0].reserve
    assert cat.files == ["ledgerspec derivations/devices/devices.yaml", str(mine)]


def test_a_catalogue_that_is_not_yaml_is_refused_at_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: [{name: x, total: 1GiB}\nfoo: 1\n", encoding="utf-8")
    with pytest.raises(LedgerspecError) as err:
        load_catalogue(str(bad))
    assert (err.value.line, err.value.column) == (2, 1) and "not a YAML device catalogue" in err.value.message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("devices: [{name: x}]", "needs `name` and `total`"),
        ("devices: [{name: x, total: 1GiB, reserve: 2GiB}]", "is not below total"),
        ("devices: [{name: x, total: 24 gb}]", "unknown unit"),
        ("[1, 2]", "a mapping with a list `devices`"),
        # a ledger where the catalogue goes (`estimate --devices FILE` took it as CATALOGUE, or named twice)
        ("ledgerspec: ledger/v1\nmethod: {kind: LoRA}\n", "a ledgerspec document ('ledger/v1'), not a device"),
    ],
)
def test_a_bad_catalogue_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(LedgerspecError, match=re.escape(message)):
        load_catalogue(str(bad))
    assert CATALOGUE.is_file()


@dataclass
class _Est:
    phases: dict[str, int]
    figures: dict[str, int]


def _fn(per_row: int) -> object:
    def estimate(doc: object) -> _Est:
        b = doc.get("workload", "microbatch").integer()  # type: ignore[attr-defined]
        figures = {k: 4 << 30 for k in PHASES}
        figures["backward_peak"] = (4 << 30) + b * per_row
        for c in AT_PEAK:
            figures[f"at.backward_peak.{c}"] = 0
        return _Est({k: figures[k] for k in PHASES}, figures)

    return estimate


def test_data_parallel_rows_are_one_gpu_each_and_the_largest_microbatch_fits_the_usable_memory() -> None:
    doc = ledger(microbatch=2, seq=1024)
    cat = load_catalogue()
    result = compare(doc, cat, _fn(2 << 30))  # type: ignore[arg-type]
    assert {r.gpus for r in result.rows} == {1} and "data parallel" in result.notes[0]
    for r in result.rows:
        assert r.peak == (4 << 30) + 2 * (2 << 30)
        best = r.largest_microbatch or 0
        assert (4 << 30) + best * (2 << 30) <= r.device.usable < (4 << 30) + (best + 1) * (2 << 30), r.device.name


def test_fsdp2_rows_use_the_simulated_worst_rank_per_gpu_count() -> None:
    from ledgerspec.contract.edit import variant

    doc = variant(ledger(microbatch=2, seq=1024), {("memory_options", "sharding"): "fsdp2"})
    worst = {2: 7 << 30, 4: 6 << 30, 8: 5 << 30}
    result = compare(doc, load_catalogue(), _fn(2 << 30), per_rank=lambda n: worst[n])  # type: ignore[arg-type]
    rows = [r for r in result.rows if r.device.name == "NVIDIA GeForce RTX 4090"]
    assert [(r.gpus, r.peak) for r in rows] == [(1, 8 << 30), (2, 7 << 30), (4, 6 << 30), (8, 5 << 30)]
    # sharding saves the same bytes at every microbatch: the largest microbatch grows with the saving
    assert [r.largest_microbatch for r in rows] == sorted(r.largest_microbatch or 0 for r in rows)


def test_the_tables_sharding_is_read_as_the_other_commands_read_it() -> None:
    """``parallelism.strategy`` first, then ``memory_options.sharding``; FSDP1's names are fsdp1, ``fsdp`` is
    FSDP2 (as ``shard`` runs it), data parallel stays data parallel whatever memory_options says."""
    from ledgerspec.contract.config import sharded_ranks
    from ledgerspec.contract.document import from_text
    from ledgerspec.contract.fsdp1_precision import declares_fsdp1
    from ledgerspec.derivations.devices.comparison import _sharding

    def doc(strategy: str | None, sharding: str | None, gpus: int = 2) -> object:
        p = f"parallelism: {{gpu_count: {gpus}" + (f", strategy: '{strategy}'" if strategy else "") + "}\n"
        m = f"memory_options: {{sharding: '{sharding}'}}\n" if sharding else ""
        return from_text("ledgerspec: ledger/v1\n" + p + m)

    assert _sharding(doc(" FullyShardedDataParallel ", None)) == "fsdp1"  # type: ignore[arg-type]
    assert _sharding(doc("fsdp", None)) == "fsdp2"  # type: ignore[arg-type]
    assert _sharding(doc("zero3", "fsdp2")) == "zero3"  # type: ignore[arg-type]
    assert _sharding(doc("ddp", "fsdp2")) == "ddp" and sharded_ranks(doc("ddp", "fsdp2")) is None  # type: ignore[arg-type]
    assert _sharding(doc(None, None)) == "none"  # type: ignore[arg-type]
    assert declares_fsdp1(doc(None, "fsdp_v1")) and sharded_ranks(doc(None, "fsdp_v1")) == 2  # type: ignore[arg-type]
    assert sharded_ranks(doc("fsdp2", None, gpus=1)) is None  # type: ignore[arg-type]


def test_a_row_decided_on_the_device_is_judged_against_what_the_allocator_can_get_and_bounds_the_largest() -> None:
    """Issue 23, found by a newcomer trial: on the device the table showed the catalogue's usable memory (nvidia-smi's
    total less a flat reserve) beside a verdict replayed against CUDA's total less what lies outside the allocator,
    and a largest microbatch from the allocated tensors that the device then did not hold (``--fit`` answered 6
    where the row said 8). Now ``usable`` is what the allocator can get, and the largest microbatch is an upper
    bound against it: the allocated tensors and the cuBLAS workspaces (two of 8,519,680 B, or 32 MiB each on
    Hopper and later) fit it, one more row does not."""
    from types import SimpleNamespace

    from ledgerspec.derivations.allocator.step import StepEvents

    windows = ["0:frozen_params", "1:adapter", "2:optimizer", "3:activations", "4:temporary", "5:optimizer"]
    windows += ["6:activations", "7:temporary", "8:optimizer"]
    events: list[tuple[object, ...]] = []
    for label in windows:
        events.append(("phase", label))
        if label == "3:activations":  # the whole step: one 8 GiB tensor (the model's peak at microbatch 2)
            events += [("alloc", 1, 8 << 30), ("free", 1)]
    step = StepEvents(events, windows, 1, {}, method="by hand")
    doc = ledger(microbatch=2, seq=1024)
    single = SimpleNamespace(components={})
    result = compare(doc, load_catalogue(), _fn(2 << 30), on_device=True, single_step=lambda: (single, step))  # type: ignore[arg-type]
    # 32 MiB workspaces: compute capability 9.x, 10.x and 12.x (the RTX 5090: pytorch/pytorch#175344), gfx942 too
    hopper = {"NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GeForce RTX 5090", "AMD Instinct MI300X"}
    for r in result.rows:
        assert r.usable is not None and r.device_peak is not None and r.largest_at_most and r.memory == r.usable
        # the replay reserves the tensor's 8 GiB segment and the Python thread's workspace's own, taken at the first
        # forward: 20 MiB for a request of 1-10 MiB (the autograd thread's, at the first backward, fits what is left)
        # or, on Hopper, 32 MiB (a request over 10 MiB, rounded to 2 MiB; the autograd thread's 32 MiB is split from
        # the tensor's cached 8 GiB segment, freed by then: best fit)
        workspaces = 2 * (32 << 20) if r.device.name in hopper else 2 * 8_519_680
        segments = (8 << 30) + (32 << 20 if r.device.name in hopper else 20 << 20)
        outside = r.device_peak - segments
        assert r.usable == r.device.capacity - outside < r.device.usable + (1 << 30), r.device.name
        assert r.headroom == r.device.capacity - r.device_peak
        best = r.largest_microbatch or 0
        assert (4 << 30) + best * (2 << 30) + workspaces <= r.usable < (4 << 30) + (best + 1) * (2 << 30) + workspaces
    ext = result.to_extension()
    assert ext["rows"][0]["largest_at_most"] is True and ext["rows"][0]["memory"] == result.rows[0].usable
    assert ext["usable_memory"].startswith("decided on the device: usable = what the caching allocator can get")
