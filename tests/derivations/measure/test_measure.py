"""``ledgerspec measure`` / ``triage`` end to end on the CPU: child processes, write-back, status, OOM, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import Document, load
from ledgerspec.contract.edit import set_figure, set_plain
from ledgerspec.contract.writer import atomic_write, render
from tests.support import TESTS, CliRunner

pytest.importorskip("torch")
pytest.importorskip("peft")

DATA = TESTS / "data" / "measure"
pytestmark = pytest.mark.slow


def _copy_fixture(tmp: Path, name: str = "tiny-llama-lora.yaml", config: str = "tiny-llama") -> Path:
    shutil.copytree(DATA / config, tmp / config)
    target = tmp / name
    shutil.copy(DATA / name, target)
    return target


def _write(doc: Document, path: Path) -> None:
    atomic_write(path, render(doc.data, doc.text))


@pytest.fixture
def resolved(tmp_path: Path) -> Path:
    """The tiny Llama ledger, resolved, with a target device and an activation estimate: it can reach CANDIDATE."""
    from ledgerspec import resolve

    path = _copy_fixture(tmp_path)
    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("status",), "VALIDATED", force=True)  # declared too high: measure must lower it
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(
        doc,
        ("ledger", "activations"),
        1_000_000,
        "CALCULATED",
        method="test fixture: stands in for `ledgerspec estimate`",
    )
    _write(doc, path)
    return path


def _validate_json(cli: CliRunner, path: Path) -> dict[str, Any]:
    code, out, _ = cli("validate", "--format", "json", str(path))
    report: dict[str, Any] = json.loads(out)["files"][0]
    report["exit_code"] = code
    return report


def test_cpu_measurement_fills_the_measured_sections_and_never_validates(cli: CliRunner, resolved: Path) -> None:
    import peft
    import torch
    import transformers

    code, _, err = cli("measure", str(resolved), "--steps", "3")
    assert code == 0, err
    doc = load(resolved)
    phases = {
        k: doc.get("phases", k)
        for k in (
            "after_load",
            "after_adapter_injection",
            "after_optimizer_init",
            "forward_peak",
            "backward_peak",
            "optimizer_step_peak",
            "steady_state_peak",
        )
    }
    assert all(v.source == "MEASURED" and (v.size() or 0) > 0 for v in phases.values())
    peak = doc.get("metrics", "peak_allocated")
    assert peak.source == "MEASURED" and peak.size() == max(v.size() or 0 for v in phases.values())
    # the cpu backend has no caching allocator and no device: nothing invented
    assert not doc.get("metrics", "peak_reserved").present and not doc.get("metrics", "device_peak").present
    assert doc.get("metrics", "host_peak").source == "MEASURED"
    assert doc.get("measurement", "device").value == "cpu"
    assert doc.get("measurement", "steps").value == 3
    assert str(doc.get("measurement", "protocol").value).startswith("ledgerspec-measure/1")
    assert "ledgerspec measure" in str(doc.get("measurement", "command").value)
    assert doc.get("software", "torch").value == torch.__version__
    assert doc.get("software", "transformers").value == transformers.__version__
    assert doc.get("software", "peft").value == peft.__version__
    assert not doc.get("software", "cuda").present
    calc = doc.get("ledger", "calculated_subtotal").size()
    assert doc.get("comparison", "calculated_subtotal").size() == calc
    assert doc.get("comparison", "measured_peak").size() == peak.size()
    assert doc.get("comparison", "difference").size() == (peak.size() or 0) - (calc or 0)
    assert "match the calculated ones" in str(doc.get("comparison", "known_explanation").value)
    assert doc.get("result", "oom").switch() is False
    assert doc.get("ledger", "activations").source == "CALCULATED"  # a cpu run does not overwrite the estimate
    # the declared VALIDATED was lowered; the ladder stops below VALIDATED and says why
    report = _validate_json(cli, resolved)
    assert report["exit_code"] == 0, report
    assert report["supported_status"] == "CANDIDATE"
    assert report["declared_status"] == "CANDIDATE"
    assert any("measurement.device is cpu" in r for r in report["reasons"])
    assert not [f for f in report["findings"] if f["severity"] == "error"]


def test_simulated_oom_lands_in_forward_and_leaves_the_source_intact(cli: CliRunner, resolved: Path) -> None:
    before = resolved.read_bytes()
    doc = load(resolved)
    held = sum(doc.get("ledger", k).size() or 0 for k in ("frozen_base", "adapter"))  # all that exists before forward
    out = resolved.with_name("oom.yaml")
    code, _, err = cli("measure", str(resolved), "--memory-limit", str(held + 1), "-o", str(out))
    assert code == 1
    assert "simulated out-of-memory in phase forward" in err
    assert resolved.read_bytes() == before
    got = load(out)
    oom = got.get("result", "oom")
    assert oom.switch() is True and "simulated" in (oom.note or "")
    assert got.get("result", "oom_phase").value == "forward"
    assert "simulated memory limit" in str(got.get("measurement", "protocol").value)
    assert got.get("phases", "after_optimizer_init").source == "MEASURED"
    assert not got.get("phases", "forward_peak").present
    assert got.get("x-measure", "oom", "simulated").value is True
    report = _validate_json(cli, out)
    assert not [f for f in report["findings"] if f["rule"] in ("LS070", "LS080")]
    # measuring again without the limit replaces everything the failed run wrote
    code, _, err = cli("measure", str(out))
    assert code == 0, err
    again = load(out)
    assert again.get("result", "oom").switch() is False and not again.get("result", "oom_phase").present
    assert again.get("phases", "steady_state_peak").source == "MEASURED"
    assert not again.get("x-measure", "oom").present
    assert "simulated" not in str(again.get("measurement", "protocol").value)


def test_a_failure_in_the_child_leaves_the_ledger_untouched(cli: CliRunner, tmp_path: Path) -> None:
    path = _copy_fixture(tmp_path)
    text = path.read_text().replace("target_modules: [q_proj, v_proj]", "target_modules: [no_such_proj]")
    path.write_text(text)
    before = path.read_bytes()
    code, _, err = cli("measure", str(path))
    assert code != 0
    assert "'no_such_proj' matches no module" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before


def test_ctrl_c_leaves_the_ledger_untouched(tmp_path: Path) -> None:
    path = _copy_fixture(tmp_path)
    before = path.read_bytes()
    from tests.support.signals import as_a_terminal_starts_it

    proc = subprocess.Popen(
        [sys.executable, "-m", "ledgerspec", "measure", str(path), "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_terminal_starts_it,  # a test run started in the background ignores SIGINT: so would the child
    )
    time.sleep(2.0)  # the child is importing torch or measuring
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert path.read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "1"], "--steps must be >= 2"),
        (["--memory-limit", "12 XB"], "--memory-limit"),
        (["--device", "cuda", "--memory-limit", "1MiB"], "cpu backend only"),
    ],
)
def test_usage_errors_are_one_line(cli: CliRunner, tmp_path: Path, args: list[str], needle: str) -> None:
    path = _copy_fixture(tmp_path)
    before = path.read_bytes()
    code, _, err = cli("measure", str(path), *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before


def test_an_intake_is_refused(cli: CliRunner, repo_root: Path) -> None:
    code, _, err = cli("measure", str(repo_root / "examples" / "llama-2-7b-lora.intake.yaml"))
    assert code == 2 and "ledger/v1" in err and "resolve" in err


def test_cuda_without_a_gpu_is_a_clear_error(cli: CliRunner, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    path = _copy_fixture(tmp_path)
    code, _, err = cli("measure", str(path), "--device", "cuda")
    assert code == 2 and "no CUDA device" in err and "Traceback" not in err


# -- triage ---------------------------------------------------------------------------------------------------------


def test_triage_fills_the_worksheet_and_the_sensitivity_matrix(
    cli: CliRunner, resolved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each controlled measurement runs in-process here (the child boundary is tested above) to stay fast."""
    from ledgerspec.derivations.measure import measurer as m
    from ledgerspec.derivations.measure import triage as t

    monkeypatch.setattr(t, "run_child", lambda req: m.run_request(req))
    doc = load(resolved)
    held = sum(doc.get("ledger", k).size() or 0 for k in ("frozen_base", "adapter"))
    limit = held + 800_000  # above the halved runs' peaks (padded batches), below the baseline's: it runs out
    code, out, err = cli("triage", str(resolved), "--memory-limit", str(limit))
    assert code == 0, err
    assert "baseline peak" in out
    got = load(resolved)
    assert got.get("triage", "phase").value in ("forward", "loss", "backward")
    tests = {k: got.get("triage", "controlled_tests", k).value for k in t.TESTS}
    assert set(tests.values()) <= {"PASS", "FAIL"} and None not in tests.values()
    for key in ("base_residency", "activations", "gradients", "optimizer", "temporary_runtime", "allocator", "unknown"):
        assert got.get("triage", "hypothesis", key).text(), key
    matrix = got.get("x-sensitivity").value
    assert matrix["baseline"]["oom"] is True
    rows = matrix["changes"]
    for name in ("microbatch_reduced", "sequence_reduced"):
        assert rows[name]["direction"] == "down" and rows[name]["delta"] < 0, rows[name]
        assert rows[name]["components"]["activations"] < 0
        assert tests[name] == rows[name]["result"]
    assert rows["checkpointing_changed"]["change"] == "gradient checkpointing on"
    assert rows["optimizer_changed"]["change"] == "optimizer adamw_torch -> adamw_8bit"
    # the triage does not rewrite the measurement sections
    assert not got.get("phases").present


