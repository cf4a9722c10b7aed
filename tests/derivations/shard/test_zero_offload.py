"""DeepSpeed ZeRO offload per rank (issue 16 item 4): ``offload_optimizer`` (ZeRO-2, ZeRO-3) and ``offload_param``
(ZeRO-3) simulated per rank (``shard --estimate``) against a REAL DeepSpeed run of the same workload on 2 gloo ranks
(``measure --nproc 2``), which compiles and runs DeepSpeed's own ``DeepSpeedCPUAdam`` op (``CPUAdamBuilder``, the
system compiler, about 45 s on 2 cores the first time; cached under ``~/.cache/torch_extensions``).

Expected figures: the real run's phases (every rank's tracked tensor bytes; a CPU run has one memory, so they are
the simulation's device + host totals) and, for the sides, the tiny model's own parameter counts and the DeepSpeed
config (the bytes DeepSpeed keeps on the device after ``deepspeed.initialize`` are the model's buffers and the
gradient bucket of ``reduce_bucket_size`` elements), never the code under test. Known timing differences as in
``test_zero.py`` (gloo may still hold a broadcast or the norm's all-reduce; explained there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from tests.derivations.shard.test_zero import (
    HAS_DEEPSPEED,
    HELD_BROADCASTS,
    _zero_ledger,
    explained_by_gloo_timing,
)
from tests.support import one_worker_each

#: the tiny model (tests/data/sharding/tiny): LoRA r=5 on 6 modules x 2 layers, fp32
TRAINABLE_NUMEL = 10_480
LARGEST_TRAINABLE = 1_000  # down_proj.lora_A (5 x 200) and up_proj.lora_B (200 x 5)
BUFFERS = 72  # the rotary embedding's inv_freq: 18 fp32
REDUCE_BUCKET = 100_000  # reduce_bucket_size in the ledgers below
W = 2


def _offload_ledger(tmp: Path, stage: int, placements: str, extra: str = "") -> Path:
    options = "{reduce_bucket_size: 100000" + (", stage3_param_persistence_threshold: 0" if stage == 3 else "")
    path = _zero_ledger(tmp, stage, options + extra + "}")
    text = path.read_text(encoding="utf-8")
    for key in ("parameter_placement", "gradient_placement", "optimizer_placement"):
        text = text.replace(f"  {key}: sharded\n", "")
    path.write_text(text.replace("  strategy: ", f"{placements}  strategy: "), encoding="utf-8")
    return path


CASES = {
    # ZeRO-3, offload_optimizer only, the Trainer's torch AdamW on the host (zero_force_ds_cpu_optimizer: false)
    "zero3-optimizer-client": (3, "  optimizer_placement: cpu\n", ", zero_force_ds_cpu_optimizer: false"),
    # ZeRO-3, offload_param only: the parameter partitions on the host, the optimizer (the Trainer's) on the device
    "zero3-param": (3, "  parameter_placement: cpu\n", ""),
    # DeepSpeedCPUAdam, accumulating 2 micro-steps (one micro-step was run too on 2026-12-01, equal to the byte):
    # ZeRO-3 with everything offloaded (DeepSpeed's "cpuoffload_all" configs) accumulates its host partitions through
    # device copies; ZeRO-2 with offload_optimizer keeps each gradient on the host between micro-steps and brings it
    # back to add to (async_accumulate_grad_in_cpu_via_gpu)
    "zero3-all-ga2": (3, "  cpu_offload: true\n", ""),
    "zero2-optimizer-ga2": (2, "  optimizer_placement: cpu\n", ""),
}


#: the cases that build and run DeepSpeedCPUAdam share one worker: the first compiles the op (about 70 s on 2 cores
#: on a clean machine: the build is cached per Python environment) and the other loads it; on two workers the
#: second waited the whole build out on the compile lock, both workers blocked
CPU_ADAM = ("zero3-all-ga2", "zero2-optimizer-ga2")


def _params() -> list[Any]:
    return [
        pytest.param(case, id=case, marks=pytest.mark.xdist_group("zero-offload-cpu-adam"))
        if case in CPU_ADAM
        else one_worker_each("zero-offload", [case])[0]
        for case in CASES
    ]


@pytest.fixture(scope="module", params=_params())
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    pytest.importorskip("peft")
    from ledgerspec.derivations.measure.dist import make_request, run_ranks
    from ledgerspec.derivations.shard.zero.simulate import estimate_zero_per_rank

    stage, placements, extra = CASES[request.param]
    if request.param in CPU_ADAM and os.environ.get("LEDGERSPEC_BUILD_OPS", "1") == "0":
        pytest.skip(
            "LEDGERSPEC_BUILD_OPS=0: DeepSpeedCPUAdam is not compiled in this run (CI: about 2 CPU-minutes of its "
            "15); `scripts/test` runs this truth"
        )
    if request.param in CPU_ADAM:  # DeepSpeedCPUAdam
        from ledgerspec.derivations.shard.zero.engine import cpu_accelerator

        with cpu_accelerator():
            from deepspeed.ops.op_builder import CPUAdamBuilder

            if not CPUAdamBuilder().is_compatible(verbose=False):  # a C++ compiler and ninja
                pytest.skip("DeepSpeedCPUAdam cannot be compiled here (DeepSpeed's CPUAdamBuilder: not compatible)")
    path = _offload_ledger(tmp_path_factory.mktemp(request.param), stage, placements, extra)
    if request.param.endswith("-ga2"):
        path.write_text(path.read_text("utf-8").replace("gradient_accumulation: 1", "gradient_accumulation: 2"))
    doc = load(path)
    real = run_ranks(make_request(doc, W, "cpu", 2), timeout=420)  # the first run compiles DeepSpeedCPUAdam
    est = estimate_zero_per_rank(doc, W, target="cpu")
    return {"case": request.param, "stage": stage, "path": path, "real": real, "est": est}


@pytest.mark.slow
def test_simulated_totals_equal_the_real_offloaded_run(runs: dict[str, Any]) -> None:
    """Device + host of every simulated phase = the real DeepSpeed run's phase, rank by rank (DeepSpeedCPUAdam's C++
    update stood in for: it allocates no torch tensor)."""
    from ledgerspec.derivations.engine.protocol import PHASES

    # gloo may hold a phase's last broadcast (ZeRO-3) or the 4-byte norm all-reduce of the step (both stages under
    # offload: the host-summed norm is all-reduced as a one-element float32 tensor), as in test_zero.py
    for out, rank in zip(runs["real"], runs["est"].ranks, strict=True):
        real = {name: out.result.phases[name].figure for name in PHASES}
        assert rank.total_phases is not None and rank.host_phases is not None
        for k in PHASES:
            assert rank.phases[k] + rank.host_phases[k] == rank.total_phases[k] or k not in (
                "after_load",
                "after_adapter_injection",
                "after_optimizer_init",
            ), k  # held phases: the two sides of one moment
        diff = {k: real[k] - rank.total_phases[k] for k in PHASES if real[k] != rank.total_phases[k]}
        assert explained_by_gloo_timing(diff, runs["stage"]), (runs["case"], out.rank, diff)


@pytest.mark.slow
def test_the_device_keeps_only_what_deepspeed_leaves_there(runs: dict[str, Any]) -> None:
    """After ``deepspeed.initialize`` the device holds what is not offloaded, from the model's own counts:
    ZeRO-3 with everything offloaded keeps the buffers and the contiguous gradient bucket only; ZeRO-2 keeps the
    whole model (parameters are never partitioned in ZeRO-2) and one parameter's gradient staging buffer
    (``temp_grad_buffer_for_gpu_offload``); the host holds the fp32 master partitions and their gradients."""
    from ledgerspec.derivations.engine.protocol import PHASES

    part = TRAINABLE_NUMEL // W * 4  # this rank's fp32 partition of the adapters
    for out, rank in zip(runs["real"], runs["est"].ranks, strict=True):
        real = {name: out.result.phases[name].figure for name in PHASES}
        device, host = rank.phases, rank.host_phases
        assert host is not None and rank.host_peak is not None
        if runs["case"].startswith("zero3-all"):
            assert device["after_load"] == BUFFERS  # every frozen partition on the host
            assert host["after_load"] == real["after_load"] - BUFFERS or (
                real["after_load"] - BUFFERS - host["after_load"] in HELD_BROADCASTS["after_load"]
            )
            assert device["after_optimizer_init"] == BUFFERS + REDUCE_BUCKET * 4
        if runs["case"] == "zero3-param":  # partitions on the host; on the device the fp32 master partition, its two
            # gradient buffers and the one-byte NaN/Inf flag (stage3.py 335: device=self.device, the device here)
            assert device["after_load"] == BUFFERS
            assert device["after_optimizer_init"] == BUFFERS + REDUCE_BUCKET * 4 + 3 * part + 1
            assert host["steady_state_peak"] == host["after_optimizer_init"]  # Adam's moments: the device's
            continue
        if runs["case"].startswith("zero2-optimizer"):
            whole = TRAINABLE_NUMEL * 4
            assert device["after_optimizer_init"] == real["after_load"] + whole + LARGEST_TRAINABLE * 4
            # fp32 partition + its gradient + the bit16 copy for the update + the largest gradient's host staging
            assert host["after_optimizer_init"] == 3 * part + LARGEST_TRAINABLE * 4
        # the optimizer's two Adam moments of the partition are made on the host in the step
        assert host["optimizer_step_peak"] - host["after_optimizer_init"] >= 2 * part
        assert rank.host_peak >= host["optimizer_step_peak"]
        assert rank.total_phases is not None and device["steady_state_peak"] < rank.total_phases["steady_state_peak"]


@pytest.mark.slow
def test_measure_writes_what_the_engine_offloaded(runs: dict[str, Any]) -> None:
    """The measured ledger says which parts went to the host (ZeRO-2 keeps its parameters replicated on the device)
    and which optimizer stepped them; read back, it declares the same offload."""
    from ledgerspec.derivations.measure.dist import write_back
    from ledgerspec.derivations.shard.options import zero_options

    doc = load(runs["path"])
    before = zero_options(doc)
    write_back(doc, runs["real"], "ledgerspec measure --nproc 2", None)
    p = doc.plain["parallelism"]
    on = runs["case"] != "zero3-param"
    assert (p["optimizer_placement"], p["gradient_placement"]) == (("cpu", "cpu") if on else ("sharded", "sharded"))
    if runs["case"].startswith("zero2-optimizer"):
        assert p["parameter_placement"] == "replicated"
    assert p["cpu_offload"] is True  # declared, or (placements alone) written as what ran
    text = doc.plain["x-measure-per-rank"]["cpu_offload"]
    assert text.startswith(f"DeepSpeed ZeRO-{runs['stage']}")
    assert ("DeepSpeedCPUAdam" in text) == (runs["case"] not in ("zero3-optimizer-client", "zero3-param"))
    assert zero_options(doc) == before  # the written placements declare the same offload


def test_offload_is_read_from_the_placements_or_cpu_offload(tmp_path: Path) -> None:
    from ledgerspec.derivations.shard.options import zero_options

    all3 = zero_options(load(_offload_ledger(tmp_path, 3, "  cpu_offload: true\n")))
    assert (all3.offload_optimizer, all3.offload_param, all3.cpu_adam) == (True, True, True)
    opt2 = zero_options(load(_offload_ledger(tmp_path, 2, "  cpu_offload: true\n")))
    assert (opt2.offload_optimizer, opt2.offload_param) == (True, False)
    client = zero_options(
        load(_offload_ledger(tmp_path, 3, "  optimizer_placement: cpu\n", ", zero_force_ds_cpu_optimizer: false"))
    )
    assert (client.offload_optimizer, client.offload_param, client.cpu_adam) == (True, False, False)
    block = all3.zero_optimization()
    assert block["offload_optimizer"] == {"device": "cpu"} and block["offload_param"] == {"device": "cpu"}


def test_what_deepspeed_refuses_is_refused(tmp_path: Path) -> None:
    """DeepSpeed refuses a client optimizer under offload unless ``zero_force_ds_cpu_optimizer`` is false (its
    ``ZeRORuntimeException``); ``offload_param`` is ZeRO-3's only."""
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.shard.options import zero_options
    from ledgerspec.derivations.shard.zero.engine import zero_refusal

    path = _offload_ledger(tmp_path, 3, "  optimizer_placement: cpu\n")
    path.write_text(path.read_text("utf-8").replace("name: adamw_torch", "name: sgd"), encoding="utf-8")
    doc = load(path)
    why = zero_refusal(WorkloadSpec.from_document(doc), zero_options(doc))
    assert why is not None and "zero_force_ds_cpu_optimizer: false" in why
    path2 = _offload_ledger(tmp_path, 2, "  parameter_placement: cpu\n")
    doc2 = load(path2)
    why2 = zero_refusal(WorkloadSpec.from_document(doc2), zero_options(doc2))
    assert why2 is not None and "ZeRO-3 only" in why2


