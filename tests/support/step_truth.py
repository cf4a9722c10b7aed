"""One configuration run three ways on the CPU, as the step truths compare them (``tests/derivations/engine/
test_dpo_truth.py``, ``test_trl_sft_truth.py``): the real trainer's run (a script of ``tests/truths/``, read from the
outside), ``ledgerspec measure --device cpu`` and ``ledgerspec estimate --target cpu --full`` of the ledger that
declares the configuration; and the comparisons they make, the batch the CPU DataLoader holds ahead set apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document, load
from tests.support import DATA, fresh_python, run_cli

STEP_PHASES = ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")


def run_three_ways(
    folder: Path, arch: str, ledger: str, case: dict[str, Any], truth: Path, memtracker: bool, callback: bool = False
) -> dict[str, Any]:
    """``measured``, ``estimated`` (the two documents) and ``truth`` (the truth script's phases; with
    ``memtracker``, its ``memtracker_peak`` too, from the run :func:`truth_runs` says) of one configuration. With
    ``callback``, the truth's real run also carries ``LedgerCallback`` (the truth scripts' ``ledger``): ``callback`` is
    the ledger it wrote and ``callback_measured`` ``measure --device cpu`` of a copy of that ledger (the truth's own
    figures are still compared with ``measured``: a callback that changed what the run holds would fail those
    comparisons)."""
    shutil.copytree(DATA / "measure" / arch, folder / arch)
    measured, estimated = folder / "measured.ledger.yaml", folder / "estimated.ledger.yaml"
    for path in (measured, estimated):
        path.write_text(ledger, encoding="utf-8")
    code, _, err = run_cli("measure", str(measured), "--device", "cpu")
    assert code == 0, err
    code, _, err = run_cli("estimate", str(estimated), "--target", "cpu", "--full")
    assert code == 0, err
    case_file, out_file = folder / "case.json", folder / "truth.json"
    written = folder / "callback.ledger.yaml"
    phases: dict[str, Any] = {}
    for i, mode in enumerate(truth_runs(case, memtracker)):
        with_callback = {"ledger": str(written)} if callback and i == 0 else {}  # the first run only
        case_file.write_text(json.dumps({**case, **with_callback}), encoding="utf-8")
        proc = fresh_python([truth, case_file, out_file, *mode])
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(out_file.read_text(encoding="utf-8"))["phases"]
        phases.update(got if i == 0 else {"memtracker_peak": got["memtracker_peak"]})
    out = {"measured": load(measured), "estimated": load(estimated), "truth": phases}
    if callback:
        out.update(callback=load(written), callback_measured=measured_copy(written))
    return out


def measured_copy(ledger: Path) -> Document:
    """``measure --device cpu`` of a copy of ``ledger`` (a callback's ledger), written beside it."""
    again = ledger.with_name("callback-measured.ledger.yaml")
    shutil.copy(ledger, again)
    code, _, err = run_cli("measure", str(again), "--device", "cpu")
    assert code == 0, err
    return load(again)


def truth_runs(case: dict[str, Any], memtracker: bool) -> list[tuple[str, ...]]:
    """The truth script's runs of ``case``, as its extra arguments: the first run's phases are the truth's. Without
    ``memtracker`` one plain run; with it, PyTorch's ``MemTracker`` watches that same run, except under activation
    checkpointing (``gradient_checkpointing``), where its module hooks keep the step's autograd graph alive past
    ``backward`` and so change what the optimizer step holds (``tests/truths/trainer_run.py``): there it watches a
    second run of its own. Elsewhere it changes none of the tracker's phases: on 2026-12-03 every case run both ways
    (15 Trainer cases, the DPO, KTO, CPO, ORPO, reward and SFT cases marked for it) gave the same four phases to the
    byte, the LoRA checkpointing case alone differing; and the phases of the shared run are still compared with
    ``measure --device cpu``, which runs no MemTracker: a perturbation would fail that comparison, not pass it."""
    if not memtracker:
        return [()]
    if case.get("gradient_checkpointing"):
        return [(), ("--memtracker",)]
    return [("--memtracker",)]


def measured_phase(doc: Document, phase: str) -> int:
    return int(doc.get("phases", phase).size() or -1)


def assert_measure_is_the_truth(name: str, doc: Document, truth: dict[str, Any], ahead: int) -> None:
    """Every step phase of the measurement is the real run's, less the ``ahead`` bytes of the next micro-batch."""
    got = {p: measured_phase(doc, p) for p in STEP_PHASES}
    want = {p: truth[p] - ahead for p in STEP_PHASES}
    assert got == want, f"{name}: measure {got} vs the real trainer (minus the batch held ahead, {ahead} B) {want}"


def assert_estimate_is_the_measurement(est: Document, doc: Document) -> None:
    for phase in STEP_PHASES:
        assert est.get("x-estimate", "phases", phase).value == measured_phase(doc, phase), phase


def assert_memtracker_agrees(name: str, doc: Document, truth: dict[str, Any], ahead: int) -> None:
    """PyTorch's own tracker over the real run: its peak is the measurement's (within 1 %)."""
    peak = int(doc.get("metrics", "peak_allocated").size() or 0)
    mem = truth["memtracker_peak"] - ahead
    assert abs(mem - peak) <= 0.01 * peak, (name, mem, peak)


def assert_the_callback_is_measure(name: str, run: dict[str, Any], objective: str, ahead: int) -> None:
    """``LedgerCallback`` on the real trainer (``run_three_ways(..., callback=True)``): its ledger declares
    ``objective`` (read from the live config's class), and every step phase it recorded equals ``measure --device cpu``
    of that ledger, and the truth's reader of the same run less the ``ahead`` bytes of the next micro-batch (the
    callback sets that batch apart, as ``measure`` never holds it)."""
    doc = run["callback"]
    declared = doc.get("training", "objective")
    assert (declared.value, declared.effective_source(False)) == (objective, "DECLARED"), name
    got = {p: measured_phase(doc, p) for p in STEP_PHASES}
    assert got == {p: measured_phase(run["callback_measured"], p) for p in STEP_PHASES}, name
    assert got == {p: run["truth"][p] - ahead for p in STEP_PHASES}, name


def assert_the_callback_read_trls_4bit_preparation(name: str, doc: Document) -> None:
    """A callback ledger of ORPO's or CPO's trainer over a 4-bit base with bf16 (TRL 1.16: ``prepare_model_for_kbit_
    training``, PEFT's float32 adapters, ``peft_module_casting_to_bf16``; orpo_trainer.py:220-265,
    cpo_trainer.py:210-255): the preparation, float32 adapters and TRL's casts read from the live model and trainer
    (the frozen non-4-bit parameters float32 but for the embeddings and the LM head, cast back to bfloat16), and
    nothing for LS014 or LS015."""
    from ledgerspec.checks.validate import validate

    assert doc.get("base_model", "prepare_for_kbit_training").value is True, name
    assert doc.get("adapter", "dtype").value == "float32", name
    assert doc.get("base_model", "module_dtypes").value == {
        "norm": "float32",
        "lm_head": "bfloat16",
        "embed_tokens": "bfloat16",
    }, name
    assert [f.rule for f in validate(doc).findings if f.rule in ("LS014", "LS015")] == [], name
