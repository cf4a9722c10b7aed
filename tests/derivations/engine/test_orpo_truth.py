"""The ORPO step ledgerspec simulates and measures is the step TRL's ``ORPOTrainer`` runs, to the byte.

Each case is one configuration, run three ways on the CPU, as the DPO truths are
(``tests/derivations/engine/test_dpo_truth.py``):

- the truth: TRL 1.16's real ``trl.experimental.orpo.ORPOTrainer`` (``tests/truths/orpo_run.py``: transformers builds
  the model, the trainer wraps it with the case's LoRA as its ``peft_config``, its collator, ``concatenated_forward``,
  ``get_batch_loss_metrics`` and accelerate run the step), its phases read by the tensor tracker from the outside, and
  (some cases) the whole run by PyTorch's own ``MemTracker``;
- ``ledgerspec measure --device cpu`` of the ledger that declares the configuration (``training.objective: orpo``);
- ``ledgerspec estimate --target cpu --full`` of the same ledger (fake tensors).

The one difference, byte for byte: the real run's CPU DataLoader has already produced the next micro-batch: the
chosen rows' and the rejected rows' ``input_ids``, ``attention_mask`` and ``labels`` and the prompts' two tensors,
int64, microbatch x the next step's lengths (the rejected rows a token shorter, the prompts one token).
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
    assert_the_callback_read_trls_4bit_preparation,
    run_three_ways,
)

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "orpo_run.py"
TYPICAL = 32


@dataclass(frozen=True)
class Case:
    name: str
    base: TrainerCase
    memtracker: bool = False


def _c(name: str, memtracker: bool = False, **over: Any) -> Case:
    return Case(name, TrainerCase(name, **over), memtracker)


#: QLoRA: handed a 4-bit base and a ``peft_config``, ORPOTrainer prepares it for k-bit training, keeps PEFT's float32
#: adapters, casts norms to float32 and ``lm_head``/``embed_tokens`` to bfloat16 (bf16), and runs ``compute_loss`` in
#: an autocast region of its own: the ledger declares the preparation and the casts as TRL makes them.
CASES = [
    _c("lora-bf16-autocast", mixed_precision="bf16", memtracker=True),
    _c("lora-bf16-base-fp32-adapters"),
    _c("lora-checkpointing-accumulation-2", mixed_precision="bf16", checkpointing=True, accumulation=2),
    _c(
        "qlora-nf4-checkpointing",
        arch="tiny-qwen2",
        quant=True,
        prepare=True,
        trl_casts=True,
        mixed_precision="bf16",
        checkpointing=True,
    ),
]


def ledger_text(c: Case) -> str:
    return trainer_ledger(c.base).replace("training:\n", "training:\n  objective: orpo\n", 1)


def truth_case(c: Case, folder: Path) -> dict[str, Any]:
    return {
        **trainer_truth_case(c.base, folder),
        "reference": "none",
        "prompt": 1,
        "beta": 0.1,
        "dropout": 0.0,
        "wrapped": False,
    }


def next_batch_bytes(c: Case) -> int:
    b = c.base.microbatch
    return 8 * b * (3 * TYPICAL + 3 * (TYPICAL - 1) + 2 * 1)


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(f"orpo-{c.name}")) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    callback = c.name == CALLBACK
    out = run_three_ways(folder, c.base.arch, ledger_text(c), truth_case(c, folder), TRUTH, c.memtracker, callback)
    return {"case": c, **out}


#: the case whose real run also carries ``LedgerCallback`` (the truth's run, shared)
CALLBACK = "qlora-nf4-checkpointing"


def test_measure_is_the_real_orpo_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
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
    assert "ORPOTrainer step" in method
    assert ("TRL's own autocast region" in method) == runs["case"].base.quant  # bf16 on a 4-bit base


def test_the_cases_cover_with_and_without_checkpointing() -> None:
    assert len({c.name for c in CASES}) == len(CASES) >= 3
    assert any(c.base.checkpointing for c in CASES) and any(not c.base.checkpointing for c in CASES)
    assert any(c.base.quant for c in CASES) and any(not c.base.quant for c in CASES)  # LoRA and QLoRA nf4


def test_the_callback_on_an_orpo_trainer_is_measure(runs: dict[str, Any]) -> None:
    """``LedgerCallback`` on TRL's ``ORPOTrainer`` over a 4-bit base (the truth's own run): its ledger says ``orpo``,
    read from the live trainer's config, the preparation and TRL's casts read from the live model and trainer
    (float32 adapters, the frozen non-4-bit parameters float32 but for the embeddings and the LM head TRL cast back to
    bfloat16), nothing for LS014 or LS015, and every phase it recorded equals ``measure --device cpu`` of that ledger
    and the truth's reader of the same run to the byte."""
    c = runs["case"]
    if c.name != CALLBACK:
        pytest.skip(f"the callback rides on the real run of {CALLBACK}")
    assert_the_callback_is_measure(c.name, runs, "orpo", next_batch_bytes(c))
    assert_the_callback_read_trls_4bit_preparation(c.name, runs["callback"])