def test_the_importer_reads_which_optimizer_steps_the_host(tmp_path: Path) -> None:
    """A DeepSpeed JSON's top-level ``zero_force_ds_cpu_optimizer: false`` lands in ``parallelism.deepspeed``."""
    import json

    from tests.support.imports import imported, keys_of, plain

    ds = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds), encoding="utf-8")
    (tmp_path / "run.yml").write_text(
        "base_model: meta-llama/Llama-2-7b-hf\nadapter: lora\nlora_r: 8\nsequence_len: 512\nmicro_batch_size: 1\n"
        "deepspeed: ds.json\n",
        encoding="utf-8",
    )
    doc, result = imported(tmp_path / "run.yml")
    assert plain(doc, "parallelism", "deepspeed", "zero_force_ds_cpu_optimizer") is False
    assert plain(doc, "parallelism", "optimizer_placement") == "cpu"
    assert "deepspeed" not in keys_of(result, "not-modelled")  # read, so no finding says it was not


@pytest.mark.slow
def test_shard_estimate_of_an_offloaded_zero_ledger(tmp_path: Path) -> None:
    """``shard --estimate`` on ZeRO-3 with everything offloaded: DeepSpeed's offload, not FSDP's (no FSDP
    ``cpu_offload`` block); each rank's device phases, host phases and ``host_peak`` written beside the calculated
    ``zero3_offload`` row."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    pytest.importorskip("peft")
    from tests.support import run_cli

    path = _offload_ledger(tmp_path, 3, "  cpu_offload: true\n")
    code, _out, err = run_cli("shard", path, "--nproc", "2", "--estimate", "--target", "cuda")
    assert code == 0, err
    ext = load(path).plain["parallelism"]["x-per-rank"]
    rows = ext["estimate"]["ranks"]
    assert len(rows) == 2 and all(r["host_peak"]["value"] > 0 for r in rows)
    assert all(r["phases"]["after_load"] < r["host_phases"]["after_load"] for r in rows)  # the base on the host
    assert "DeepSpeedCPUAdam" in ext["estimate"]["method"] and "offload" in ext["estimate"]["method"]
    assert ext["zero"]["zero3_offload"]["host"]["value"] > 0
    assert "cpu_offload" not in ext and "CPUOffloadPolicy" not in ext["estimate"]["method"]


def test_the_offload_rows_say_what_moves_each_step(tmp_path: Path) -> None:
    """The calculated ``zero*_offload`` rows, per optimizer step of k micro-steps (DeepSpeed 0.19.8's copies, read from
    its source: ``state.zero_offload_traffic``), from the tiny model's counts: 10,480 trainable and 262,008 frozen
    fp32 elements (the real simulated rank holds the frozen half, 524,016 B, on the host after load above)."""
    pytest.importorskip("torch")
    from tests.support import run_cli

    trainable, frozen = TRAINABLE_NUMEL * 4 // W, 262_008 * 4 // W  # this rank's partitions (fp32 model)
    for k in (1, 3):
        path = _offload_ledger(tmp_path, 3, "  cpu_offload: true\n")
        text = path.read_text("utf-8").replace("gradient_accumulation: 1", f"gradient_accumulation: {k}")
        path.write_text(text, encoding="utf-8")
        code, _out, err = run_cli("shard", path)
        assert code == 0, err
        rows = load(path).plain["parallelism"]["x-per-rank"]["zero"]
        for stage in (1, 2):
            row = rows[f"zero{stage}_offload"]
            # accumulating: each micro-step's gradients out, and back from the second on; the fp32 copy at the end
            assert row["to_host_per_step"]["value"] == (k * trainable if k > 1 else 0) + trainable
            assert row["to_device_per_step"]["value"] == (k - 1) * trainable + trainable  # + the updated partition
        z3 = rows["zero3_offload"]
        assert z3["to_host_per_step"]["value"] == k * trainable + trainable
        assert z3["to_device_per_step"]["value"] == k * trainable
        assert z3["to_device_per_micro_step"]["value"] == 2 * (frozen + trainable)  # no checkpointing declared
        assert "to_host_per_step" not in rows["zero3"]


def test_nvme_and_contradictions_are_refused(tmp_path: Path) -> None:
    """NVMe offload is not modelled (refused, not run as CPU offload); ``cpu_offload: false`` beside a ``cpu``
    placement does not say which ran."""
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.shard.options import zero_options
    from ledgerspec.derivations.shard.zero.engine import zero_refusal

    nvme = load(_offload_ledger(tmp_path, 3, "  cpu_offload: true\n  optimizer_placement: nvme\n"))
    why = zero_refusal(WorkloadSpec.from_document(nvme), zero_options(nvme))
    assert why is not None and "NVMe" in why
    both = load(_offload_ledger(tmp_path, 2, "  cpu_offload: false\n  optimizer_placement: cpu\n"))
    why2 = zero_refusal(WorkloadSpec.from_document(both), zero_options(both))
    assert why2 is not None and "cpu_offload: false" in why2
