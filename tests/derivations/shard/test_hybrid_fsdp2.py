"""FSDP2 hybrid sharding (HSDP, issue 16): ``parallelism.shard_group_size`` below the world size runs
``fully_shard(..., mesh=init_device_mesh(kind, (world // group, group), mesh_dim_names=("replicate", "shard")))``:
parameters, gradients and optimizer state are sharded over the ``group`` ranks of a shard group and replicated across
the groups (torch ``fully_shard``'s docstring: "If the mesh is 2D, then parameters are sharded across the 1st dim
and replicated across the 0th dim"; gradients are reduce-scattered within the group, then all-reduced across the
replicas in place). So a rank holds what it would hold on ``group`` ranks: the calculation and the simulation run
one shard group. Ground truth: a real 4-rank run on a (2 replicate, 2 shard) mesh (torchrun, gloo on the CPU).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, run_cli
from tests.support.per_rank import assert_rank_agrees, gloo_slack, measured

DATA = TESTS / "data" / "sharding"


def _hybrid(tmp: Path, strategy: str = "fsdp2", size: str = "2", measure: bool = True) -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / ("tiny-lora-measure.ledger.yaml" if measure else "tiny-lora.ledger.yaml")).read_text("utf-8")
    assert "  strategy: fsdp2\n" in text
    text = text.replace("  strategy: fsdp2\n", f"  strategy: {strategy}\n  shard_group_size: {size}\n")
    path = tmp / "hsdp.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shard_calculates_each_rank_as_its_shard_group(tmp_path: Path) -> None:
    """``shard --nproc 4`` with groups of 2: every rank's model state is FSDP2's 2-rank shard (the state module's
    FSDP2 plan for 2 ranks, itself checked against real runs in test_sharding_fsdp2.py), and the extension says how
    the ranks are grouped."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _hybrid(tmp_path, measure=False)
    result = shard(load(path), nproc=4)
    assert "FSDP2 on a (2 replicate, 2 shard) device mesh, HSDP" in result.extension["hybrid"]
    two = S.fsdp2(document_descriptors(load(path)), 2, "adamw_torch")
    four = S.fsdp2(document_descriptors(load(path)), 4, "adamw_torch")
    assert [r.frozen_base for r in result.plan.ranks] == [r.frozen_base for r in two.ranks]
    assert two.ranks[0].frozen_base > four.ranks[0].frozen_base  # the grouping is what changes the figure


@pytest.mark.parametrize(("strategy", "size", "message"), [("zero3", "2", "hpZ, MiCS"), ("fsdp2", "3", "divides")])
def test_hybrid_sharding_refusals_are_one_line_at_the_field(
    tmp_path: Path, strategy: str, size: str, message: str
) -> None:
    pytest.importorskip("torch")
    path = _hybrid(tmp_path, strategy, size, measure=False)
    before = path.read_bytes()
    code, _, err = run_cli("shard", path, "--nproc", "4")
    at = path.read_text("utf-8").splitlines().index(f"  shard_group_size: {size}") + 1
    assert code == 2 and f"{path.name}:{at}:" in err and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and path.read_bytes() == before


@pytest.mark.slow
def test_hsdp_on_four_ranks_holds_what_fsdp2_holds_on_two(tmp_path: Path) -> None:
    """A real FSDP2 HSDP run on 4 ranks against the simulation of one 2-rank shard group: model-state phases and
    components to the byte on every rank (rank r as rank r mod 2), compute phases within the gloo-thread slack of
    the other measured tests. Observed alone on the machine: every phase of every rank to the byte."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _hybrid(tmp_path)
    doc = measured(path, 4)
    real = doc.plain["x-measure-per-rank"]["ranks"]
    assert len(real) == 4
    estimated = shard(load(path), nproc=4, estimate=True, target="cpu")
    assert estimated.estimate is not None and "HSDP" in estimated.extension["hybrid"]
    plan = S.fsdp2(document_descriptors(doc), 2, "adamw_torch")
    slack = gloo_slack(plan.unit_unsharded)
    for r in real:
        group = r["rank"] % 2
        assert_rank_agrees(r, estimated.estimate.ranks[group], plan.ranks[group], slack, components=False)
