"""Full fine-tuning under FSDP2 (issue 26): ``measure --nproc 2`` (a real FSDP2 run per rank, every parameter trained,
gloo on the CPU) against ``shard --estimate --target cpu`` (the simulated one) and the calculated state, as the other
FSDP2 runs are compared (``tests/support/per_rank.py``): the model-state phases and components to the byte, the
compute phases within the gloo-thread slack. ZeRO-2/3 of the same model run against real DeepSpeed ranks in
``test_zero.py``; the calculated flat parameters and shards against real ones in ``test_fsdp1.py`` and
``test_sharding_fsdp2.py``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS
from tests.support.per_rank import assert_rank_agrees, gloo_slack, measured

pytestmark = pytest.mark.slow

DATA = TESTS / "data" / "sharding"
LORA = (
    "  kind: LoRA\n  rank: 5\n  alpha: 10\n  dropout: 0.0\n"
    "  target_modules: [q_proj, k_proj, v_proj, o_proj, up_proj, down_proj]\n  bias: none\n"
)


def _full(tmp: Path) -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    for old, new in ((LORA, "  kind: full\n"), ("adapter:\n  dtype: float32\n", "")):
        assert old in text
        text = text.replace(old, new)
    (tmp / "full.ledger.yaml").write_text(text, encoding="utf-8")
    return tmp / "full.ledger.yaml"


def test_full_fine_tuning_on_two_fsdp2_ranks_is_the_simulated_step(tmp_path: Path) -> None:
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _full(tmp_path)
    doc = measured(path, 2)
    real = doc.plain["x-measure-per-rank"]["ranks"]
    assert len(real) == 2
    estimated = shard(load(path), nproc=2, estimate=True, target="cpu")
    assert estimated.estimate is not None
    descs = document_descriptors(doc)
    assert all(d.trainable for d in descs if d.kind == "param")  # every parameter trained, none frozen
    plan = S.fsdp2(descs, 2, "adamw_torch")
    slack = gloo_slack(plan.unit_unsharded)
    for r in real:
        assert_rank_agrees(r, estimated.estimate.ranks[r["rank"]], plan.ranks[r["rank"]], slack)
        # the whole model is the trained state, halved: no frozen weights beyond the buffers
        assert r["measured"]["adapter"] > 100 * r["measured"]["frozen_base"]
