"""The DPO step ledgerspec simulates and measures is the step TRL's ``DPOTrainer`` runs, to the byte.

Each case is one configuration, run three ways on the CPU, as the Trainer truths are
(``tests/derivations/engine/test_trainer_truth.py``):

- the truth: TRL 1.16's real ``DPOTrainer`` (``tests/truths/dpo_run.py``: transformers builds the model, the trainer
  wraps it with the case's LoRA as its ``peft_config``, its collator, fused LM head, ``_compute_loss`` and accelerate
  run the step), its phases read by the tensor tracker from the outside, and (some cases) the whole
  run by PyTorch's own ``MemTracker``;
- ``ledgerspec measure --device cpu`` of the ledger that declares the configuration (``training.objective: dpo``);
- ``ledgerspec estimate --target cpu --full`` of the same ledger (fake tensors).

The one difference, byte for byte: the real run's CPU DataLoader has already produced the next micro-batch
(accelerate's ``DataLoaderShard`` fetches one ahead; on a GPU it is still on the host): ``input_ids``,
``attention_mask`` and ``completion_mask``, int64, 2 x microbatch x the next step's length, and with precomputed
reference log-probs their two float32 columns.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from ledgerspec.contract.document import load
from tests.derivations.engine.test_trainer_truth import Case as TrainerCase
from tests.derivations.engine.test_trainer_truth import ledger_text as trainer_ledger
from tests.derivations.engine.test_trainer_truth import truth_case as trainer_truth_case
from tests.support import DATA, TESTS, fresh_python
from tests.support.step_truth import (
    STEP_PHASES,
    assert_estimate_is_the_measurement,
    assert_measure_is_the_truth,
    assert_memtracker_agrees,
    assert_the_callback_is_measure,
    measured_copy,
    run_three_ways,
)

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "dpo_run.py"
TYPICAL = 32


@dataclass(frozen=True)
class Case:
    name: str
    base: TrainerCase
    reference: str = "adapter_disabled"
    memtracker: bool = False
    dropout: float = 0.0


def _c(
    name: str, reference: str = "adapter_disabled", memtracker: bool = False, dropout: float = 0.0, **over: Any
) -> Case:
    return Case(name, TrainerCase(name, **over), reference, memtracker, dropout)


#: QLoRA: TRL casts the adapters of a quantized model to bfloat16 (dpo_trainer.py:717-725), and does not prepare it.
#: No QLoRA case precomputes the reference: TRL's precomputation pass runs the model in eval mode without grad, and
#: on a CPU with AVX512-BF16 bitsandbytes 0.50 then repacks every 4-bit weight for its CPU kernel, for good
#: (``Linear4bit.forward``, nn/modules.py:613-620), so the CPU run trains another layout; a GPU never repacks. Found
#: as 13,240 B more in measure's forward than in the truth's (tiny-qwen2): the truth had repacked before its tracker.
CASES = [
    _c("lora-bf16-autocast", mixed_precision="bf16", memtracker=True),
    _c("lora-bf16-base-fp32-adapters"),
    # (lora-checkpointing was equal to the byte on 2026-12-03: dropped for CI's time; checkpointing is the QLoRA cases')
    _c("lora-precomputed-reference", "precomputed", mixed_precision="bf16"),
    _c("qlora-nf4", arch="tiny-qwen2", quant=True, adapter="bfloat16", mixed_precision="bf16", memtracker=True),
    _c(
        "qlora-checkpointing",
        arch="tiny-qwen2",
        quant=True,
        adapter="bfloat16",
        mixed_precision="bf16",
        checkpointing=True,
    ),
    _c("accumulation-2", mixed_precision="bf16", accumulation=2),
    _c("microbatch-1", mixed_precision="bf16", microbatch=1),
    # LoRA dropout 0.1 declared: TRL's disable_dropout (default true) sets it to 0 before training
    _c("lora-dropout-disabled-by-trl", mixed_precision="bf16", dropout=0.1),
    # a PEFT model handed to the trainer: TRL adds a frozen copy of its adapter, `ref`, and trains against it
    _c("lora-adapter-copy", "adapter_copy", mixed_precision="bf16"),
    _c(
        "qlora-adapter-copy-checkpointing",
        "adapter_copy",
        arch="tiny-qwen2",
        quant=True,
        adapter="bfloat16",
        mixed_precision="bf16",
        checkpointing=True,
    ),
    # a separate reference model handed to the trainer (`ref_model=`): a second copy of the base, on the device for
    # the whole run, its forward without grad (dpo_trainer.py:908-990, 1327-1338); with LoRA, through LedgerCallback
    # (REFERENCE_MODEL below: equal to the byte on 2026-12-03 run three ways too, dropped from here for CI's time)
    _c(
        "qlora-reference-model-checkpointing",
        "model",
        arch="tiny-qwen2",
        quant=True,
        adapter="bfloat16",
        mixed_precision="bf16",
        checkpointing=True,
    ),
]


#: LoRA with a separate reference model: the real DPOTrainer read by LedgerCallback, against measure and resolve
REFERENCE_MODEL = _c("lora-reference-model", "model", mixed_precision="bf16")


def ledger_text(c: Case) -> str:
    text = trainer_ledger(c.base).replace("  dropout: 0.0\n", f"  dropout: {c.dropout}\n", 1)
    settings = "" if c.reference == "adapter_disabled" else f"  objective_settings: {{reference: {c.reference}}}\n"
    return text.replace("training:\n", "training:\n  objective: dpo\n" + settings, 1)


def truth_case(c: Case, folder: Path) -> dict[str, Any]:
    # one prompt token per row: the ledger declares no completion length (the estimate's rows, Workload.prompt_length)
    return {
        **trainer_truth_case(c.base, folder),
        "reference": c.reference,
        "prompt": 1,
        "beta": 0.1,
        "dropout": c.dropout,
        "wrapped": c.reference == "adapter_copy",
    }


def next_batch_bytes(c: Case) -> int:
    rows = 2 * c.base.microbatch
    refs = 2 * 4 * c.base.microbatch if c.reference == "precomputed" else 0
    return 3 * 8 * rows * TYPICAL + refs


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(f"dpo-{c.name}")) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    callback = c.name in CALLBACK
    out = run_three_ways(folder, c.base.arch, ledger_text(c), truth_case(c, folder), TRUTH, c.memtracker, callback)
    return {"case": c, **out}


#: the cases whose real run also carries ``LedgerCallback`` (the truth's run, shared): the PEFT model's trainer with
#: its adapters off, and a PEFT model handed to the trainer (the truth's ``wrapped``)
CALLBACK = ("lora-bf16-autocast", "lora-adapter-copy")


def test_measure_is_the_real_dpo_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
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
    assert "DPOTrainer step" in method
    reference = {
        "precomputed": "precomputed",
        "adapter_copy": "copy of the adapter",
        "model": "separate reference model",
    }.get(runs["case"].reference, "adapters off")
    assert reference in method


def test_the_cases_cover_the_issue() -> None:
    """LoRA and QLoRA, with and without checkpointing, every simulated reference, accumulation, one row."""
    assert len({c.name for c in CASES}) == len(CASES) >= 8
    assert any(c.base.quant for c in CASES) and any(not c.base.quant for c in CASES)
    assert any(c.base.checkpointing for c in CASES) and any(not c.base.checkpointing for c in CASES)
    assert {c.reference for c in CASES} == {"adapter_disabled", "adapter_copy", "model", "precomputed"}


def _callback_run(folder: Path, c: Case, **extra: Any) -> Path:
    shutil.copytree(DATA / "measure" / c.base.arch, folder / c.base.arch)
    ledger = folder / "run.ledger.yaml"
    case_file, out_file = folder / "case.json", folder / "truth.json"
    case_file.write_text(json.dumps({**truth_case(c, folder), "ledger": str(ledger), **extra}), encoding="utf-8")
    proc = fresh_python([TRUTH, case_file, out_file])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ledger


def test_the_callback_on_a_dpo_trainer_records_the_dpo_step(runs: dict[str, Any]) -> None:
    """``LedgerCallback`` on TRL's ``DPOTrainer`` (the truth's own run): the ledger it writes says DPO with the
    reference read from the live trainer, and every phase it recorded equals ``measure --device cpu`` of that ledger to
    the byte, and the truth's reader of the same run less the batch held ahead (the two forwards of a step are one
    forward phase; the ``completion_mask`` no forward receives is this step's batch, not the one held ahead)."""
    c = runs["case"]
    if c.name != CALLBACK[0]:
        pytest.skip(f"the callback rides on the real run of {CALLBACK[0]}")
    assert_the_callback_is_measure(c.name, runs, "dpo", next_batch_bytes(c))
    reference = runs["callback"].get("training", "objective_settings", "reference")
    assert (reference.value, reference.effective_source(False)) == ("adapter_disabled", "DECLARED")  # not assumed


