"""CPU offload under FSDP (issue 16): FSDP2 ``CPUOffloadPolicy`` and FSDP1 ``CPUOffload(offload_params=True)``.

The calculated block says what moves to the host; the simulated step puts each tensor on its side by its role and
predicts the device's phases and each rank's ``host_peak``. Independent truths here: the model's buffers as
transformers builds them (the only parameters-or-buffers left on the device after load), the per-rank plan of
:mod:`ledgerspec.derivations.shard.state` (checked against real shards in test_sharding_fsdp2.py and
test_fsdp1.py), and the simulation without offload (what the totals must equal for FSDP2, whose CPU-side copies are
no-ops). Real offloaded runs per rank: test_offload_real.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.estimate.fit import PHASES
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, one_worker_each, run_cli

DATA = TESTS / "data" / "sharding"
HELD = ("after_load", "after_adapter_injection", "after_optimizer_init")


def _ledger(tmp: Path, strategy: str, offload: str = "true", name: str = "offload.ledger.yaml") -> Path:
    if not (tmp / "tiny").exists():
        shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    assert "  strategy: fsdp2\n" in text
    extra = f"  cpu_offload: {offload}\n" if offload else ""
    path = tmp / name
    path.write_text(text.replace("  strategy: fsdp2\n", f"  strategy: {strategy}\n{extra}"), encoding="utf-8")
    return path


def _buffer_bytes(path: Path) -> int:
    """The model's buffers as transformers builds them on the meta device (rotary ``inv_freq`` here)."""
    import json

    import torch
    import transformers

    config = transformers.LlamaConfig(**json.loads((path.parent / "tiny" / "config.json").read_text()))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.fixture(scope="module", params=one_worker_each("offload", ["fsdp2", "fsdp1"]))
def simulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``shard --estimate --target cpu`` with and without offload, same ledger otherwise."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.sharder import shard

    tmp = tmp_path_factory.mktemp(f"offload-{request.param}")
    off = _ledger(tmp, request.param)
    on = _ledger(tmp, request.param, offload="", name="plain.ledger.yaml")
    code, out, err = run_cli("shard", off, "--estimate", "--target", "cpu")
    assert code == 0, err
    plain = shard(load(on), estimate=True, target="cpu").estimate
    return {"strategy": request.param, "path": off, "out": out, "doc": load(off), "plain": plain}


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_the_estimate_writes_device_phases_and_a_host_peak_per_rank(simulated: dict[str, Any]) -> None:
    est = simulated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]
    assert "CPUOffload" in est["method"] and "host_peak" in est["method"]
    for row in est["ranks"]:
        host = row["host_peak"]
        assert host["source"] == "CALCULATED" and host["value"] > 0
        assert host["value"] >= max(row["host_phases"].values())
        for name in PHASES:
            device, side, total = row["phases"][name], row["host_phases"][name], row["total_phases"][name]
            if name in HELD:  # what each side holds at the end of the phase: the two make the total
                assert device + side == total, name
            else:  # each side's own peak in the phase: neither above the total, together not below it
                assert device <= total and side <= total <= device + side, name
        assert row["peak_allocated"]["value"] == max(row["phases"].values())
    worst = est["worst_rank_host_peak"]
    assert worst["value"] == max(r["host_peak"]["value"] for r in est["ranks"])
    assert "host_peak" in simulated["out"]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_after_load_the_device_holds_only_the_buffers(simulated: dict[str, Any]) -> None:
    """Every shard is on the host; FSDP moves the buffers (rotary inv_freq) to the device."""
    buffers = _buffer_bytes(simulated["path"])
    for row in simulated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]["ranks"]:
        assert row["phases"]["after_load"] == buffers > 0
        assert row["phases"]["after_optimizer_init"] == buffers


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_the_host_holds_the_sharded_state_at_the_optimizer_step(simulated: dict[str, Any]) -> None:
    """At the step the host holds at least every shard, gradient shard and optimizer state of the rank's plan."""
    from ledgerspec.derivations.shard.model import document_descriptors

    doc = simulated["doc"]
    descs = document_descriptors(doc)
    buffers = sum(p.nbytes for p in descs if p.kind == "buffer")
    plan = S.fsdp1(S.peft_fsdp1_units(descs), 2) if simulated["strategy"] == "fsdp1" else S.fsdp2(descs, 2)
    for row, rs in zip(doc.plain["parallelism"]["x-per-rank"]["estimate"]["ranks"], plan.ranks, strict=True):
        state = rs.frozen_base - buffers + rs.adapter + rs.gradients + rs.optimizer + rs.optimizer_host
        assert row["host_phases"]["optimizer_step_peak"] >= state
        assert row["phases"]["optimizer_step_peak"] < rs.gradients + rs.optimizer  # the step runs on the host


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_fsdp2_offload_totals_equal_the_run_without_offload(simulated: dict[str, Any]) -> None:
    """On the CPU FSDP2's host <-> device copies are the tensors themselves (``.to(cpu)`` of a CPU tensor), so both
    sides together are the figures of the same step without offload; FSDP1 differs (its pinned copy of each shard
    and its pre-allocated CPU gradient are real copies)."""
    rows = simulated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]["ranks"]
    for row, plain in zip(rows, simulated["plain"].ranks, strict=True):
        if simulated["strategy"] == "fsdp2":
            assert row["total_phases"] == plain.phases
        else:
            assert row["total_phases"]["steady_state_peak"] > plain.phases["steady_state_peak"]
        assert row["phases"]["steady_state_peak"] < plain.phases["steady_state_peak"]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_calculated_block_says_what_moves_to_the_host(simulated: dict[str, Any]) -> None:
    from ledgerspec.derivations.shard.model import document_descriptors

    doc = simulated["doc"]
    ext = doc.plain["parallelism"]["x-per-rank"]
    block = ext["cpu_offload"]
    assert block["declared_at"] == "parallelism.cpu_offload"
    assert ("CPUOffload(" if simulated["strategy"] == "fsdp1" else "CPUOffloadPolicy") in block["policy"]
    assert "ZeRO" in block["zero"] and "host" in block["moves"]
    descs = document_descriptors(doc)
    buffers = sum(p.nbytes for p in descs if p.kind == "buffer")
    plan = S.fsdp1(S.peft_fsdp1_units(descs), 2) if simulated["strategy"] == "fsdp1" else S.fsdp2(descs, 2)
    for row, calc, rs in zip(block["ranks"], ext["ranks"], plan.ranks, strict=True):
        value = {k: row[k]["value"] for k in ("host", "device", "to_device_per_micro_step", "to_host_per_micro_step")}
        # nothing lost, nothing counted twice (model_state leaves out the optimizer's host scalars: Adam's step)
        assert value["host"] + value["device"] == calc["model_state"]["value"] + rs.optimizer_host
        assert value["device"] == calc["gathered_parameters"]["value"] + buffers
        assert value["to_host_per_micro_step"] == calc["gradients"]["value"]
        shards = calc["frozen_base"]["value"] - buffers + calc["adapter"]["value"]
        assert shards < value["to_device_per_micro_step"] < 2 * shards  # forward once, backward again but the root
    assert "CPU offload (" in simulated["out"] and "to the host" in simulated["out"]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_offload_makes_a_tight_device_fit(simulated: dict[str, Any]) -> None:
    """The fit verdict is the device's: a budget between the offloaded device peak and the peak without offload fits
    only with offload."""
    if simulated["strategy"] != "fsdp2":
        pytest.skip("one strategy is enough for the verdict")
    est = simulated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]
    device = max(r["peak_allocated"]["value"] for r in est["ranks"])
    budget = (device + simulated["plain"].worst) // 2
    assert device < budget < simulated["plain"].worst
    assert not all(f.fits for f in simulated["plain"].fits(budget))
    code, out, err = run_cli(
        "shard", simulated["path"], "--estimate", "--target", "cpu", "--device-memory", str(budget)
    )
    assert code == 0 and ": fits (worst rank" in out, err


def test_memory_options_cpu_offload_turns_it_on_too(tmp_path: Path) -> None:
    from ledgerspec.derivations.shard.options import cpu_offload

    path = _ledger(tmp_path, "fsdp2", offload="")
    text = path.read_text().replace("  sharding: fsdp2\n", "  sharding: fsdp2\n  cpu_offload: ON\n")
    path.write_text(text)
    assert cpu_offload(load(path)) == ("memory_options", "cpu_offload")
    code, _, err = run_cli("shard", path)
    assert code == 0, err
    assert load(path).plain["parallelism"]["x-per-rank"]["cpu_offload"]["declared_at"] == "memory_options.cpu_offload"


