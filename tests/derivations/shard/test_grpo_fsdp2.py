"""GRPO and RLOO under FSDP2 (issue 24): ``measure --nproc 2`` (a real FSDP2 run per rank: the GRPO step of
:mod:`ledgerspec.derivations.engine.grpo`, its generation through transformers' ``generate`` on the sharded model,
gloo) against ``shard --estimate --target cpu`` (the simulated one) and the calculated state, as the other FSDP2 runs
are compared (``tests/support/per_rank.py``): the model-state phases and components to the byte, the compute phases
(the generation phase too) within the gloo-thread slack.

Under FSDP2, transformers' Trainer registers ``generate`` as a forward method of the FSDP2 root
(``register_fsdp_forward_method``, trainer.py 1798-1801 at 5.24): the root's parameters are gathered for the whole
of ``generate``, each decoder layer's at each of its forwards. Without it the real run fails at the embedding (mixed
``torch.Tensor`` and ``DTensor``: huggingface/trl#4550, fixed by huggingface/transformers#42436). The single-device
GRPO step is checked against TRL's real ``GRPOTrainer`` in ``tests/derivations/engine/test_grpo_truth.py``. FSDP1
and DeepSpeed ZeRO are refused in one line (not run: TRL gathers differently there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support.per_rank import fp32_fsdp2_ledger, fsdp2_ranks_agree

GRPO = (
    "training:\n  loop: trainer\n  objective: {objective}\n"
    "  objective_settings: {{max_completion_length: 4, num_generations: 2}}\n"
)
#: prompt + completion
LENGTHS = (
    "  max_length: 32\n  sequence_p50: 32\n  sequence_p95: 32\n",
    "  max_length: 16\n  sequence_p50: 12\n  sequence_p95: 16\n",
)


def _grpo(tmp: Path, strategy: str = "fsdp2", objective: str = "grpo") -> Path:
    replaced = [LENGTHS] + ([("  strategy: fsdp2\n", f"  strategy: {strategy}\n")] if strategy != "fsdp2" else [])
    return fp32_fsdp2_ledger(tmp, f"{objective}-{strategy}", GRPO.format(objective=objective), *replaced)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "rloo"])  # RLOO: its old-policy and reference log-probs beside
def test_grpo_on_two_fsdp2_ranks_is_the_simulated_step(tmp_path: Path, objective: str) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("trl")

    real, estimated = fsdp2_ranks_agree(_grpo(tmp_path, objective=objective))
    # the generation phase ran on every rank, above the model it gathers (the whole model: the root's parameters for
    # the whole generate, then each layer's), below the training forward that follows it; on both sides
    for r in real:
        phases = r["phases"]
        assert phases["after_optimizer_init"] < phases["generation_peak"] < phases["forward_peak"]
        assert set(estimated.ranks[r["rank"]].phases) == set(phases)


@pytest.mark.parametrize("strategy", ["fsdp1", "zero3", "fsdp2-vllm"])
def test_grpo_under_fsdp1_or_zero_is_refused_in_one_line(tmp_path: Path, strategy: str) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.measure.dist import make_request
    from ledgerspec.derivations.shard.sharder import shard
    from ledgerspec.errors import LedgerspecError

    path = _grpo(tmp_path, strategy.removesuffix("-vllm"))
    if strategy.endswith("-vllm"):  # vLLM's weight sync on sharded parameters: not run yet
        text = path.read_text(encoding="utf-8").replace("num_generations: 2}", "num_generations: 2, use_vllm: true}")
        assert "use_vllm: true" in text
        path.write_text(text, encoding="utf-8")
    with pytest.raises(LedgerspecError, match="grpo/rloo under FSDP1 or DeepSpeed ZeRO, or with use_vllm") as err:
        shard(load(path), nproc=2, estimate=True, target="cpu")
    # the hint names what runs: FSDP2 ranks without vLLM, one device with it
    assert "\n" not in str(err.value) and ("FSDP2 ranks" in (err.value.hint or "")) == (strategy != "fsdp2-vllm")
    with pytest.raises(LedgerspecError, match="grpo/rloo under FSDP1 or DeepSpeed ZeRO, or with use_vllm") as err:
        make_request(load(path), 2, "cpu", 2)
    assert "\n" not in str(err.value) and err.value.exit_code == 2
