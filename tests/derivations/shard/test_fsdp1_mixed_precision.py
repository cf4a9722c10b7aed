"""FSDP1 ``MixedPrecision`` (``parallelism.mixed_precision_policy``, ``strategy: fsdp1``) per rank (issue 16 item 2).

Two findings of the last session, here with their ground truths:

1. Without autocast, ``MixedPrecision(param_dtype=bfloat16)`` over float32 adapters fails in every real FSDP1 run at
   the first LoRA forward (PEFT casts the input to the adapter's dtype read outside its own FSDP1 unit, the unit
   computes in bfloat16 and does not cast its input: ``ledgerspec.contract.fsdp1_precision`` cites the lines). The
   truth: ``tests/truths/fsdp1_mixed_precision_probe.py`` (torch, PEFT and transformers only, under torchrun, gloo).
   ``validate`` reports it (LS061), ``shard --estimate`` and ``measure --nproc`` refuse it in one line, exit 2.
2. The ``CheckpointError`` of ``shard --estimate`` with checkpointing was the simulated side of the same step: the
   meta kernel of ``mm`` does not check dtypes, so the fake step went on in float32, and non-reentrant checkpointing's
   recomputation, seeing the LoRA unit already gathered in bfloat16 (backward/forward prefetch, ``SHARD_GRAD_OP``),
   skipped PEFT's cast and got tensors of another dtype. Refused now, with the refusal above.

Every combination that does run for real on the CPU (autocast; or no autocast with adapters already in
``param_dtype``), with reentrant and non-reentrant checkpointing: ``measure --nproc 2`` (a real FSDP1 run per rank,
torchrun, gloo) against ``shard --estimate``. Observed alone on the machine: every phase of both ranks equal to the
byte, every case (steady-state peaks beside ``RUNS``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, run_cli
from tests.support.per_rank import assert_rank_agrees, measured, run_probe

DATA = TESTS / "data" / "sharding"
PROBE = TESTS / "truths" / "fsdp1_mixed_precision_probe.py"
AUTOCAST = "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: bf16\n"


def _ledger(
    tmp: Path,
    *,
    checkpointing: str | None = "non-reentrant",
    loaded: str = "float32",
    adapter: str = "float32",
    autocast: bool = True,
    options: str = "",
    shard_grad_op: bool = False,
    name: str = "fsdp1-mp.ledger.yaml",
) -> Path:
    """tiny-lora-measure.ledger.yaml under FSDP1 with ``MixedPrecision(param_dtype=bfloat16)``."""
    if not (tmp / "tiny").exists():
        shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    edits = [
        ("  strategy: fsdp2\n", f"  strategy: fsdp1\n  mixed_precision_policy: {{param_dtype: bfloat16}}\n{options}"),
        ("  loaded_dtype: float32\n", f"  loaded_dtype: {loaded}\n"),
        ("adapter:\n  dtype: float32\n", f"adapter:\n  dtype: {adapter}\n"),
    ]
    if checkpointing:
        edits.append(
            (
                "  gradient_checkpointing: false\n",
                f"  gradient_checkpointing: true\n  checkpointing_kind: {checkpointing}\n",
            )
        )
    if autocast:
        edits.append(("optimizer:\n  name: adamw_torch\n", AUTOCAST))
    if shard_grad_op:
        edits.append(("  reshard_after_forward: true\n", "  reshard_after_forward: false\n"))
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


# -- 1. the configuration no real run survives ---------------------------------------------------------------------

#: the refused configuration with each checkpointing that made the simulation fail or pass silently before
REFUSED: dict[str, dict[str, Any]] = {
    "no-checkpointing": {"checkpointing": None},
    "reentrant": {"checkpointing": "reentrant"},
    "non-reentrant": {"checkpointing": "non-reentrant"},
    "non-reentrant-backward_pre": {"options": "  backward_prefetch: backward_pre\n"},  # was: CheckpointError
    "non-reentrant-shard_grad_op": {"shard_grad_op": True},  # was: CheckpointError
    "bf16-base": {"loaded": "bfloat16"},
}


@pytest.mark.parametrize("command", ["shard --estimate", "measure --nproc 2"])
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_in_one_line_before_anything_runs(tmp_path: Path, command: str, kind: str) -> None:
    pytest.importorskip("torch")
    path = _ledger(tmp_path, autocast=False, **REFUSED[kind])
    before = path.read_bytes()
    code, _, err = run_cli(*command.split()[:1], path, *command.split()[1:])
    at = before.decode().splitlines().index("  mixed_precision_policy: {param_dtype: bfloat16}") + 1
    rule = command.split()[0]
    assert code == 2, err
    assert f"{path.name}:{at}:" in err, err
    assert f": {rule}: FSDP1 MixedPrecision(param_dtype=bfloat16) without autocast fails at the first forward" in err
    assert "(hint: add training.mixed_precision: bf16" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "CheckpointError" not in err, err
    assert path.read_bytes() == before


def test_validate_reports_it(tmp_path: Path) -> None:
    """A pure document check: ``validate`` says so (LS061, an error, at the policy's ``param_dtype``)."""
    path = _ledger(tmp_path, autocast=False)
    code, out, _ = run_cli("validate", path)
    at = path.read_text(encoding="utf-8").splitlines().index("  mixed_precision_policy: {param_dtype: bfloat16}") + 1
    assert code == 1 and f"{path.name}:{at}:" in out and "LS061" in out, out
    code, out, _ = run_cli("validate", _ledger(tmp_path, autocast=True, name="autocast.ledger.yaml"))
    assert "LS061" not in out, out


@pytest.mark.slow
def test_plain_shard_still_calculates(tmp_path: Path) -> None:
    """``shard`` without ``--estimate`` runs no step: it still writes the calculated per-rank state."""
    pytest.importorskip("torch")
    path = _ledger(tmp_path, autocast=False)
    code, _, err = run_cli("shard", path)
    assert code == 0, err
    assert "x-per-rank" in load(path).plain["parallelism"]


def _probe(tmp: Path, *args: str) -> dict[str, str | bool]:
    out = tmp / "probe.json"
    run_probe(PROBE, 2, DATA / "tiny", out, *args, timeout=240)
    result: dict[str, str | bool] = json.loads(out.read_text(encoding="utf-8"))
    return result


#: (probe arguments, the matching ledger's options): whether a real FSDP1 run survives its first micro-step
PROBED: dict[str, tuple[list[str], dict[str, Any]]] = {
    "fp32-adapters-no-autocast": ([], {"autocast": False}),
    "fp32-adapters-no-autocast-non-reentrant": (["--checkpointing", "non-reentrant"], {"autocast": False}),
    "fp32-adapters-autocast": (["--autocast", "bfloat16"], {"autocast": True}),
    "bf16-adapters-no-autocast": (["--adapter-dtype", "bfloat16"], {"autocast": False, "adapter": "bfloat16"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PROBED))
def test_the_refusal_is_exactly_where_real_fsdp1_fails(tmp_path: Path, case: str) -> None:
    """The truth (a real FSDP1 + PEFT micro-step, no ledgerspec code) fails exactly where the document check says so:
    in ``F.linear`` (``torch/nn/modules/linear.py``) with float32 input and bfloat16 weight; with autocast or
    bfloat16 adapters it runs, and the check stays quiet."""
    pytest.importorskip("peft")
    from ledgerspec.contract.fsdp1_precision import lora_input_dtype_conflict

    args, options = PROBED[case]
    real = _probe(tmp_path, *args)
    conflict = lora_input_dtype_conflict(load(_ledger(tmp_path, **options)))
    assert real["ok"] is (conflict is None), real
    if not real["ok"]:
        assert real["error"] == "RuntimeError" and str(real["where"]).endswith(
            os.path.join("torch", "nn", "modules", "linear.py") + ":134"
        ), real
        assert "same dtype" in str(real["message"]) and "BFloat16" in str(real["message"]), real


# -- 2. what runs for real: simulated == measured, per rank ----------------------------------------------------------

#: configurations that run for real on the CPU (gloo). Observed alone on the machine, simulated == measured on both
#: ranks in every phase; steady-state peaks: 1,425,550 B (both bf16-base cases), 1,944,102 B (SHARD_GRAD_OP),
#: 1,805,350 B (BACKWARD_PRE), 1,656,116 B (both bf16-adapter cases)
RUNS: dict[str, dict[str, Any]] = {
    "autocast-reentrant-bf16-base": {"checkpointing": "reentrant", "loaded": "bfloat16"},
    "autocast-non-reentrant-bf16-base": {"loaded": "bfloat16"},
    "autocast-non-reentrant-shard_grad_op": {"shard_grad_op": True},
    "autocast-non-reentrant-backward_pre": {"options": "  backward_prefetch: backward_pre\n"},
    "bf16-adapters-no-autocast-non-reentrant": {"autocast": False, "adapter": "bfloat16"},
    "bf16-adapters-no-autocast-reentrant": {"autocast": False, "adapter": "bfloat16", "checkpointing": "reentrant"},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(RUNS))
def test_simulated_ranks_agree_with_the_real_fsdp1_mixed_precision_run(tmp_path: Path, kind: str) -> None:
    """``measure --nproc 2`` (real FSDP1 with the declared ``MixedPrecision``, torchrun, gloo) against ``shard
    --estimate`` and the calculated state: model-state phases and components to the byte, compute phases a lower
    bound at most two gathered layer units under the measurement (gloo's collective thread, as in test_fsdp1.py)."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    options = RUNS[kind]
    path = _ledger(tmp_path, **options)
    doc = measured(path, 2)
    plan = S.fsdp1(
        S.peft_fsdp1_units(document_descriptors(doc)),
        2,
        reshard_after_forward=not options.get("shard_grad_op"),
        param_dtype="bfloat16",
    )
    unit = max(v for k, v in plan.unit_unsharded.items() if k != S.ROOT)
    estimated = shard(load(path), estimate=True, target="cpu").estimate
    assert estimated is not None
    for real, est, calc in zip(doc.plain["x-measure-per-rank"]["ranks"], estimated.ranks, plan.ranks, strict=True):
        assert_rank_agrees(real, est, calc, unit)
