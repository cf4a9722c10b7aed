"""The step ledgerspec simulates and measures is the step ``transformers.Trainer`` runs, to the byte.

Each case is one configuration, run three ways on the CPU:

- the truth: a real ``transformers.Trainer`` run (``tests/truths/trainer_run.py``: transformers builds the model,
  PEFT the adapters, bitsandbytes quantizes the QLoRA base as ``from_pretrained`` does, accelerate wraps the step;
  nothing of ledgerspec's workload or step), its phases read by the tensor tracker from the outside, and its whole
  run by PyTorch's own ``MemTracker``;
- ``ledgerspec measure --device cpu`` of the ledger that declares the configuration;
- ``ledgerspec estimate --target cpu --full`` of the same ledger (fake tensors, the CPU's kernels).

PyTorch's ``MemTracker`` watches the truth's own run, but under activation checkpointing, where it perturbs the step
it watches: there it watches a second, separate run of the case (``tests.support.step_truth.truth_runs``). Every
difference is explained, byte for byte: the real run's CPU DataLoader has already produced the next micro-batch
(accelerate's ``DataLoaderShard`` fetches one ahead; on a GPU that batch is still on the host, so the step ledgerspec
models does not hold it): ``input_ids``, ``labels`` and, when the batch has one, ``attention_mask``, int64,
microbatch x the next step's length. Nothing else differs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from ledgerspec.contract.document import load
from tests.support import DATA, TESTS, CliRunner, fresh_python
from tests.support.step_truth import truth_runs

pytestmark = pytest.mark.slow

TRUTH = TESTS / "truths" / "trainer_run.py"
STEP_PHASES = ("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak")
WORST, TYPICAL = 64, 32


@dataclass(frozen=True)
class Case:
    name: str
    arch: str = "tiny-llama"
    loaded: str = "bfloat16"
    adapter: str = "float32"
    mixed_precision: str = "no"
    quant: bool = False
    prepare: bool = False
    trl_casts: bool = False
    checkpointing: bool = False
    microbatch: int = 2
    accumulation: int = 1
    packing: bool = False
    optimizer: str = "adamw_torch"
    max_grad_norm: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    full: bool = False  # method.kind full: no adapters, every parameter trained (issue 26)

    @property
    def mask(self) -> bool:
        """The collator's attention mask: present unless rows are packed."""
        return not self.packing


CASES = [
    Case("bf16-base-fp32-adapters"),
    Case("bf16-autocast", mixed_precision="bf16"),
    Case("fp16-autocast-grad-scaler", loaded="float16", mixed_precision="fp16"),
    Case("qlora-nf4-no-preparation", arch="tiny-qwen2", quant=True),
    Case(
        "qlora-nf4-peft-preparation-bf16-autocast", arch="tiny-qwen2", quant=True, prepare=True, mixed_precision="bf16"
    ),
    Case(
        "qlora-trl-casts",
        arch="tiny-qwen2",
        quant=True,
        prepare=True,
        trl_casts=True,
        adapter="bfloat16",
        mixed_precision="bf16",
    ),
    Case("gradient-checkpointing", mixed_precision="bf16", checkpointing=True),
    Case("gradient-accumulation-2", accumulation=2),
    Case("unpadded-packed-rows", packing=True, mixed_precision="bf16"),
    Case("microbatch-1", microbatch=1),
    Case("paged-adamw-8bit", optimizer="paged_adamw_8bit", mixed_precision="bf16"),
    Case("no-clipping", max_grad_norm=0.0),
    # full fine-tuning: every parameter trained, its gradient and AdamW state in the parameter's dtype
    Case("full-bf16", full=True),
    Case("full-bf16-checkpointing", full=True, checkpointing=True),
    Case("full-fp32-weights-bf16-autocast", loaded="float32", mixed_precision="bf16", full=True),
]


def ledger_text(c: Case, software: str = "") -> str:
    quant = (
        "  quantized: true\n"
        + ("  prepare_for_kbit_training: true\n" if c.prepare else "")
        + ("  module_dtypes: {norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}\n" if c.trl_casts else "")
        + "  quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}\n"
        if c.quant
        else "  quantized: false\n"
    )
    method = (
        "  kind: full\n"
        if c.full
        else f"""  kind: {"QLoRA" if c.quant else "LoRA"}
  rank: 4
  alpha: 8
  dropout: 0.0
  target_modules: [q_proj, v_proj]
  bias: none
"""
    )
    adapter = "" if c.full else f"adapter:\n  dtype: {c.adapter}\n"
    return f"""ledgerspec: ledger/v1
title: {c.name}
identity:
  model_id: tests/{c.arch}
  config_sha256: UNKNOWN
  config_path: {c.arch}/config.json
software:
  attention_implementation: sdpa
{software}method:
{method}base_model:
  loaded_dtype: {c.loaded}
{quant}{adapter}workload:
  max_length: {WORST}
  sequence_p50: {TYPICAL}
  packing: {str(c.packing).lower()}
  microbatch: {c.microbatch}
  gradient_accumulation: {c.accumulation}
training:
  loop: trainer
  mixed_precision: {c.mixed_precision}
  max_grad_norm: {c.max_grad_norm}
optimizer:
  name: {c.optimizer}
memory_options:
  gradient_checkpointing: {str(c.checkpointing).lower()}
  checkpointing_kind: non-reentrant
"""