# -- memory_options.sharding: fsdp1 --------------------------------------------------------------------------------


def test_sharding_fsdp1_is_a_valid_word_and_selects_fsdp1(tmp_path: Path) -> None:
    import json

    from ledgerspec.derivations.shard.options import is_fsdp1

    path = _ledger(tmp_path, "fsdp1", offload="")
    path.write_text(path.read_text().replace("  sharding: fsdp2\n", "  sharding: fsdp1\n"))
    _, out, _ = run_cli("validate", "--format", "json", path)
    findings = json.loads(out)["files"][0]["findings"]
    assert not [f for f in findings if f["rule"] == "schema"], findings
    no_strategy = path.read_text().replace("  strategy: fsdp1\n", "")
    path.write_text(no_strategy)
    assert is_fsdp1(load(path))  # no parallelism.strategy: memory_options.sharding says which FSDP
    path.write_text(no_strategy.replace("  sharding: fsdp1\n", "  sharding: fsdp3\n"))
    _, out, _ = run_cli("validate", "--format", "json", path)
    assert [f for f in json.loads(out)["files"][0]["findings"] if f["rule"] == "schema"]


# -- measure --nproc keeps the declared offload --------------------------------------------------------------------


def _outs(world: int) -> list[Any]:
    from ledgerspec.derivations.engine.protocol import PHASES as ALL
    from ledgerspec.derivations.engine.protocol import PhaseRecord, ProtocolResult
    from ledgerspec.derivations.measure.dist import RankOutput

    outs = []
    for r in range(world):
        result = ProtocolResult("cpu", steps=2, microbatch=2, seq_worst=32, seq_typical=32)
        result.phases = {name: PhaseRecord(name, 1000 + r, 1000 + r, 1000 + r) for name in ALL}
        outs.append(RankOutput(r, result, {"torch": "2"}, {}))
    return outs


@pytest.mark.parametrize(
    ("declared", "written", "requested"),
    [
        ("  cpu_offload: false\n", "false", False),
        ("  cpu_offload: 'OFF'\n", "'OFF'", False),
        ("  cpu_offload: true\n", "true", True),
        ("", "false", False),  # not declared: the run was without offload, and says so
    ],
)
def test_measure_nproc_keeps_a_declared_cpu_offload(
    tmp_path: Path, declared: str, written: str, requested: bool
) -> None:
    """``measure --nproc`` used to write ``parallelism.cpu_offload: false`` over whatever was declared. It now runs
    the declared offload (the request carries it) and leaves the declared words as they are."""
    from ledgerspec.contract.writer import render
    from ledgerspec.derivations.measure.dist import make_request, write_back

    path = _ledger(tmp_path, "fsdp2", offload="")
    text = path.read_text().replace("  reshard_after_forward: true\n", "  reshard_after_forward: true\n" + declared)
    path.write_text(text)
    doc = load(path)
    assert make_request(doc, 2, "cpu", 2).cpu_offload is requested
    write_back(doc, _outs(2), "ledgerspec measure --nproc 2", True)
    out = render(doc.data, doc.text)
    assert f"  cpu_offload: {written}\n" in out
    places = {doc.plain["parallelism"][k] for k in ("parameter_placement", "gradient_placement", "optimizer_placement")}
    assert places == ({"cpu"} if requested else {"sharded"})


