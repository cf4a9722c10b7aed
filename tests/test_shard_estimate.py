"""``ledgerspec shard --estimate``: a simulated FSDP2 step per rank (fake tensors, fake process group).

Expected figures come from :mod:`ledgerspec.derivations.sharding` (checked against real shards in
``test_sharding_fsdp2.py``); the comparison with a real measured run is in ``test_measure_dist.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations import sharding as S
from ledgerspec.derivations.sharding_estimate import rank_groups
from tests.conftest import run_cli

DATA = Path(__file__).parent / "data" / "sharding"
LEDGER = "tiny-lora.ledger.yaml"


def _desc(name: str, shape: tuple[int, ...]) -> S.ParamDesc:
    return S.ParamDesc(name, shape, "float32", True)


@pytest.mark.parametrize(("shapes", "world", "groups"), [
    ([(8, 4), (6,)], 2, {0: [0, 1]}),  # even rows: every rank holds the same bytes
    ([(1001, 72), (6,)], 2, {0: [0], 1: [1]}),  # 501 + 500 rows
    ([(5, 72)], 3, {0: [0, 1], 2: [2]}),  # chunks of 2, 2, 1
    ([(2, 4)], 4, {0: [0, 1], 2: [2, 3]}),  # torch.chunk leaves ranks 2 and 3 empty
])
def test_ranks_with_the_same_rows_share_one_simulation(shapes: list[tuple[int, ...]], world: int,
                                                       groups: dict[int, list[int]]) -> None:
    assert rank_groups([_desc(f"p{i}", s) for i, s in enumerate(shapes)], world) == groups


def _copy(tmp: Path, ledger: str = LEDGER) -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    shutil.copy(DATA / ledger, tmp / ledger)
    return tmp / ledger


@pytest.fixture(scope="module")
def estimated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch")
    from ledgerspec.derivations.sharding_ledger import shard
    from ledgerspec.derivations.sharding_model import document_descriptors

    doc = load(_copy(tmp_path_factory.mktemp("shard-estimate")))
    result = shard(doc, estimate=True, target="cpu", device_memory=1 << 30)
    plan = S.fsdp2(document_descriptors(doc), 2, "adamw_torch", reshard_after_forward=True)
    return {"result": result, "plan": plan, "doc": doc}


def test_static_phases_are_the_calculated_shards(estimated: dict[str, Any]) -> None:
    for est, calc in zip(estimated["result"].estimate.ranks, estimated["plan"].ranks, strict=True):
        assert est.phases["after_load"] == calc.frozen_base
        assert est.phases["after_optimizer_init"] == calc.frozen_base + calc.adapter
        c = est.components
        assert (c["frozen_base"], c["adapter"], c["gradients"]) == (calc.frozen_base, calc.adapter, calc.gradients)
        assert c["optimizer"] == calc.optimizer + calc.optimizer_host  # target cpu: the step scalars count too


def test_each_rank_is_simulated_with_its_own_rows(estimated: dict[str, Any]) -> None:
    r0, r1 = estimated["result"].estimate.ranks
    assert r0.simulated_as == 0 and r1.simulated_as == 1
    # rank 0 owns more rows (501 of 1001, 3 of 5 ...): more optimizer state, and more step temporaries on top
    assert r0.phases["optimizer_step_peak"] - r1.phases["optimizer_step_peak"] >= (
        estimated["plan"].ranks[0].optimizer - estimated["plan"].ranks[1].optimizer) > 0


def test_compute_holds_gathered_units_and_unsharded_activations(estimated: dict[str, Any]) -> None:
    plan = estimated["plan"]
    for est, calc in zip(estimated["result"].estimate.ranks, plan.ranks, strict=True):
        assert est.phases["forward_peak"] >= calc.frozen_base + calc.adapter + calc.gathered + est.activations
        assert est.activations > 0
    assert plan.ranks[0].gathered < sum(plan.unit_unsharded.values())  # never the whole model gathered


@pytest.mark.slow
@pytest.mark.parametrize("reshard", ["true", "false", None])
def test_per_rank_activations_are_the_single_device_activations(tmp_path: Path, reshard: str | None) -> None:
    """FSDP2 shards parameters, not activations: a rank's microbatch holds what one device's does. Gathered layers
    are freed by resizing their storage to 0 (no tensor op): a tracker that missed it counted every layer's
    weights as activations."""
    from ledgerspec.derivations.estimate import estimate
    from ledgerspec.derivations.sharding_ledger import shard

    path = _copy(tmp_path)
    text = path.read_text(encoding="utf-8")
    line = "  reshard_after_forward: true\n"
    assert line in text
    path.write_text(text.replace(line, f"  reshard_after_forward: {reshard}\n" if reshard else ""), encoding="utf-8")
    doc = load(path)
    single = estimate(doc, target="cpu").activations
    ranks = shard(doc, estimate=True, target="cpu").estimate.ranks
    assert [r.activations for r in ranks] == [single] * len(ranks)


def test_written_as_calculated_with_method_and_fit(estimated: dict[str, Any]) -> None:
    block = estimated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]
    assert block["source"] == "CALCULATED" and block["target"] == "cpu"
    assert "fake process group" in block["method"] and "NCCL" in block["method"]
    assert block["device_memory"] == 1 << 30 and block["fits"] is True
    peaks = [r["peak_allocated"]["value"] for r in block["ranks"]]
    assert block["worst_rank_peak"]["value"] == max(peaks)
    assert all(r["peak_allocated"]["source"] == "CALCULATED" and r["fits"] for r in block["ranks"])


def test_does_not_fit_exits_1_and_still_writes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = _copy(tmp_path)
    code, out, err = run_cli("shard", path, "--estimate", "--device-memory", "1MiB")
    assert code == 1, err
    assert "2 x 1.00 MiB: does NOT fit" in out
    block = load(path).plain["parallelism"]["x-per-rank"]["estimate"]
    assert block["fits"] is False and block["target"] == "cuda"
    assert all(r["oom_phase"] == "forward_peak" for r in block["ranks"])


@pytest.mark.parametrize(("ledger", "args", "message"), [
    (LEDGER, ["--device-memory", "24GiB"], "need --estimate"),
    (LEDGER, ["--estimate", "--device-memory", "lots"], "--device-memory"),
    ("tiny-qlora-bf16-storage.ledger.yaml", ["--estimate"], "QLoRA"),
])
def test_refusals_change_nothing(tmp_path: Path, ledger: str, args: list[str], message: str) -> None:
    path = _copy(tmp_path, ledger)
    before = path.read_bytes()
    code, _, err = run_cli("shard", path, *args)
    assert code != 0 and message in err and "Traceback" not in err
    assert path.read_bytes() == before
