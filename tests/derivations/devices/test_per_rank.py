"""``shard --estimate`` decides on the device, rank by rank (issue 23): each simulated rank's allocation stream, every
allocation on the stream FSDP made it on, replayed through the allocator model plus what lies outside it.

Independent figures: the per-rank plan of :mod:`ledgerspec.derivations.shard.state` (checked against real FSDP1 flat
parameters in ``tests/derivations/shard/test_fsdp1.py``) bounds what the load may hold; the allocated figures must be
the ones the plain simulation gives (the device-level verdict adds figures, it changes none).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.contract.units import format_size
from tests.support import TESTS, run_cli

DATA = TESTS / "data" / "sharding"
GiB = 2**30
pytestmark = pytest.mark.slow  # simulated FSDP steps of a tiny model: a few seconds each


def _ledger(tmp_path: Path, strategy: str, extra: str = "") -> Path:
    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    text = (DATA / "tiny-lora.ledger.yaml").read_text(encoding="utf-8")
    text = text.replace("strategy: fsdp2", f"strategy: {strategy}").replace("sharding: fsdp2", f"sharding: {strategy}")
    path = tmp_path / "ledger.yaml"
    path.write_text(text + extra, encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=["fsdp1", "fsdp2"])
def both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.fsdp.simulate import estimate_per_rank
    from ledgerspec.derivations.shard.model import document_descriptors

    path = _ledger(tmp_path_factory.mktemp(request.param), request.param)
    doc = load(path)
    descs = document_descriptors(doc)
    plain = estimate_per_rank(doc, 2, descs, target="cuda")
    streamed = estimate_per_rank(doc, 2, descs, target="cuda", streams=True)
    return {"strategy": request.param, "doc": doc, "descs": descs, "plain": plain, "streamed": streamed, "path": path}


def test_the_allocated_figures_do_not_change(both: dict[str, Any]) -> None:
    plain, streamed = both["plain"], both["streamed"]
    for a, b in zip(plain.ranks, streamed.ranks, strict=True):
        assert a.phases == b.phases
        assert a.components == b.components and a.activations == b.activations
        assert a.step is None and b.step is not None
        # the stream's own count of the tracker is the figures' tracker: the same run
        assert b.step.figures["forward_peak"] == b.phases["forward_peak"]


def test_fsdp_allocates_on_streams_of_its_own(both: dict[str, Any]) -> None:
    """FSDP1 all-gathers into its unshard stream and reduces on its post-backward stream; FSDP2 copies in and
    all-gathers on streams of its own: the replay gets them apart (the allocator keeps a pool per stream)."""
    events = both["streamed"].ranks[0].step.events
    streams = {e[3] for e in events if e[0] == "alloc"}
    assert 0 in streams and len(streams) >= 3, streams


def test_the_host_runs_ahead_of_the_device(both: dict[str, Any]) -> None:
    """FSDP1's ``record_stream`` frees are pending until the host waits: at its rate limiter (two all-gathers in
    flight: the wait before the third leaves the last reshard's free pending) and at the Trainer's loss check after
    each micro-step (every pending free completes). FSDP2 calls no ``record_stream``."""
    events = both["streamed"].ranks[0].step.events
    pending = [e for e in events if e[0] == "free" and e[2:] == ("pending",)]
    syncs = [e[1] for e in events if e[0] == "sync"]
    if both["strategy"] == "fsdp2":
        assert pending == []
        return
    units = 2 + 1  # the tiny model's decoder layers and the root: one unsharded flat parameter each, per pass
    assert len(pending) >= 2 * units  # freed after forward and again after backward
    assert syncs.count(0) == 2  # one micro-step in the first step, one in the steady state
    assert any(keep > 0 for keep in syncs)  # the rate limiter's wait leaves later frees pending


def test_fsdp1_brings_one_unit_at_a_time_to_the_device(both: dict[str, Any]) -> None:
    """The load window holds at most the rank's shards plus two unsharded units (the unit's parameters and the flat
    parameter FSDP1 flattens them into), never the whole unsharded model, as a Trainer + accelerate run loads."""
    if both["strategy"] != "fsdp1":
        pytest.skip("FSDP2 materialises only the shards in either case")
    from ledgerspec.derivations.shard import state as S

    plan = S.fsdp1(S.peft_fsdp1_units(both["descs"]), 2, "adamw_torch", True)
    largest = max(plan.unit_unsharded.values())
    whole = sum(plan.unit_unsharded.values())
    step = both["streamed"].ranks[0].step
    load_peak, held = step.tracker_windows[step.windows[0]]
    rank0 = plan.ranks[0]
    assert held == both["plain"].ranks[0].phases["after_load"]
    shards = rank0.frozen_base + rank0.adapter
    assert shards + largest <= load_peak <= shards + 2 * largest + 64 * 512
    assert whole > largest  # (several units: the bound is not the whole model's)


def test_the_verdict_is_decided_on_the_device(both: dict[str, Any]) -> None:
    from ledgerspec.derivations.devices.per_rank import ranks_on_device

    est = both["streamed"]
    memory = 4 * GiB
    est.device = ranks_on_device(both["doc"], est, memory, 2)
    for r, d in zip(est.ranks, est.device, strict=True):
        assert d.device_peak == d.peak_reserved + d.outside
        assert d.peak_reserved >= d.peak_allocated >= r.peak  # whole blocks; the tracker's 512-byte count
        assert d.outside > 0  # the CUDA context and two ranks' NCCL buffers (the catalogue)
    fits = est.fits(memory)
    assert [f.peak for f in fits] == [d.device_peak for d in est.device]
    # a device larger than every allocated peak but smaller than the device-level one: does not fit
    tight = max(r.peak for r in est.ranks) + 1024
    est.device = ranks_on_device(both["doc"], est, tight, 2)
    assert not any(d.fits for d in est.device)
    assert not any(f.fits for f in est.fits(tight))


def test_shard_says_which_figure_it_compared(both: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    code, stdout, _ = run_cli("shard", both["path"], "--estimate", "--device-memory", "4GiB", "-o", out)
    assert code == 0, stdout
    assert "fits on the device: device peak" in stdout
    assert "2 x 4.00 GiB: fits on the device (worst rank device peak" in stdout
    block = load(out).get("parallelism", "x-per-rank", "estimate").raw
    assert block["compared"].startswith("each rank's device_peak")
    row = block["ranks"][0]
    assert row["device_peak"]["value"] == row["peak_reserved"]["value"] + row["outside_allocator"]["value"]
    assert row["verdict"]["fits"] is True and row["fits"] is True
    # the answer recorded as `estimate` records its own, and read by validate -v: what one of the 2 ranks holds
    written = load(out)
    assert written.get("result", "target_device", "memory").size() == 4 * GiB
    assert written.get("result", "fits").switch() is True
    # asked again of the written ledger: nothing to change (a pre-commit hook's --check)
    code, _, err = run_cli("shard", out, "--estimate", "--device-memory", "4GiB", "--check")
    assert code == 0, err
    assert set(block["inputs"]) >= {"parallelism", "workload", "method"}
    code, stdout, _ = run_cli("validate", "-v", out)
    worst = max(r["device_peak"]["value"] for r in block["ranks"])
    assert "FITS on the target device (4.00 GiB): predicted peak" in stdout
    assert "(parallelism.x-per-rank.estimate)" in stdout and f"the worst of {len(block['ranks'])}" in stdout
    assert format_size(worst) in stdout
    # one GPU's estimate of the whole model records no result.fits for the sharded run
    estimated = tmp_path / "estimated.yaml"
    code, _, err = run_cli("estimate", both["path"], "--device-memory", "4GiB", "-o", estimated)
    assert code == 0, err
    assert load(estimated).get("result", "target_device", "memory").size() == 4 * GiB
    assert not load(estimated).get("result", "fits").present
    code, stdout, _ = run_cli("shard", both["path"], "--estimate", "--device-memory", "4GiB", "--target", "cpu")
    assert "allocated tensors only: the CPU target has no caching allocator to replay" in stdout


def test_a_paged_state_is_each_ranks_own(both: dict[str, Any]) -> None:
    """With a paged optimizer the catalogue's high end counts its state as possibly resident: on each rank that is
    the rank's own shard of it (its estimate's optimizer component), whether the ledger states
    ``ledger.optimizer`` (``resolve``'s whole-model figure, or nothing in an intake) or not."""
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.devices.per_rank import ranks_on_device
    from ledgerspec.derivations.devices.target import high_of, outside_of

    est = both["streamed"]
    path = both["path"]
    text = path.read_text(encoding="utf-8").replace("name: adamw_torch", "name: paged_adamw_8bit")
    assert "paged_adamw_8bit" in text
    share = est.ranks[0].components["optimizer"]
    assert share > 0
    intake = from_text(text, str(path))
    whole = from_text(
        text + f"ledger:\n  optimizer: {{value: {4 * share}, source: CALCULATED, method: m}}\n", str(path)
    )
    mine = from_text(text + f"ledger:\n  optimizer: {{value: {share}, source: CALCULATED, method: m}}\n", str(path))
    got = [ranks_on_device(doc, est, 4 * GiB, 2)[0] for doc in (intake, whole, mine)]
    want = high_of(outside_of(mine, got[0].target, 2))
    assert want is not None and want > high_of(outside_of(intake, got[0].target, 2))  # type: ignore[operator]
    assert [p.replayed.outside_high for p in got] == [want] * 3


@pytest.mark.parametrize("case", ["zero2", "zero3-param-offload"])
def test_a_zero_step_is_decided_on_the_device(tmp_path: Path, case: str) -> None:
    """DeepSpeed ZeRO's ranks are decided on the device too: each simulated rank's stream (DeepSpeed's own engine,
    every allocation it makes on the device; with ``offload_param`` the host's partitions leave no event) replayed
    against the device. Independent of the replay: the stream's live bytes at the training peak are the rank's
    simulated peak, and the allocated figures are those of the plain simulation (checked against real DeepSpeed
    ranks in ``tests/derivations/shard/test_zero.py``)."""
    pytest.importorskip("peft")
    pytest.importorskip("deepspeed")
    from ledgerspec.derivations.allocator.replay import replay
    from ledgerspec.derivations.devices.per_rank import ranks_on_device
    from ledgerspec.derivations.shard.zero.simulate import ONE_STREAM, estimate_zero_per_rank
    from tests.derivations.shard.test_zero import _zero_ledger
    from tests.derivations.shard.test_zero_offload import _offload_ledger

    if case == "zero2":
        path = _zero_ledger(tmp_path, 2)
    else:
        path = _offload_ledger(tmp_path, 3, "  parameter_placement: cpu\n")
    doc = load(path)
    plain = estimate_zero_per_rank(doc, 2, target="cuda")
    streamed = estimate_zero_per_rank(doc, 2, target="cuda", streams=True)
    assert ONE_STREAM in streamed.method and ONE_STREAM not in plain.method
    for a, b in zip(plain.ranks, streamed.ranks, strict=True):
        assert a.phases == b.phases and a.components == b.components and a.activations == b.activations
        assert a.host_phases == b.host_phases
        assert b.step is not None
        replayed = replay(b.step.events, granularity=512)
        training = b.step.windows[3:]  # after the load, the adapters and the engine's creation
        assert max(replayed.phases[w].peak_counted for w in training) == b.peak
    memory = 4 * GiB
    streamed.device = ranks_on_device(doc, streamed, memory, 2)
    for r, d in zip(streamed.ranks, streamed.device, strict=True):
        assert d.device_peak == d.peak_reserved + d.outside and d.peak_reserved >= d.peak_allocated >= r.peak
        assert d.fits
    tight = max(r.peak for r in streamed.ranks) + 1024  # the tensors fit; the reserve and the context do not
    assert not any(d.fits for d in ranks_on_device(doc, streamed, tight, 2))
    code, stdout, err = run_cli("shard", path, "--estimate", "--device-memory", "4GiB", "-o", tmp_path / "out.yaml")
    assert code == 0, err
    assert "2 x 4.00 GiB: fits on the device (worst rank device peak" in stdout
    assert "allocated tensors only" not in stdout


def test_devices_simulates_each_gpu_count_of_a_zero_ledger(tmp_path: Path) -> None:
    """``estimate --devices`` of a DeepSpeed ZeRO ledger: each GPU count's worst rank is DeepSpeed's own engine
    simulated on that many ranks and decided on each device (one GPU was shown)."""
    pytest.importorskip("peft")
    pytest.importorskip("deepspeed")
    from ledgerspec.derivations.shard.zero.simulate import estimate_zero_per_rank
    from tests.derivations.shard.test_zero import _zero_ledger

    path = _zero_ledger(tmp_path, 2)
    # named by parallelism.strategy alone (memory_options.sharding is optional)
    text = path.read_text(encoding="utf-8")
    assert "  sharding: zero2\n" in text
    path.write_text(text.replace("  sharding: zero2\n", ""), encoding="utf-8")
    out = tmp_path / "out.yaml"
    code, stdout, err = run_cli("estimate", path, "--devices", "--no-cache", "-o", out)
    assert code == 0, err
    assert "zero2: each GPU count's worst rank simulated" in stdout and "one GPU shown" not in stdout
    assert "zero2: each rank's allocations replayed on one stream" in stdout
    rows = load(out).get("x-devices", "rows").raw
    a100 = {r["gpus"]: r for r in rows if r["name"] == "NVIDIA A100 80GB"}
    assert sorted(a100) == [1, 2, 4, 8]
    for n in (2, 4):
        assert a100[n]["peak"] == estimate_zero_per_rank(load(path), n).worst
        assert a100[n]["device_peak"] > a100[n]["peak"] and a100[n]["fits"] is True


def test_without_deepspeed_a_zero_step_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed is an optional extra: without it a ZeRO ledger's simulation says so at parallelism.strategy, with the
    install line, and ``--devices`` notes each sharded GPU count as not simulated."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.zero import engine
    from ledgerspec.derivations.shard.zero.simulate import estimate_zero_per_rank
    from ledgerspec.errors import LedgerspecError
    from tests.derivations.shard.test_zero import _zero_ledger

    def missing(cpu: bool = True) -> None:
        raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")

    monkeypatch.setattr(engine, "import_deepspeed", missing)
    path = _zero_ledger(tmp_path, 2)
    with pytest.raises(LedgerspecError) as err:
        estimate_zero_per_rank(load(path), 2)
    assert "cannot be imported (No module named 'deepspeed')" in err.value.message
    assert "pip install deepspeed==0.19.8" in (err.value.hint or "")


def test_a_hybrid_shard_group_is_the_ranks_verdict(tmp_path: Path) -> None:
    """HSDP: 4 GPUs in shard groups of 2. ``shard`` simulates the group's two ranks (rank r holds what rank r mod 2
    does) and records the 4 ranks launched, so ``validate -v`` reads the group's worst rank for the document's 4 GPUs
    (it asked for ``--nproc 4`` again, which wrote the same)."""
    pytest.importorskip("peft")
    path = _ledger(tmp_path, "fsdp2")
    text = path.read_text(encoding="utf-8")
    path.write_text(
        text.replace("  gpu_count: 2\n", "  gpu_count: 4\n").replace(
            "  strategy: fsdp2\n", "  strategy: fsdp2\n  shard_group_size: 2\n"
        ),
        encoding="utf-8",
    )
    out = tmp_path / "out.yaml"
    code, _, err = run_cli("shard", path, "--estimate", "--device-memory", "4GiB", "-o", out)
    assert code == 0, err
    block = load(out).get("parallelism", "x-per-rank").raw
    assert block["world_size"] == 2 and block["estimate"]["world"] == 4 and len(block["estimate"]["ranks"]) == 2
    code, stdout, _ = run_cli("validate", "-v", out)
    assert "(parallelism.x-per-rank.estimate)" in stdout.splitlines()[0] and "FITS" in stdout.splitlines()[0]