def test_staging_copy_before_the_all_gather() -> None:
    """On the CPU FSDP2's ``.to(self.device)`` of the host shard is the shard itself (no copy, so a CPU run cannot
    show the device copy a GPU makes); the cuda-target simulation makes that copy, in the shard's bytes."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from ledgerspec.derivations.shard.fsdp.workload import fsdp_params
    from ledgerspec.derivations.shard.offload.fsdp import staging_on_the_device
    from ledgerspec.derivations.shard.simulation import fake_process_group

    def storage(t: Any) -> int:
        return int(t.untyped_storage()._cdata)

    with fake_process_group(0, 2):
        model = torch.nn.Sequential(torch.nn.Linear(8, 6))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        (fp,) = [p for p in fsdp_params(model) if p._module_info.param_name == "weight"]
        fp.init_dtype_attrs(MixedPrecisionPolicy())  # what the lazy init of the first forward does
        assert [storage(t) for t in fp.all_gather_inputs] == [storage(fp._sharded_param_data)]
        with staging_on_the_device():
            (staged,) = fp.all_gather_inputs
            assert storage(staged) != storage(fp._sharded_param_data)
            assert staged.untyped_storage().nbytes() == fp._sharded_param_data.untyped_storage().nbytes() == 3 * 8 * 4
        assert [storage(t) for t in fp.all_gather_inputs] == [storage(fp._sharded_param_data)]


def test_fsdp1_staging_copy_before_the_all_gather() -> None:
    """FSDP1's ``pre_unshard`` with ``CPUOffload(offload_params=True)``: on a GPU ``flat_param_to(self.device)`` makes
    the flat parameter a device copy of the host shard; on the CPU the devices are equal and no copy is made. The
    cuda-target simulation makes it: a new storage of the shard's bytes, and the host shard untouched."""
    import torch
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    from ledgerspec.derivations.shard.offload.fsdp import fsdp1_staging_on_the_device, pinning_as_copies
    from ledgerspec.derivations.shard.simulation import fake_process_group

    def storage(t: Any) -> int:
        return int(t.untyped_storage()._cdata)

    with fake_process_group(0, 2), pinning_as_copies(always=True):
        model = FullyShardedDataParallel(
            torch.nn.Linear(8, 6), cpu_offload=CPUOffload(offload_params=True), device_id=torch.device("cpu")
        )
        handle = model._handle
        assert handle is not None
        handle.init_flat_param_attributes()  # what the lazy init of the first forward does
        flat = handle.flat_param
        before = storage(flat)
        handle.pre_unshard()
        assert storage(flat) == before  # the CPU: no copy
        with fsdp1_staging_on_the_device():
            handle.pre_unshard()
            assert storage(flat) not in (before, storage(flat._local_shard))
            shard_bytes = (8 * 6 + 6) // 2 * 4  # the flat parameter (weight and bias) halved, float32
            assert flat.untyped_storage().nbytes() == flat._local_shard.untyped_storage().nbytes() == shard_bytes


@pytest.mark.slow  # two FSDP ranks simulated with their streams, per strategy: about 10 s
@pytest.mark.parametrize("strategy", one_worker_each("offload-device", ["fsdp2", "fsdp1"]))
def test_an_offloaded_step_is_decided_on_the_device(tmp_path: Path, strategy: str) -> None:
    """With CPU offload the verdict replays the device's stream (the host's storages leave no event in it): the
    replay's live bytes at the training peak are what the simulated device side holds there (``device.PHASE``, the
    split by role checked against real runs in test_offload_real.py), not the device and the host together."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.allocator.replay import replay
    from ledgerspec.derivations.shard.sharder import shard

    path = _ledger(tmp_path, strategy)
    code, out, err = run_cli("shard", path, "--estimate", "--device-memory", "8GiB")
    assert code == 0, err
    assert "on the device" in out and "allocated tensors only" not in out
    result = shard(load(path), estimate=True, target="cuda", device_memory=8 * 2**30)
    est = result.estimate
    assert est is not None and est.device is not None and est.allocated_only is None
    rank = est.ranks[0]
    assert rank.step is not None and rank.host_phases is not None
    replayed = replay(rank.step.events, granularity=512)
    training = rank.step.windows[3:]  # after the load, the adapters and the optimizer's creation
    assert rank.step.windows[0].endswith(":frozen_params") and training[0].endswith(":activations")
    peak = max(replayed.phases[w].peak_counted for w in training)
    # the training peak of the device's stream is the simulated device side's peak, not device and host together
    assert peak == rank.peak == max(rank.phases.values())
    assert peak < max(rank.phases[k] + rank.host_phases[k] for k in ("backward_peak", "steady_state_peak"))
    # the optimizer steps on the host: the device's stream allocates next to nothing there
    assert rank.phases["optimizer_step_peak"] < rank.host_phases["optimizer_step_peak"]
