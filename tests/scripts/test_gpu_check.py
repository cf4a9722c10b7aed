"""``scripts/gpu-check`` (the GPU run, prepared here and run on a machine with a GPU): its dry run, its skips, its
report, its wheel install; without torch.cuda or a GPU."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script
from tests.support.fake_cuda import (
    CONTEXT,
    WORST,
    FakeCuda,
    FakeNVML,
    MiB,
    act_bytes,
    cuda_output,
    expected_phases,
    ids_bytes,
    logits_bytes,
    resolved_ledger,
    roundup,
)


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The tiny Llama ledger, resolved (CPU), with a target device and an activation estimate."""
    return resolved_ledger(tmp_path)


# -- scripts/gpu-check -------------------------------------------------------------------------------------------------

SCRIPT = REPO_ROOT / "scripts" / "gpu-check"


def _script() -> Any:
    return load_script(SCRIPT, "gpu_check_under_test")


def test_gpu_check_dry_run_needs_neither_torch_nor_cuda(tmp_path: Path) -> None:
    import subprocess

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('the dry run must not import torch')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in ("lora-gc-off.yaml", "lora-gc-on.yaml", "qlora-gc-off-eager.yaml", "qlora-gc-on.yaml"):
        assert f"  {name}:" in out
        assert (
            f"ledgerspec measure {SCRIPT.parent.parent}/benchmarks/results/gpu-check/{name} --device cuda "
            f"--steps 3" in out
        )
    assert "needs bitsandbytes: QLoRA" in out
    assert "Traceback" not in proc.stderr


def test_gpu_check_dry_run_says_which_rows_it_would_skip_without_bitsandbytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    monkeypatch.setattr(mod, "WHEELS", tmp_path / "no-wheels")
    plan = mod.plan(sorted(mod.CASES.glob("*.yaml")))
    lines = {
        line.split(":")[0].strip(): line for line in plan.splitlines() if line.startswith("  ") and ".yaml:" in line
    }
    assert lines["qlora-gc-on.yaml"].split(": ", 1)[1].startswith("SKIP: needs bitsandbytes")
    assert lines["lora-gc-on.yaml"].endswith(": run")
    assert "bitsandbytes: MISSING (optional)" in plan