def truth_case(c: Case, folder: Path) -> dict[str, Any]:
    return {
        "config": str(folder / c.arch),
        "loaded_dtype": c.loaded,
        "attention": "sdpa",
        "rank": 4,
        "targets": ["q_proj", "v_proj"],
        "mixed_precision": c.mixed_precision,
        "gradient_checkpointing": c.checkpointing,
        "microbatch": c.microbatch,
        "accumulation": c.accumulation,
        "seq_worst": WORST,
        "seq_typical": TYPICAL,
        "steps": 2,
        "padded": not c.packing,
        "packing": c.packing,
        "mask": c.mask,
        "max_grad_norm": c.max_grad_norm,
        "optimizer": c.optimizer,
        "quant": {"type": "nf4", "double_quant": True, "compute_dtype": "bfloat16", "storage_dtype": "uint8"}
        if c.quant
        else None,
        "prepare_kbit": c.prepare,
        "adapter_dtype": c.adapter if c.adapter != "float32" else None,
        "trl_casts": "bfloat16" if c.trl_casts else None,
        "full": c.full,
        "count": c.full,  # the ledger's components counted in the run's live tensors (resolve's truth)
    }


def next_batch_bytes(c: Case) -> int:
    """The micro-batch the real run's CPU DataLoader holds ahead: int64 ids, labels (and mask) of the next step
    (packed rows are all max_length long)."""
    return (3 if c.mask else 2) * 8 * c.microbatch * (WORST if c.packing else TYPICAL)


