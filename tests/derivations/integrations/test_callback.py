"""``LedgerCallback`` on a real ``transformers.Trainer`` run on the CPU records what ``measure`` measures.

Each case runs the ground truth's Trainer (``tests/truths/trainer_run.py``'s model, adapters and data: the first
step at the worst length, two more at the typical one) with the callback, in its own process
(``callback_run.py``), into a ledger that does not exist yet: the callback builds it from the live objects. The
independent side is ``ledgerspec measure --device cpu`` of a copy of that ledger: its own model, adapters and
step, built from the ledger alone. ``tests/derivations/engine/test_trainer_truth.py`` shows that ``measure`` is the
real Trainer's step to the byte, less the micro-batch the CPU DataLoader holds ahead; the callback finds that batch
itself and leaves it out, so here every phase must be equal to the byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from ledgerspec.contract.document import load
from tests.support import DATA, REPO_ROOT, fresh_python, run_cli
from tests.truths.trainer_run import default_case

pytestmark = pytest.mark.slow

PHASES = (
    "after_load",
    "after_adapter_injection",
    "after_optimizer_init",
    "forward_peak",
    "backward_peak",
    "optimizer_step_peak",
    "steady_state_peak",
)


def case(arch: str = "tiny-llama", **over: Any) -> dict[str, Any]:
    return default_case(arch, **over)


QLORA = {"type": "nf4", "double_quant": True, "compute_dtype": "bfloat16", "storage_dtype": "uint8"}
CASES = {
    "lora": case(),
    "qlora-prepared-bf16-accumulation-2": case(
        "tiny-qwen2", quant=QLORA, prepare_kbit=True, mixed_precision="bf16", accumulation=2, microbatch=1
    ),
    "checkpointing-paged-adamw-8bit": case(
        mixed_precision="bf16", gradient_checkpointing=True, optimizer="paged_adamw_8bit"
    ),
    # full fine-tuning (issue 26): no PEFT wrapper, every parameter trained
    "full-fine-tuning": case(full=True),
}


def run_trainer(
    folder: Path, c: dict[str, Any], ledger: Path | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The Trainer with the callback, in a fresh process (``env``: more environment variables); what ``train()``
    raised and the callback's failure."""
    arch = c["config"]
    if not (folder / arch).exists():
        shutil.copytree(DATA / "measure" / arch, folder / arch)
    c = {**c, "config": str(folder / arch)}
    case_file, out_file = folder / "case.json", folder / "out.json"
    case_file.write_text(json.dumps(c), encoding="utf-8")
    ledger = ledger or folder / "run.ledger.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = fresh_python(
        ["-m", "tests.derivations.integrations.callback_run", case_file, ledger, out_file], env, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(out_file.read_text(encoding="utf-8"))
    out["stderr"] = proc.stderr
    return out


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, id=name, marks=pytest.mark.xdist_group(f"callback-{name}")) for name in CASES],
)
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # under xdist the worker may interleave the cases' tests, which tears a module fixture down and sets it up
    # again: each case's run is made once per worker
    if request.param in _RECORDED:
        return _RECORDED[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    out = run_trainer(folder, {**CASES[request.param], "count": True})
    assert out["raised"] is None and out["failure"] is None, out
    measured = folder / "measured.ledger.yaml"
    shutil.copy(folder / "run.ledger.yaml", measured)
    code, _, err = run_cli("measure", str(measured), "--device", "cpu")
    assert code == 0, err
    _RECORDED[request.param] = {
        "callback": load(str(folder / "run.ledger.yaml")),
        "measure": load(str(measured)),
        "folder": folder,
        "counted": out["components"],
    }
    return _RECORDED[request.param]


_RECORDED: dict[str, dict[str, Any]] = {}


def test_the_callback_ledger_validates(recorded: dict[str, Any]) -> None:
    code, out, err = run_cli("validate", str(recorded["folder"] / "run.ledger.yaml"))
    assert code == 0, out + err
    assert "error" not in (out + err).lower()


def test_every_phase_equals_measure_cpu_to_the_byte(recorded: dict[str, Any]) -> None:
    cb, ms = recorded["callback"], recorded["measure"]
    got = {p: cb.get("phases", p).value for p in PHASES}
    want = {p: ms.get("phases", p).value for p in PHASES}
    assert got == want
    assert all(cb.get("phases", p).effective_source(True) == "MEASURED" for p in PHASES)
    assert cb.get("metrics", "peak_allocated").value == ms.get("metrics", "peak_allocated").value


COMPONENTS = ("frozen_base", "adapter", "gradients", "optimizer")


def test_the_components_are_the_live_tensors_counted(recorded: dict[str, Any]) -> None:
    """``ledger.frozen_base``, ``adapter``, ``gradients``, ``optimizer`` MEASURED: the bytes the truth's
    ``component_counter`` counts in the same run's tensors (numel x element size; the optimizer after its first step,
    the gradients before ``zero_grad``)."""
    cb = recorded["callback"]
    assert {k: cb.get("ledger", k).value for k in COMPONENTS} == recorded["counted"]
    assert all(cb.get("ledger", k).effective_source(True) == "MEASURED" for k in COMPONENTS)


def test_the_ledger_records_versions_device_and_what_was_seen(recorded: dict[str, Any]) -> None:
    import torch
    import transformers

    cb = recorded["callback"]
    assert cb.get("software", "torch").value == torch.__version__
    assert cb.get("software", "transformers").value == transformers.__version__
    assert cb.get("measurement", "device").value == "cpu"
    assert "LedgerCallback" in cb.get("measurement", "command").value
    seen = cb.get("x-callback").value
    assert seen["steps_seen"] == 3 and seen["sequence_lengths"] == [64, 32, 32]
    # the CPU DataLoader held the next micro-batch during the first two steps (int64 ids, mask, labels)
    mb = cb.get("workload", "microbatch").value
    assert seen["batch_held_ahead"][:2] == [3 * 8 * mb * 32] * 2


def test_a_simulated_out_of_memory_records_its_phase(tmp_path: Path) -> None:
    """``memory_limit`` (as ``measure --memory-limit``): the run's first forward goes over it; the ledger says so
    before the exception reaches the user's script, with the phase ``measure`` gives for the same limit."""
    limit = 600_000
    out = run_trainer(tmp_path, {**case(), "callback": {"memory_limit": limit}})
    assert out["raised"] is not None and "simulated out of memory" in out["raised"]
    doc = load(str(tmp_path / "run.ledger.yaml"))
    assert doc.get("result", "oom").value is True
    shutil.copy(tmp_path / "run.ledger.yaml", tmp_path / "m.ledger.yaml")
    code, _, err = run_cli("measure", str(tmp_path / "m.ledger.yaml"), "--device", "cpu", "--memory-limit", str(limit))
    assert code == 1, err
    ms = load(str(tmp_path / "m.ledger.yaml"))
    assert doc.get("result", "oom_phase").value == ms.get("result", "oom_phase").value == "forward"
    assert doc.get("phases", "after_optimizer_init").value == ms.get("phases", "after_optimizer_init").value


def test_a_crashed_run_is_reported_and_nothing_is_written(tmp_path: Path) -> None:
    out = run_trainer(tmp_path, {**case(), "break": "optimizer"})
    assert out["raised"] == "RuntimeError: a bug in the user's optimizer"  # the user's error, unchanged
    assert "the run failed in phase optimizer_step" in out["failure"]
    assert not (tmp_path / "run.ledger.yaml").exists()
    assert "LedgerCallback" in out["stderr"] and "training goes on" in out["stderr"]


def test_an_unwritable_path_never_breaks_training(tmp_path: Path) -> None:
    (tmp_path / "blocked").write_text("a file, not a folder", encoding="utf-8")
    ledger = tmp_path / "blocked" / "run.ledger.yaml"
    out = run_trainer(tmp_path, case(), ledger)
    assert out["raised"] is None and out["steps"] == 3
    assert "cannot create the folder" in out["failure"]
    strict = run_trainer(tmp_path, {**case(), "callback": {"strict": True}}, ledger)
    assert strict["raised"] is not None and strict["raised"].startswith("CallbackFailure")


def test_a_full_fine_tune_is_recorded_as_one(recorded: dict[str, Any]) -> None:
    """No PEFT adapters (issue 26): the callback writes ``method.kind: full`` and every parameter as trained."""
    cb = recorded["callback"]
    if cb.get("method", "kind").value != "full":
        pytest.skip("the full fine-tuning case")
    assert not cb.get("method", "rank").present and not cb.get("adapter", "dtype").present
    assert cb.get("ledger", "adapter").value > 100 * cb.get("ledger", "frozen_base").value  # buffers only frozen


def test_two_ddp_ranks_on_gloo_are_gathered_by_rank_0(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2`` on the CPU (gloo; the Trainer wraps the model in DDP): every rank measures
    itself, rank 0 gathers and writes the worst rank per phase and ``parallelism.per_rank_peak``. The independent
    side: ``measure --device cpu`` of the same ledger (one process): DDP replicates the model, so the held phases
    are equal on every rank, and rank 0's first forward (the two rows at the worst length) is the measured one."""
    from ledgerspec.derivations.measure import launch
    from ledgerspec.derivations.measure.dist import free_port

    arch = "tiny-llama"
    shutil.copytree(DATA / "measure" / arch, tmp_path / arch)
    c = {**case(), "config": str(tmp_path / arch)}
    case_file, ledger, out_file = tmp_path / "case.json", tmp_path / "run.ledger.yaml", tmp_path / "out.json"
    case_file.write_text(json.dumps(c), encoding="utf-8")
    run = ["-m", "tests.derivations.integrations.callback_run", str(case_file), str(ledger), str(out_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    code, stderr = launch.run_ranks(run, 2, env, free_port(), timeout=600)  # as torchrun --nproc_per_node 2
    assert code == 0, stderr[-3000:]
    for name in ("out.json", "out.json.rank1"):
        out = json.loads((tmp_path / name).read_text(encoding="utf-8"))
        assert out["raised"] is None and out["failure"] is None and out["steps"] == 3, out
    doc = load(str(ledger))
    per_rank = doc.get("x-callback-per-rank").value
    assert per_rank["world_size"] == 2 and per_rank["ranks_reported"] == [0, 1]
    peaks = doc.get("parallelism", "per_rank_peak").value
    assert [p["source"] for p in peaks] == ["MEASURED", "MEASURED"]
    assert [p["value"] for p in peaks] == [r["peak_allocated"] for r in per_rank["ranks"]]
    assert doc.get("metrics", "peak_allocated").value == max(p["value"] for p in peaks)  # the worst rank, not a sum
    assert doc.get("parallelism", "gpu_count").value == 2 and doc.get("parallelism", "strategy").value == "ddp"
    code, out_text, err = run_cli("validate", str(ledger))
    assert code == 0, out_text + err
    shutil.copy(ledger, tmp_path / "m.ledger.yaml")
    code, _, err = run_cli("measure", str(tmp_path / "m.ledger.yaml"), "--device", "cpu")
    assert code == 0, err
    ms = load(str(tmp_path / "m.ledger.yaml"))
    rank0, rank1 = (r["phases"] for r in per_rank["ranks"])
    for phase in ("after_load", "after_adapter_injection", "after_optimizer_init"):
        assert rank0[phase] == rank1[phase] == ms.get("phases", phase).value, phase
    assert rank0["forward_peak"] == ms.get("phases", "forward_peak").value


LEDGER = """ledgerspec: ledger/v1
# my notes: the run of Tuesday (a comment the write-back keeps)
title: tiny llama, written by hand
identity: {model_id: tests/tiny-llama, config_sha256: UNKNOWN, config_path: tiny-llama/config.json}
software: {attention_implementation: sdpa}
method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj], bias: none}
base_model: {loaded_dtype: bfloat16, quantized: false}
adapter: {dtype: float32}
workload: {max_length: 64, sequence_p50: 32, packing: false, microbatch: 2, gradient_accumulation: 2}
training: {loop: trainer, mixed_precision: "no", max_grad_norm: 1.0}
optimizer: {name: adamw_torch}
memory_options: {gradient_checkpointing: false, checkpointing_kind: non-reentrant}
"""


def test_an_existing_ledger_keeps_its_configuration_and_replaced_figures_are_said(tmp_path: Path) -> None:
    """A hand-written ledger measured by ``measure`` (MEASURED figures of another run), then a run whose first
    forward goes over a simulated limit: the callback says which MEASURED figures it replaces or removes, and
    where the declared configuration differs from the run (gradient_accumulation 2 declared, 1 run); the
    configuration, the title and the user's comment stay."""
    shutil.copytree(DATA / "measure" / "tiny-llama", tmp_path / "tiny-llama")
    ledger = tmp_path / "run.ledger.yaml"
    ledger.write_text(LEDGER, encoding="utf-8")
    code, _, err = run_cli("measure", str(ledger), "--device", "cpu")
    assert code == 0, err
    before = load(str(ledger)).get("phases", "forward_peak").value
    out = run_trainer(tmp_path, {**case(), "callback": {"memory_limit": 600_000}}, ledger)
    assert out["raised"] is not None and "simulated out of memory" in out["raised"]
    err = out["stderr"]
    assert "replaces the MEASURED figures of an earlier measurement (ledgerspec measure" in err
    assert f"forward_peak {before} B -> not measured by this run (removed)" in err
    assert "workload.gradient_accumulation: declared 2, the run has 1" in err
    text = ledger.read_text(encoding="utf-8")
    assert "# my notes: the run of Tuesday" in text and "title: tiny llama, written by hand" in text
    doc = load(str(ledger))
    assert doc.get("workload", "gradient_accumulation").value == 2  # the declared configuration is the user's
    assert doc.get("result", "oom").value is True and doc.get("result", "oom_phase").value == "forward"
    assert doc.get("phases", "forward_peak").present is False
    assert doc.get("x-callback").value["declared_vs_run"] == [
        "workload.gradient_accumulation: declared 2, the run has 1"
    ]


def test_save_every_writes_during_the_run(tmp_path: Path) -> None:
    """``save_every=1``: the ledger is written after each step, so a run that crashes at its second optimizer
    step leaves the first step's figures (the crash itself writes nothing)."""
    out = run_trainer(tmp_path, {**case(), "break": "optimizer", "break_at": 2, "callback": {"save_every": 1}})
    assert out["raised"] == "RuntimeError: a bug in the user's optimizer"
    assert "the run failed in phase optimizer_step" in out["failure"]
    doc = load(str(tmp_path / "run.ledger.yaml"))
    assert doc.get("x-callback").value["written_at"] == "every" and doc.get("x-callback").value["steps_seen"] == 1
    assert doc.get("phases", "optimizer_step_peak").known and not doc.get("phases", "steady_state_peak").present


HUB = {"repo": "tests/tiny-llama", "commit": "3f2c9a1e8b7d6c5f4e3d2c1b0a9f8e7d6c5b4a39"}


def _hub_env(folder: Path) -> dict[str, str]:
    """The Hugging Face cache the run loads the model from (the truth's ``_model`` puts it there), offline."""
    return {"HF_HUB_CACHE": str(folder / "hf-cache"), "HF_HUB_OFFLINE": "1"}


def test_a_hub_model_s_ledger_is_calculated_by_itself(tmp_path: Path) -> None:
    """A model loaded by repository id from the Hugging Face cache (``from_pretrained("tests/tiny-llama")``, as a
    downloaded model loads): the callback's own ledger names the repository and the commit of the snapshot it was
    loaded from, and its component figures are the run's tensors counted, so it is CALCULATED with no
    ``ledgerspec resolve`` (the status ``validate`` computes, not only the one the callback declared)."""
    out = run_trainer(tmp_path, {**case(), "hub": HUB, "count": True}, env=_hub_env(tmp_path))
    assert out["raised"] is None and out["failure"] is None, out
    ledger = tmp_path / "run.ledger.yaml"
    doc = load(str(ledger))
    assert doc.get("identity", "model_id").value == HUB["repo"]
    assert doc.get("identity", "revision").value == HUB["commit"]
    assert {k: doc.get("ledger", k).value for k in COMPONENTS} == out["components"]
    code, text, err = run_cli("validate", "--format", "json", str(ledger))
    assert code == 0, text + err
    assert json.loads(text)["files"][0]["supported_status"] == "CALCULATED"
    assert doc.get("status").value == "CALCULATED"


def test_an_existing_ledger_gets_the_live_identity_where_it_declares_none(tmp_path: Path) -> None:
    """A hand-written ledger without a model id that pins another commit: the callback fills the model id from the
    live model and reports the commit it declares next to the one the run loaded (the declared one stays)."""
    shutil.copytree(DATA / "measure" / "tiny-llama", tmp_path / "tiny-llama")
    declared = "0" * 40
    ledger = tmp_path / "run.ledger.yaml"
    ledger.write_text(LEDGER.replace("model_id: tests/tiny-llama", f"revision: '{declared}'"), encoding="utf-8")
    out = run_trainer(tmp_path, {**case(), "hub": HUB}, ledger, env=_hub_env(tmp_path))
    assert out["raised"] is None and out["failure"] is None, out
    doc = load(str(ledger))
    assert doc.get("identity", "model_id").value == HUB["repo"]
    assert doc.get("identity", "revision").value == declared
    differences = doc.get("x-callback").value["declared_vs_run"]
    assert f"identity.revision: declared {declared!r}, the run has {HUB['commit']!r}" in differences