def test_triage_without_an_oom_writes_only_the_sensitivity_matrix(
    cli: CliRunner, resolved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.derivations.measure import measurer as m
    from ledgerspec.derivations.measure import triage as t

    monkeypatch.setattr(t, "run_child", lambda req: m.run_request(req))
    code, out, err = cli("triage", str(resolved))
    assert code == 0, err
    assert "no out-of-memory to triage" in out
    got = load(resolved)
    assert not got.get("triage").present  # every controlled test would "PASS": a worksheet that says nothing
    matrix = got.get("x-sensitivity").value
    assert matrix["baseline"]["oom"] is False and matrix["changes"]["microbatch_reduced"]["delta"] < 0


# -- the GPU check ----------------------------------------------------------------------------------------------------


def test_gpu_check_ledgers_are_complete_workloads(repo_root: Path) -> None:
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    cases = sorted((repo_root / "examples" / "configs" / "qwen2.5-0.5b" / "gpu-check").glob("*.yaml"))
    assert len(cases) == 4
    specs = [WorkloadSpec.from_document(load(c)) for c in cases]
    assert {s.gradient_checkpointing for s in specs} == {True, False}
    assert {s.quant is not None for s in specs} == {True, False}


def test_gpu_check_fails_clearly_without_cuda(repo_root: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