def test_gpu_check_skips_the_bitsandbytes_rows_with_a_note_and_writes_one_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plumbing of the script's main loop, every GPU-touching step faked: no real measurement happens here."""
    import torch

    mod = _script()
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "ensure_packages", lambda: {"bitsandbytes"})
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mod, "WORK", tmp_path / "results" / "gpu-check")
    monkeypatch.setattr(mod, "header", lambda missing: f"# gpu-check (faked header; missing {sorted(missing)})")
    monkeypatch.setattr(mod, "device_memory", lambda: "85520809984")  # an H100's total
    monkeypatch.setattr(mod, "estimated_activations", lambda path: None)

    def cli(*args: str) -> tuple[int, str]:
        ran.append(args)
        return 0, ""

    def row(path: Path, est: int | None) -> dict[str, Any]:
        comps = {k: (MiB, MiB) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")}
        return {
            "name": path.stem,
            "comps": comps,
            "phases": dict.fromkeys(mod.PHASES, MiB),
            "allocated": 3 * MiB,
            "reserved": 4 * MiB,
            "device": 5 * MiB,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": 2 * MiB,
            "device_source": "fake",
        }

    monkeypatch.setattr(mod, "cli", cli)
    monkeypatch.setattr(mod, "row", row)
    callback_runs: list[bool] = []  # the LedgerCallback check (benchmarks/callback_overhead.py) needs a real GPU

    def callback_check() -> list[str]:
        callback_runs.append(True)
        return []

    monkeypatch.setattr(mod, "callback_check", callback_check)
    assert mod.main([]) == 0
    assert callback_runs == [True]
    measured = {Path(a[1]).name for a in ran if a[0] == "measure"}
    assert measured == {"lora-gc-off.yaml", "lora-gc-on.yaml"}
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert report.strip() == capsys.readouterr().out.strip()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert table[0] == "| MiB (calculated / measured) | lora-gc-off | lora-gc-on |"
    assert len([line for line in report.splitlines() if line.startswith("| MiB")]) == 1  # one table
    assert any(line.startswith("| **peak reserved** | 4.0 | 4.0 |") for line in table)
    assert "qlora-gc-on.yaml: skipped, it needs bitsandbytes for QLoRA" in report


def _script_main_faked(mod: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake every GPU-touching step of the script's main loop (the plumbing tests below)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "ensure_packages", lambda: set())
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mod, "WORK", tmp_path / "results" / "gpu-check")
    monkeypatch.setattr(mod, "header", lambda missing: "# gpu-check (faked header)")
    monkeypatch.setattr(mod, "device_memory", lambda: "85520809984")  # an H100's total
    monkeypatch.setattr(mod, "estimated_activations", lambda path: None)


def test_gpu_check_reads_its_table_column_from_a_ledger_measured_on_cuda(
    ledger: Path, fake_cuda: FakeCuda, fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script's row() on what `measure --device cuda` writes (the fake run, written back and saved)."""
    from ledgerspec.contract.document import load
    from ledgerspec.contract.writer import save
    from ledgerspec.derivations.measure.measurer import write_back

    mod = _script()
    doc = load(ledger)
    calculated = {k: doc.get("ledger", k).size() for k in ("frozen_base", "adapter", "gradients", "optimizer")}
    write_back(doc, cuda_output(fake_cuda, monkeypatch), "ledgerspec measure --device cuda")
    save(doc, str(ledger))
    r = mod.row(ledger, 1_000_000)
    exp = expected_phases()
    top = roundup(max(exp.values()))
    assert r["phases"] == exp
    assert (r["allocated"], r["reserved"], r["device"]) == (max(exp.values()), top, CONTEXT + top)
    assert r["oom"] is False and r["status"] == "CANDIDATE"
    assert {k: r["comps"][k][0] for k in calculated} == calculated  # the calculated side: the resolver's figures
    assert r["comps"]["activations"] == (1_000_000, ids_bytes(WORST) + act_bytes(WORST) + logits_bytes(WORST))
    assert r["device_source"].startswith("NVML per-process")
    table = mod.table([r])
    assert f"| **device peak** | {(CONTEXT + top) / MiB:,.1f} |" in table
    assert f"| phase backward_peak | {exp['backward_peak'] / MiB:,.1f} |" in table
    # the device-level prediction against what was measured (the ledger holds none here: a dash, not a guess)
    assert "| estimate error vs reserved | - |" in table and "| estimate error vs device peak | - |" in table
    predicted = {**r, "estimate_reserved": top + top // 10, "estimate_device": CONTEXT + top - (CONTEXT + top) // 20}
    table = mod.table([predicted])
    assert f"| estimate peak reserved (allocator model) | {(top + top // 10) / MiB:,.1f} |" in table
    assert "| estimate error vs reserved | +10.0% |" in table and "| estimate error vs device peak | -5.0% |" in table


def test_gpu_check_predicts_for_the_lent_card_itself() -> None:
    """The estimate's target is the card the check runs on (its total, by which the device catalogue names it), not
    a fixed size: the dry run's plan says so, with no CUDA."""
    mod = _script()
    estimate = [c for c in mod.commands(Path("x.ledger.yaml"), True, "85520809984") if c[0] == "estimate"]
    assert estimate == [("estimate", "x.ledger.yaml", "--device-memory", "85520809984")]
    assert mod.DEVICE_MEMORY in " ".join(mod.commands(Path("x.ledger.yaml"), True)[1])


def test_gpu_check_installs_carried_wheels_exactly_as_the_device_readme_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    for name in ("ruamel_yaml-0.19.1-py3-none-any.whl", "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"):
        (wheels / name).write_bytes(b"")
    monkeypatch.setattr(mod, "WHEELS", wheels)
    monkeypatch.setattr(mod, "ROOT", Path("/repo"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/repo")
    installed: set[str] = set()
    ran: list[list[str]] = []

    def run(cmd: list[str], check: bool = False) -> Any:
        ran.append(cmd)
        installed.update({"ruamel.yaml", "bitsandbytes"})
        return types.SimpleNamespace(returncode=0)

    present = {"jsonschema", "transformers", "peft", "accelerate", "pynvml"}
    monkeypatch.setattr(mod, "importable", lambda module: module in present | installed)
    monkeypatch.setattr(mod.subprocess, "run", run)
    assert mod.ensure_packages() == set()
    assert ran == [
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            "/tmp/site",
            *sorted(map(str, wheels.glob("*.whl"))),
        ]
    ]
    # the measure children find the project first, then the carried packages
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/repo", "/tmp/site"])
    assert "/tmp/site" in sys.path


def test_gpu_check_without_wheels_fails_on_a_required_package_and_skips_an_optional_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _script()
    monkeypatch.setattr(mod, "WHEELS", tmp_path / "none")
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: pytest.fail("nothing to install"))
    monkeypatch.setattr(mod, "importable", lambda module: module != "bitsandbytes")
    assert mod.ensure_packages() == {"bitsandbytes"}
    monkeypatch.setattr(mod, "importable", lambda module: module != "jsonschema")
    with pytest.raises(SystemExit) as exc:
        mod.ensure_packages()
    assert exc.value.code == 2


def test_gpu_check_keeps_measuring_when_a_command_raises_and_logs_its_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With LEDGERSPEC_DEBUG=1 the CLI re-raises: one configuration's failure must not lose the others."""
    import ledgerspec.faces.cli as cli_module

    mod = _script()
    _script_main_faked(mod, monkeypatch, tmp_path)

    def main(args: list[str]) -> int:
        if args[0] == "measure" and Path(args[1]).name == "lora-gc-off.yaml":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 0

    monkeypatch.setattr(cli_module, "main", main)
    monkeypatch.setattr(
        mod,
        "row",
        lambda path, est: {
            "name": path.stem,
            "comps": {k: (MiB, MiB) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")},
            "phases": dict.fromkeys(mod.PHASES, MiB),
            "allocated": MiB,
            "reserved": MiB,
            "device": MiB,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": MiB,
            "device_source": None,
        },
    )
    assert mod.main([str(mod.CASES / "lora-gc-off.yaml"), str(mod.CASES / "lora-gc-on.yaml")]) == 1
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert "| MiB (calculated / measured) | lora-gc-on |" in report  # the second configuration still ran
    assert "lora-gc-off.yaml: `ledgerspec measure" in report and "exited 3" in report
    log = (tmp_path / "results" / "gpu-check" / "lora-gc-off.log").read_text()
    assert "Traceback" in log and "illegal memory access" in log and "$ ledgerspec resolve" in log
    assert "Not run yet" not in report


def test_gpu_check_rewrites_its_report_after_each_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run cut short (a device-time limit) keeps the rows measured so far, and says what did not run."""
    mod = _script()
    _script_main_faked(mod, monkeypatch, tmp_path)
    monkeypatch.setattr(mod, "cli", lambda *args: (0, ""))
    seen: list[str] = []

    def row(path: Path, est: int | None) -> dict[str, Any]:
        report = tmp_path / "results" / "gpu-check.md"
        seen.append(report.read_text() if report.exists() else "")
        if path.stem == "lora-gc-on":
            raise KeyboardInterrupt  # cut short while the second configuration is read
        return {
            "name": path.stem,
            "comps": {k: (None, None) for k in ("frozen_base", "adapter", "gradients", "optimizer", "activations")},
            "phases": dict.fromkeys(mod.PHASES),
            "allocated": 7 * MiB,
            "reserved": None,
            "device": None,
            "estimate": None,
            "oom": False,
            "status": "CANDIDATE",
            "subtotal": None,
            "device_source": None,
        }

    monkeypatch.setattr(mod, "row", row)
    with pytest.raises(KeyboardInterrupt):
        mod.main([str(mod.CASES / "lora-gc-off.yaml"), str(mod.CASES / "lora-gc-on.yaml")])
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert "| **peak allocated** | 7.0 |" in report
    assert "Not run yet (the run was cut short if this stays): lora-gc-on.yaml" in report


def test_gpu_check_prepared_ledger_points_at_the_config_from_any_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The repository may sit anywhere on the GPU machine: a path with a space or ': ' must stay one YAML string."""
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.stack.build import config_file

    mod = _script()
    monkeypatch.setattr(mod, "WORK", tmp_path / "work")
    repo = tmp_path / "a repo: copy"
    shutil.copytree(mod.CASES.parent, repo / "qwen")
    path = mod.prepare(repo / "qwen" / "gpu-check" / "lora-gc-on.yaml")
    doc = load(path)
    found = config_file(doc)
    assert found is not None and found[0] == (repo / "qwen" / "config.json").resolve()
