"""The GRPO and RLOO steps ledgerspec simulates and measures are the steps TRL's ``GRPOTrainer`` and ``RLOOTrainer``
run (transformers' ``generate``, no vLLM), to the byte but for one 0-dim scalar.

Each case is one configuration, run three ways on the CPU, as the DPO and KTO truths are:

- the truth: TRL 1.16's real ``GRPOTrainer`` or ``RLOOTrainer`` (``tests/truths/grpo_run.py``: transformers builds
  the model, the trainer wraps it with the case's LoRA as its ``peft_config``; its sampler, generation, scoring, fused
  LM head, ``_compute_loss`` and accelerate run the step), its phases read by the tensor tracker from the outside;
- ``ledgerspec measure --device cpu`` of the ledger that declares the configuration (``training.objective: grpo`` or
  ``rloo``);
- ``ledgerspec estimate --target cpu --full`` of the same ledger (fake tensors).

The generation phase is ``generation_peak`` in both. The CPU dataloader holds nothing ahead (its batches are prompt
strings). The one difference, 4 bytes in every step phase (8 at the generation peak, :data:`SCALARS`): both runs
leave a few 0-dim tensors alive after the ops that made them (4 or 8 bytes each: the scalar operands of TRL's
``nanstd``, of the reward masking, of transformers' mask check, the backward's seed gradient); tracked at the first
step's end (``tracker._register`` with the stack of each storage of 8 bytes or less), they sum to 52 bytes in the
real run and 48 in the simulation, made by slightly different ops on each side. QLoRA: a 4-bit layer called without
gradient runs bitsandbytes' ``gemm_4bit`` op, whose dequantized weight is made below the dispatcher (no tracker sees
it, on either side; ``estimate.qlora``).
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
from tests.support.step_truth import measured_phase, run_three_ways

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "grpo_run.py"
WORST, TYPICAL, COMPLETION = 24, 16, 8
PHASES = ("generation_peak", "forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")
#: bytes of 0-dim scalars the real GRPOTrainer leaves alive beyond the simulated step's (see the module docstring)
SCALARS = {
    "generation_peak": 8,
    "forward_peak": 4,
    "backward_peak": 4,
    "optimizer_step_peak": 4,
    "steady_state_peak": 4,
}


#: RLOO: the generation phase's peak is its old-policy forward (the scalars come after it)
RLOO_SCALARS = {**SCALARS, "generation_peak": 0}


@dataclass(frozen=True)
class Case:
    name: str
    base: TrainerCase
    generations: int = 2
    trainer: str = "grpo"


def _c(name: str, generations: int = 2, trainer: str = "grpo", **over: Any) -> Case:
    return Case(name, TrainerCase(name, **{"microbatch": 4, "mixed_precision": "bf16", **over}), generations, trainer)


#: QLoRA: TRL casts the adapters of a quantized model to bfloat16 (grpo_trainer.py:538-541). RLOO at RLOOConfig's
#: defaults: beta 0.05, so the reference log-probs of the policy with its adapters off (rloo_trainer.py:1589-1609).
CASES = [
    _c("lora-2-generations"),
    _c("lora-4-generations-checkpointing", 4, checkpointing=True),
    _c("qlora-2-generations", arch="tiny-qwen2", quant=True, adapter="bfloat16"),
    _c("rloo-lora-2-generations", trainer="rloo"),
]


def ledger_text(c: Case) -> str:
    text = trainer_ledger(c.base)
    settings = f"  objective_settings: {{max_completion_length: {COMPLETION}, num_generations: {c.generations}}}\n"
    text = text.replace("training:\n", f"training:\n  objective: {c.trainer}\n" + settings, 1)
    lines = []
    for line in text.splitlines():
        if line.startswith("  max_length:"):
            line = f"  max_length: {WORST}"
        elif line.startswith("  sequence_p50:"):
            line = f"  sequence_p50: {TYPICAL}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def truth_case(c: Case, folder: Path) -> dict[str, Any]:
    return {
        **trainer_truth_case(c.base, folder),
        "seq_worst": WORST,
        "seq_typical": TYPICAL,
        "trainer": c.trainer,
        "completion": COMPLETION,
        "num_generations": c.generations,
        "beta": 0.05 if c.trainer == "rloo" else 0.0,  # each trainer's default
        "dropout": 0.0,
    }


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(f"grpo-{c.name}")) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    callback = c.name in CALLBACK
    out = run_three_ways(folder, c.base.arch, ledger_text(c), truth_case(c, folder), TRUTH, False, callback)
    return {"case": c, **out}


#: the cases whose real run also carries ``LedgerCallback`` (one per trainer: its run is the truth's, shared)
CALLBACK = ("lora-2-generations", "rloo-lora-2-generations")


def test_measure_is_the_real_grpo_trainer_step(runs: dict[str, Any]) -> None:
    got = {p: measured_phase(runs["measured"], p) for p in PHASES}
    scalars = RLOO_SCALARS if runs["case"].trainer == "rloo" else SCALARS
    want = {p: runs["truth"][p] - scalars[p] for p in PHASES}
    assert got == want, f"{runs['case'].name}: measure {got} vs the real GRPOTrainer {want}"


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    got = {p: runs["estimated"].get("x-estimate", "phases", p).value for p in PHASES}
    assert got == {p: measured_phase(runs["measured"], p) for p in PHASES}


def test_the_method_says_which_step_ran(runs: dict[str, Any]) -> None:
    method = runs["estimated"].get("ledger", "activations").method or ""
    assert f"{runs['case'].trainer.upper()}Trainer step" in method and "generation phase" in method


def test_the_cases_cover_the_issue() -> None:
    """LoRA and QLoRA, two numbers of generations, with and without checkpointing, GRPO and RLOO."""
    assert {c.generations for c in CASES} == {2, 4}
    assert {c.trainer for c in CASES} == {"grpo", "rloo"}
    assert any(c.base.quant for c in CASES) and any(not c.base.quant for c in CASES)
    assert any(c.base.checkpointing for c in CASES) and any(not c.base.checkpointing for c in CASES)


def test_the_callback_on_grpo_and_rloo_trainers_records_the_generation_phase(runs: dict[str, Any]) -> None:
    """``LedgerCallback`` on TRL's ``GRPOTrainer`` and ``RLOOTrainer`` (the truth's own run): the ledger it writes
    declares the objective and its settings read from the live trainer's ``GRPOConfig``/``RLOOConfig``, and every
    phase it recorded, ``generation_peak`` included (``_generate_and_score_completions``, inside ``training_step``), is
    the real run's as the truth's reader saw it, and ``measure --device cpu`` of that ledger less the 0-dim scalars
    the real trainer holds beyond the simulated step (:data:`SCALARS`, the module docstring)."""
    c: Case = runs["case"]
    if c.name not in CALLBACK:
        pytest.skip(f"the callback rides on the real runs of {CALLBACK}")
    doc, measured = runs["callback"], runs["callback_measured"]
    objective = doc.get("training", "objective")
    assert (objective.value, objective.effective_source(False)) == (c.trainer, "DECLARED")  # the live config's class
    settings = ("training", "objective_settings")
    assert doc.get(*settings, "num_generations").value == c.generations
    assert doc.get(*settings, "max_completion_length").value == COMPLETION
    reference = "adapter_disabled" if c.trainer == "rloo" else "none"  # RLOO's beta 0.05; GRPO's 0
    assert (doc.get(*settings, "reference").value, doc.get(*settings, "reference").effective_source(False)) == (
        reference,
        "DECLARED",
    )
    assert doc.get("workload", "max_length").value == WORST  # the longest prompt + completion the callback saw
    got = {p: measured_phase(doc, p) for p in PHASES}
    assert got == {p: runs["truth"][p] for p in PHASES}, "the callback vs the truth's reader of the same run"
    scalars = RLOO_SCALARS if c.trainer == "rloo" else SCALARS
    assert got == {p: measured_phase(measured, p) + scalars[p] for p in PHASES}
