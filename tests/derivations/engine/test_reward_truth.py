"""The reward-model step ledgerspec simulates and measures is the step TRL's ``RewardTrainer`` runs, to the byte.

Each case is one configuration, run three ways on the CPU, as the DPO truths are
(``tests/derivations/engine/test_dpo_truth.py``):

- the truth: TRL 1.16's real ``RewardTrainer`` (``tests/truths/reward_run.py``: transformers builds the base as a
  sequence classifier with one score, the trainer wraps it with the case's LoRA of task type ``SEQ_CLS``, its
  collator, ``compute_loss`` and accelerate run the step), its phases read by the tensor tracker from the outside,
  and (some cases) the whole run by PyTorch's own ``MemTracker``;
- ``ledgerspec measure --device cpu`` of the ledger that declares the configuration (``training.objective: reward``);
- ``ledgerspec estimate --target cpu --full`` of the same ledger (fake tensors).

The one difference, byte for byte: the real run's CPU DataLoader has already produced the next micro-batch
(accelerate's ``DataLoaderShard`` fetches one ahead; on a GPU it is still on the host): ``input_ids`` and
``attention_mask``, int64, 2 x microbatch x the next step's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from tests.derivations.engine.test_trainer_truth import Case as TrainerCase
from tests.derivations.engine.test_trainer_truth import ledger_text as trainer_ledger
from tests.derivations.engine.test_trainer_truth import truth_case as trainer_truth_case
from tests.support import TESTS
from tests.support.step_truth import (
    assert_estimate_is_the_measurement,
    assert_measure_is_the_truth,
    assert_memtracker_agrees,
    assert_the_callback_is_measure,
    run_three_ways,
)

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "reward_run.py"
TYPICAL = 32


@dataclass(frozen=True)
class Case:
    name: str
    base: TrainerCase
    center: float | None = None
    memtracker: bool = False
    dropout: float = 0.0


def _c(name: str, center: float | None = None, memtracker: bool = False, dropout: float = 0.0, **over: Any) -> Case:
    return Case(name, TrainerCase(name, **over), center, memtracker, dropout)


#: LoRA on a bfloat16 base: float32 LoRA tensors (PEFT's autocast) and a bfloat16 trainable copy of the score head
#: (PEFT upcasts adapter layers only). QLoRA: TRL casts every trainable parameter of a quantized model to bfloat16,
#: the score copy included (reward_trainer.py:549-554), and does not prepare it.
CASES = [
    _c("lora-bf16-autocast", mixed_precision="bf16", memtracker=True),
    # LoRA dropout 0.1 declared: TRL's disable_dropout (default true) sets it to 0 before training
    _c("lora-checkpointing-dropout-disabled-by-trl", mixed_precision="bf16", checkpointing=True, dropout=0.1),
    _c("qlora-nf4", arch="tiny-qwen2", quant=True, adapter="bfloat16", mixed_precision="bf16", memtracker=True),
    _c(
        "qlora-checkpointing-centred-accumulation-2",
        0.01,
        arch="tiny-qwen2",
        quant=True,
        adapter="bfloat16",
        mixed_precision="bf16",
        checkpointing=True,
        accumulation=2,
    ),
]


def ledger_text(c: Case) -> str:
    text = trainer_ledger(c.base).replace("  dropout: 0.0\n", f"  dropout: {c.dropout}\n", 1)
    settings = "" if c.center is None else f"  objective_settings: {{center_rewards_coefficient: {c.center}}}\n"
    return text.replace("training:\n", "training:\n  objective: reward\n" + settings, 1)


def truth_case(c: Case, folder: Path) -> dict[str, Any]:
    return {**trainer_truth_case(c.base, folder), "center_rewards_coefficient": c.center, "dropout": c.dropout}


def next_batch_bytes(c: Case) -> int:
    return 2 * 8 * 2 * c.base.microbatch * TYPICAL


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(f"reward-{c.name}")) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    callback = c.name == CALLBACK
    out = run_three_ways(folder, c.base.arch, ledger_text(c), truth_case(c, folder), TRUTH, c.memtracker, callback)
    return {"case": c, **out}


#: the case whose real run also carries ``LedgerCallback`` (the truth's run, shared)
CALLBACK = "lora-bf16-autocast"


def test_measure_is_the_real_reward_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
    c = runs["case"]
    assert_measure_is_the_truth(c.name, runs["measured"], runs["truth"], next_batch_bytes(c))


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    assert_estimate_is_the_measurement(runs["estimated"], runs["measured"])


def test_pytorch_memtracker_agrees_within_one_percent(runs: dict[str, Any]) -> None:
    c = runs["case"]
    if not c.memtracker:
        pytest.skip("MemTracker watches the cases marked for it")
    assert_memtracker_agrees(c.name, runs["measured"], runs["truth"], next_batch_bytes(c))


def test_the_method_says_which_step_ran(runs: dict[str, Any]) -> None:
    method = runs["estimated"].get("ledger", "activations").method or ""
    assert "RewardTrainer step" in method
    assert ("centring term" in method) is (runs["case"].center is not None)


def test_the_cases_cover_the_issue() -> None:
    """LoRA and QLoRA, with and without checkpointing, the centring term, accumulation."""
    assert len({c.name for c in CASES}) == len(CASES) >= 4
    assert any(c.base.quant for c in CASES) and any(not c.base.quant for c in CASES)
    assert any(c.base.checkpointing for c in CASES) and any(not c.base.checkpointing for c in CASES)
    assert any(c.center is not None for c in CASES)


def test_the_callback_on_a_reward_trainer_is_measure(runs: dict[str, Any]) -> None:
    """``LedgerCallback`` on TRL's ``RewardTrainer`` (the truth's own run): its ledger says ``reward``, read from the
    live trainer's config, and every phase it recorded equals ``measure --device cpu`` of that ledger to the byte."""
    c = runs["case"]
    if c.name != CALLBACK:
        pytest.skip(f"the callback rides on the real run of {CALLBACK}")
    assert_the_callback_is_measure(c.name, runs, "reward", next_batch_bytes(c))
