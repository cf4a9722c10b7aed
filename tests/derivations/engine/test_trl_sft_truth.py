"""TRL's fused LM head where it runs here: the SFT step ledgerspec simulates and measures with
``software.kernels.cross_entropy: trl_chunked_nll`` is the step TRL's ``SFTTrainer`` runs on the CPU, to the byte.

TRL 1.16's head is Triton on a GPU and torch on the CPU; on the CPU ``estimate --target cpu`` and ``measure`` run TRL's
own head (``add_fused_lm_head``, :mod:`ledgerspec.derivations.engine.trl_sft`), and the rest of the step is
ledgerspec's. The truth: TRL's real ``SFTTrainer`` (``tests/truths/sft_run.py``), read from the outside as the
Trainer truths are. The one difference, byte for byte: the next micro-batch the CPU DataLoader has already fetched
(``input_ids``, ``attention_mask``, ``labels``, int64, microbatch x the next step's length).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from tests.derivations.engine.test_trainer_truth import Case
from tests.derivations.engine.test_trainer_truth import ledger_text as trainer_ledger
from tests.derivations.engine.test_trainer_truth import truth_case as trainer_truth_case
from tests.support import TESTS
from tests.support.step_truth import (
    assert_estimate_is_the_measurement,
    assert_measure_is_the_truth,
    assert_memtracker_agrees,
    run_three_ways,
)

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "sft_run.py"
TYPICAL = 32
MEMTRACKER = {"lora-bf16-autocast"}

#: QLoRA: SFTTrainer casts the adapters of a quantized model to bfloat16 and does not prepare it, as DPOTrainer does
CASES = [
    Case("lora-bf16-autocast", mixed_precision="bf16"),
    Case("lora-bf16-base-fp32-adapters"),
    Case("lora-checkpointing", mixed_precision="bf16", checkpointing=True),
    Case("qlora-nf4", arch="tiny-qwen2", quant=True, adapter="bfloat16", mixed_precision="bf16"),
    Case("accumulation-2", mixed_precision="bf16", accumulation=2),
    Case("microbatch-1", mixed_precision="bf16", microbatch=1),
]


def ledger_text(c: Case) -> str:
    return trainer_ledger(c, "  kernels: {cross_entropy: trl_chunked_nll}\n")


def next_batch_bytes(c: Case) -> int:
    return 3 * 8 * c.microbatch * TYPICAL


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(f"trl-sft-{c.name}")) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    case = trainer_truth_case(c, folder)
    return {"case": c, **run_three_ways(folder, c.arch, ledger_text(c), case, TRUTH, c.name in MEMTRACKER)}


def test_measure_is_the_real_sft_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
    c = runs["case"]
    assert_measure_is_the_truth(c.name, runs["measured"], runs["truth"], next_batch_bytes(c))


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    assert_estimate_is_the_measurement(runs["estimated"], runs["measured"])


def test_pytorch_memtracker_agrees_within_one_percent(runs: dict[str, Any]) -> None:
    c = runs["case"]
    if c.name not in MEMTRACKER:
        pytest.skip("MemTracker watches the cases marked for it")
    assert_memtracker_agrees(c.name, runs["measured"], runs["truth"], next_batch_bytes(c))


def test_the_method_says_which_step_ran(runs: dict[str, Any]) -> None:
    method = runs["estimated"].get("ledger", "activations").method or ""
    assert "SFTTrainer step" in method and "fused LM head" in method
