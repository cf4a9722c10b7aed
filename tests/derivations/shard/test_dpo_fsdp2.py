"""DPO, KTO, ORPO, CPO and reward models under FSDP2 (issue 24): ``measure --nproc 2`` (a real FSDP2 run per rank:
the trainer's step of :mod:`ledgerspec.derivations.engine`, TRL's own fused LM head on the CPU, gloo) against
``shard --estimate --target cpu`` (the simulated one) and the calculated state, as the other FSDP2 runs are compared
(``tests/support/per_rank.py``): the model-state phases and components to the byte, the compute phases within the
gloo-thread slack. Each single-device step is checked against TRL's real trainer in
``tests/derivations/engine/test_{dpo,kto,orpo,cpo,reward}_truth.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support.per_rank import fp32_fsdp2_ledger, fsdp2_ranks_agree

pytestmark = pytest.mark.slow


def _dpo(tmp: Path, objective: str = "dpo") -> Path:
    return fp32_fsdp2_ledger(tmp, objective, f"training:\n  loop: trainer\n  objective: {objective}\n")


#: each preference trainer's step at its TRL 1.16 defaults (the reward model: a sequence-classification head); CPO's
#: step is ORPO's concatenated forward with another loss (equal to ORPO's here to the byte when it was run, 2026-12-03;
#: left out for CI's time)
OBJECTIVES = ["dpo", "kto", "orpo", "reward"]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_dpo_on_two_fsdp2_ranks_is_the_simulated_step(tmp_path: Path, objective: str) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from ledgerspec.derivations.shard.sharder import shard

    path = _dpo(tmp_path, objective)
    _, estimated = fsdp2_ranks_agree(path)
    if objective != "dpo":
        return
    # the DPO step ran: chosen and rejected rows, a reference forward, TRL's head (far above an SFT step's logits)
    sft = shard(load(_sft(tmp_path, path)), nproc=2, estimate=True, target="cpu")
    assert sft.estimate is not None
    assert estimated.ranks[0].phases["forward_peak"] > sft.estimate.ranks[0].phases["forward_peak"]


def _sft(tmp: Path, dpo: Path) -> Path:
    out = tmp / "sft.ledger.yaml"
    out.write_text(
        dpo.read_text(encoding="utf-8").replace("  objective: dpo\n", "  objective: sft\n"), encoding="utf-8"
    )
    return out