def test_a_peft_model_handed_to_the_dpo_trainer_trains_against_a_copy_of_its_adapter(runs: dict[str, Any]) -> None:
    """TRL 1.16 adds a frozen copy of the adapter, ``ref``, when it is given a PEFT model (dpo_trainer.py:666-691): the
    callback's ledger (on the truth's own run of a PEFT model handed to the trainer) says ``adapter_copy``, which the
    step simulates (no LS014), and its phases equal measure's and the truth's reader's."""
    from ledgerspec.checks.validate import validate

    c = runs["case"]
    if c.name != CALLBACK[1]:
        pytest.skip(f"the callback rides on the real run of {CALLBACK[1]}")
    assert truth_case(c, Path())["wrapped"]  # the trainer is handed the PEFT model
    doc = runs["callback"]
    assert doc.get("training", "objective_settings", "reference").value == "adapter_copy"
    assert [f.pointer for f in validate(doc).findings if f.rule == "LS014"] == []
    assert_the_callback_is_measure(c.name, runs, "dpo", next_batch_bytes(c))


def test_the_callback_on_a_dpo_trainer_with_a_reference_model_counts_it(tmp_path: Path) -> None:
    """``LedgerCallback`` on a ``DPOTrainer`` handed ``ref_model=``: the ledger says ``reference: model`` (read from
    ``trainer.ref_model``), which the step simulates (no LS014), and every phase the callback recorded, the reference
    model's weights and forward included, equals ``measure --device cpu`` of that ledger to the byte."""
    from ledgerspec.checks.validate import validate

    c = REFERENCE_MODEL
    ledger = _callback_run(tmp_path, c)
    doc = load(ledger)
    assert doc.get("training", "objective_settings", "reference").value == "model"
    assert [f.pointer for f in validate(doc).findings if f.rule == "LS014"] == []
    measured = measured_copy(ledger)  # every step phase the callback recorded is measure's, to the byte
    assert {p: doc.get("phases", p).value for p in STEP_PHASES} == {
        p: measured.get("phases", p).value for p in STEP_PHASES
    }
    after_load = doc.get("phases", "after_load").size()
    assert after_load == measured.get("phases", "after_load").size()
    # resolve counts both copies: the frozen base is what the real trainer's policy and ref_model held at train begin
    from tests.support import run_cli

    resolved = tmp_path / "resolved.ledger.yaml"
    resolved.write_text(ledger_text(c), encoding="utf-8")
    code, _, err = run_cli("resolve", str(resolved))
    assert code == 0, err
    frozen = load(resolved).get("ledger", "frozen_base")
    assert frozen.size() == after_load and "separate reference model" in (frozen.method or "")
