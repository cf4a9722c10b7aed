"""TRL's fused LM head where it runs here: the SFT step ledgerspec simulates and measures with
``software.kernels.cross_entropy: trl_chunked_nll`` is the step TRL's ``SFTTrainer`` runs on the CPU, to the byte.

TRL 1.16's head is Triton on a GPU and torch on the CPU; on the CPU ``estimate --target cpu`` and ``measure`` run TRL's
own head (``add_fused_lm_head``, :mod:`ledgerspec.derivations.engine.trl_sft`), and the rest of the step is
ledgerspec's. The truth: TRL's real ``SFTTrainer`` (``tests/truths/sft_run.py``), read from the outside as the
Trainer truths are. The one difference, byte for byte: the next micro-batch the CPU DataLoader has already fetched
(``input_ids``, ``attention_mask``, ``labels``, int64, microbatch x the next step's length).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from ledgerspec.contract.document import load
from tests.derivations.engine.test_trainer_truth import Case
from tests.derivations.engine.test_trainer_truth import ledger_text as trainer_ledger
from tests.derivations.engine.test_trainer_truth import truth_case as trainer_truth_case
from tests.support import DATA, TESTS, fresh_python

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "sft_run.py"
STEP_PHASES = ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")
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
    from tests.support import run_cli

    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    shutil.copytree(DATA / "measure" / c.arch, folder / c.arch)
    measured, estimated = folder / "measured.ledger.yaml", folder / "estimated.ledger.yaml"
    for path in (measured, estimated):
        path.write_text(ledger_text(c), encoding="utf-8")
    code, _, err = run_cli("measure", str(measured), "--device", "cpu")
    assert code == 0, err
    code, _, err = run_cli("estimate", str(estimated), "--target", "cpu", "--full")
    assert code == 0, err
    case_file, out_file = folder / "case.json", folder / "truth.json"
    case_file.write_text(json.dumps(trainer_truth_case(c, folder)), encoding="utf-8")
    truth: dict[str, Any] = {}
    for mode in ((), ("--memtracker",)) if c.name in MEMTRACKER else ((),):
        proc = fresh_python([TRUTH, case_file, out_file, *mode])
        assert proc.returncode == 0, proc.stderr[-3000:]
        phases = json.loads(out_file.read_text(encoding="utf-8"))["phases"]
        truth.update(phases if not mode else {"memtracker_peak": phases["memtracker_peak"]})
    return {"case": c, "measured": load(measured), "estimated": load(estimated), "truth": truth}


def _measured(doc: Any, phase: str) -> int:
    return int(doc.get("phases", phase).size() or -1)


def test_measure_is_the_real_sft_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
    c, doc, truth = runs["case"], runs["measured"], runs["truth"]
    ahead = next_batch_bytes(c)
    got = {p: _measured(doc, p) for p in STEP_PHASES}
    want = {p: truth[p] - ahead for p in STEP_PHASES}
    assert got == want, f"{c.name}: measure {got} vs SFTTrainer (minus the batch held ahead, {ahead} B) {want}"


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    est, doc = runs["estimated"], runs["measured"]
    for phase in STEP_PHASES:
        assert est.get("x-estimate", "phases", phase).value == _measured(doc, phase), phase


def test_pytorch_memtracker_agrees_within_one_percent(runs: dict[str, Any]) -> None:
    c, doc, truth = runs["case"], runs["measured"], runs["truth"]
    if c.name not in MEMTRACKER:
        pytest.skip("MemTracker watches the cases marked for it (each is a second real run)")
    peak = int(doc.get("metrics", "peak_allocated").size() or 0)
    mem = truth["memtracker_peak"] - next_batch_bytes(c)
    assert abs(mem - peak) <= 0.01 * peak, (c.name, mem, peak)


def test_the_method_says_which_step_ran(runs: dict[str, Any]) -> None:
    method = runs["estimated"].get("ledger", "activations").method or ""
    assert "SFTTrainer step" in method and "fused LM head" in method