@pytest.fixture(
    scope="module",
    # one worker runs all tests of a case (scripts/test distributes with --dist loadgroup): its runs happen once
    params=[pytest.param(c, id=c.name, marks=pytest.mark.xdist_group(c.name)) for c in CASES],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support import run_cli

    c: Case = request.param
    folder = tmp_path_factory.mktemp(c.name)
    shutil.copytree(DATA / "measure" / c.arch, folder / c.arch)
    measured = folder / "measured.ledger.yaml"
    measured.write_text(ledger_text(c), encoding="utf-8")
    estimated = folder / "estimated.ledger.yaml"
    estimated.write_text(ledger_text(c), encoding="utf-8")
    code, _, err = run_cli("measure", str(measured), "--device", "cpu")
    assert code == 0, err
    code, _, err = run_cli("estimate", str(estimated), "--target", "cpu", "--full")
    assert code == 0, err
    case_file, out_file = folder / "case.json", folder / "truth.json"
    case_file.write_text(json.dumps(truth_case(c, folder)), encoding="utf-8")
    truth: dict[str, Any] = {}
    for i, mode in enumerate(truth_runs(truth_case(c, folder), memtracker=True)):  # MemTracker: its own run or not
        proc = fresh_python([TRUTH, case_file, out_file, *mode])
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(out_file.read_text(encoding="utf-8"))
        phases = result["phases"]
        truth.update(phases if i == 0 else {"memtracker_peak": phases["memtracker_peak"]})
        if i == 0 and "components" in result:
            truth["components"] = result["components"]
    return {"case": c, "measured": load(measured), "estimated": load(estimated), "truth": truth, "folder": folder}


def _truth(case: dict[str, Any], folder: Path, *mode: str) -> dict[str, Any]:
    case_file, out_file = folder / "case.json", folder / "truth.json"
    case_file.write_text(json.dumps(case), encoding="utf-8")
    proc = fresh_python([TRUTH, case_file, out_file, *mode])
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases: dict[str, Any] = json.loads(out_file.read_text(encoding="utf-8"))["phases"]
    return phases


def test_a_declared_bitsandbytes_before_0_43_2_is_modelled(tmp_path: Path) -> None:
    """``software.bitsandbytes: 0.42.0`` on the installed 0.50: the estimate models 0.42's MatMul4Bit, which keeps
    each 4-bit layer's input for backward. The truth: the real Trainer with the installed bitsandbytes patched to
    0.43.1's ``ctx.tensors = (A, B)`` (tests/truths/trainer_run.py); the same Trainer unpatched is the other side."""
    from tests.support import run_cli

    c = Case("qlora-bitsandbytes-0.42", arch="tiny-qwen2", quant=True, mixed_precision="bf16")
    shutil.copytree(DATA / "measure" / c.arch, tmp_path / c.arch)
    declared = tmp_path / "declared.ledger.yaml"
    declared.write_text(ledger_text(c, '  bitsandbytes: "0.42.0"\n'), encoding="utf-8")
    installed = tmp_path / "installed.ledger.yaml"
    installed.write_text(ledger_text(c), encoding="utf-8")
    for path in (declared, installed):
        code, _, err = run_cli("estimate", str(path), "--target", "cpu", "--full")
        assert code == 0, err
    old = _truth({**truth_case(c, tmp_path), "bitsandbytes_keeps_input": True}, tmp_path)
    new = _truth(truth_case(c, tmp_path), tmp_path)
    ahead = next_batch_bytes(c)
    est_old, est_new = load(declared), load(installed)
    for phase in STEP_PHASES:
        assert est_old.get("x-estimate", "phases", phase).value == old[phase] - ahead, phase
        assert est_new.get("x-estimate", "phases", phase).value == new[phase] - ahead, phase
    assert old["backward_peak"] > new["backward_peak"]  # the kept inputs: a difference that could be missed
    assert est_old.get("x-estimate", "differences", "bitsandbytes-4bit-matmul-input", "computed_as").value == "older"
    assert "keeps its input for backward" in (est_old.get("ledger", "activations").method or "")


def _measured(doc: Any, phase: str) -> int:
    return int(doc.get("phases", phase).size() or -1)


def test_measure_is_the_real_trainer_step_to_the_byte(runs: dict[str, Any]) -> None:
    c, doc, truth = runs["case"], runs["measured"], runs["truth"]
    ahead = next_batch_bytes(c)
    got = {p: _measured(doc, p) for p in STEP_PHASES}
    want = {p: truth[p] - ahead for p in STEP_PHASES}
    assert got == want, f"{c.name}: measure {got} vs the Trainer (minus the batch held ahead, {ahead} B) {want}"


def test_the_cpu_estimate_is_the_measurement_to_the_byte(runs: dict[str, Any]) -> None:
    est, doc = runs["estimated"], runs["measured"]
    for phase in STEP_PHASES:
        assert est.get("x-estimate", "phases", phase).value == _measured(doc, phase), phase


def test_pytorch_memtracker_agrees_within_one_percent(runs: dict[str, Any]) -> None:
    """PyTorch's own tracker over the real Trainer run: its peak is the measurement's peak (within 1 %)."""
    c, doc, truth = runs["case"], runs["measured"], runs["truth"]
    peak = int(doc.get("metrics", "peak_allocated").size() or 0)
    mem = truth["memtracker_peak"] - next_batch_bytes(c)
    assert abs(mem - peak) <= 0.01 * peak, (c.name, mem, peak)


def test_full_fine_tuning_resolves_to_the_trainers_tensors(runs: dict[str, Any]) -> None:
    """``method.kind: full``: resolve's figures are the tensors the real Trainer holds, counted in its run (every
    parameter trained: its weights, their gradients and AdamW's state after the first optimizer step)."""
    from ledgerspec.derivations.resolve.resolver import resolve

    c = runs["case"]
    if not c.full:
        pytest.skip("resolve's LoRA figures are checked against real tensors in tests/derivations/resolve")
    counted = runs["truth"]["components"]
    result = resolve(load(runs["folder"] / "estimated.ledger.yaml"))
    f = result.figures
    assert f.optimizer is not None
    got = {
        "frozen_base": f.frozen_base_bytes,
        "adapter": f.adapter_bytes,
        "gradients": f.gradient_bytes,
        # AdamW's fp32 ``step`` scalars: on the host of a GPU run (not in the device figure), on the CPU here
        "optimizer": f.optimizer.device + f.optimizer.host,
    }
    assert got == counted, c.name
    assert f.optimizer.host == 4 * len(result.census.trainable)
    assert f.trainable_parameters == f.total_parameters


def test_the_method_says_which_step_ran(runs: dict[str, Any]) -> None:
    c, est = runs["case"], runs["estimated"]
    method = est.get("ledger", "activations").method or ""
    assert "transformers.Trainer step" in method
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(c.mixed_precision)
    if dtype is not None:
        assert f"{dtype} autocast" in method


def test_every_case_is_checked(cli: CliRunner) -> None:
    """The cases the issue names: bf16 base + fp32 adapters with and without bf16 autocast, fp16 autocast, QLoRA nf4
    with no preparation, PEFT's preparation and the TRL-style casts, checkpointing, accumulation 2, padded batches
    of microbatch 2, an 8-bit paged optimizer."""
    names = {c.name for c in CASES}
    assert len(CASES) >= 10 and len(names) == len(CASES)
    assert any(c.mixed_precision == "fp16" for c in CASES) and any(c.trl_casts for c in CASES)
    assert any(c.optimizer.startswith("paged") and "8bit" in c.optimizer for c in CASES)
