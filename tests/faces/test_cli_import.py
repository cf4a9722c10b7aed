"""``ledgerspec import`` and ``init --from`` a tool's configuration, end to end: every fixture converts, validates,
and (slow) resolves offline against the shipped config of its model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support import run_cli
from tests.support.imports import IMPORTS

#: each fixture set: LoRA, QLoRA and a multi-GPU one per format
SETS = {
    "axolotl-lora": ["axolotl/lora.yml"],
    "axolotl-qlora": ["axolotl/qlora.yml"],
    "axolotl-zero3": ["axolotl/lora-zero3.yml"],
    "axolotl-fsdp2": ["axolotl/qlora-fsdp2.yml"],
    "llamafactory-lora": ["llamafactory/lora.yaml"],
    "llamafactory-qlora": ["llamafactory/qlora.yaml"],
    "llamafactory-zero2": ["llamafactory/lora-zero2-offload.yaml"],
    "hf-lora": ["hf/lora/training_args.json", "hf/lora/adapter_config.json", "hf/lora/config.json"],
    "hf-qlora": ["hf/qlora/sft_config.json", "hf/qlora/adapter_config.json", "hf/qlora/config.json"],
    "hf-fsdp2": ["hf/fsdp2/training_args.yaml", "hf/fsdp2/adapter_config.json"],
}


def _import(tmp_path: Path, name: str, *extra: str) -> tuple[int, str, str, Path]:
    out = tmp_path / f"{name}.intake.yaml"
    code, stdout, stderr = run_cli("import", *(IMPORTS / p for p in SETS[name]), "-o", out, *extra)
    return code, stdout, stderr, out


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_fixture_converts_and_validates(tmp_path: Path, name: str) -> None:
    code, _, stderr, out = _import(tmp_path, name, "--gpu-count", "2")
    assert code == 0, stderr
    assert "the intake supports" in stderr.splitlines()[-1]
    doc = load(out)
    assert doc.kind == "intake"
    assert doc.get("parallelism", "gpu_count").value == 2
    code, stdout, stderr = run_cli("validate", out)
    assert code == 0, stdout + stderr
    if name not in ("hf-lora", "hf-fsdp2"):  # TrainingArguments carry no sequence length
        assert doc.get("workload", "max_length").known


def test_findings_are_printed_one_per_line_and_stdout_gets_the_intake(tmp_path: Path) -> None:
    code, stdout, stderr = run_cli("import", IMPORTS / "axolotl/unknown-keys.yml")
    assert code == 0
    assert stdout.startswith("# Imported by `ledgerspec import`") and "ledgerspec: intake/v1" in stdout
    lines = stderr.splitlines()
    assert any(
        line.startswith(f"{IMPORTS / 'axolotl/unknown-keys.yml'}:9:1: import: gradient_acumulation_steps: ")
        for line in lines
    )
    assert len(lines) == 5  # four findings and the summary


@pytest.mark.parametrize("name", ["list.yaml", "not-yaml.yml", "unknown-format.json", "training_args.bin"])
def test_bad_input_is_one_line_exit_2(name: str) -> None:
    code, stdout, stderr = run_cli("import", IMPORTS / "bad" / name)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and ": import: " in stderr


def test_output_exists_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "x.intake.yaml"
    out.write_text("keep")
    code, _, stderr = run_cli("import", IMPORTS / "axolotl/qlora.yml", "-o", out)
    assert code == 2 and "file exists" in stderr and out.read_text() == "keep"
    assert run_cli("import", IMPORTS / "axolotl/qlora.yml", "-o", out, "--force")[0] == 0


def test_output_into_a_folder_says_so_at_once(tmp_path: Path) -> None:
    code, _, stderr = run_cli("import", IMPORTS / "axolotl/qlora.yml", "-o", tmp_path)
    assert code == 2 and stderr.strip() == f"{tmp_path}: write: is a folder (hint: give a file name)"


def test_init_from_a_tool_config_is_the_skeleton_of_the_imported_intake(tmp_path: Path) -> None:
    out = tmp_path / "run.ledger.yaml"
    code, _, stderr = run_cli("init", "--from", IMPORTS / "axolotl/qlora.yml", "-o", out)
    assert code == 0, stderr
    doc = load(out)
    assert doc.kind == "ledger"
    assert doc.get("method", "rank").value == 16 and doc.get("ledger", "frozen_base").form == "word"
    assert doc.get("x-import", "tools").present
    assert (out.parent / doc.get("identity", "config_path").value / "config.json").is_file()
    assert "# axolotl: lora_r" in out.read_text()
    # several files, and an intake keeps working as before
    code, _, _ = run_cli(
        "init", *(a for p in SETS["hf-lora"] for a in ("--from", IMPORTS / p)), "-o", tmp_path / "b.yaml"
    )
    assert code == 0
    code, stdout, _ = run_cli("init", "--from", "examples/llama-2-7b-qlora.intake.yaml")
    assert code == 0 and "x-import" not in stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETS))
def test_every_fixture_resolves_offline(tmp_path: Path, name: str) -> None:
    """The imported intake names a shipped (or the given) config.json: resolve builds the model on the meta device
    offline and the ledger validates at CALCULATED or above when the minimum intake is complete."""
    code, _, stderr, out = _import(tmp_path, name, "--gpu-count", "1")
    assert code == 0, stderr
    ledger = tmp_path / f"{name}.ledger.yaml"
    code, stdout, stderr = run_cli("resolve", out, "-o", ledger, "--offline")
    assert code == 0, stdout + stderr
    doc = load(ledger)
    assert doc.get("ledger", "frozen_base").source == "CALCULATED"
    assert doc.get("method", "trainable_parameters").source == "VERIFIED"
    code, stdout, stderr = run_cli("validate", ledger)
    assert code == 0, stdout + stderr


def test_init_from_an_intake_escapes_its_comments_controls_on_the_terminal_only(tmp_path: Path) -> None:
    """A comment copied from the intake may hold a tab (the one control character YAML lets a comment have; the
    loader refuses the others): on the terminal it is shown as an escape (terminal output never interprets user
    strings), in the ``-o`` file it stays byte for byte."""
    intake = tmp_path / "tab.intake.yaml"
    intake.write_text("ledgerspec: intake/v1\nidentity:\n  model_id: UNKNOWN  # a\tb\n", encoding="utf-8")
    code, out, err = run_cli("init", "--from", intake)
    assert code == 0, err
    assert "# a\\tb" in out and "\t" not in out
    written = tmp_path / "out.ledger.yaml"
    code, _, err = run_cli("init", "--from", intake, "-o", written)
    assert code == 0, err
    assert "# a\tb" in written.read_text(encoding="utf-8")


def _zero_microbatch(tmp_path: Path) -> Path:
    """The axolotl QLoRA fixture with ``micro_batch_size: 0``: an intake (and a ledger) that validate refuses."""
    src = tmp_path / "zero.yml"
    src.write_text((IMPORTS / "axolotl/qlora.yml").read_text().replace("micro_batch_size: 1", "micro_batch_size: 0"))
    assert "micro_batch_size: 0" in src.read_text()
    return src


def test_an_intake_validate_refuses_is_written_and_exits_1(tmp_path: Path) -> None:
    """``micro_batch_size: 0`` was imported with exit 0 and "the intake supports INSUFFICIENT DATA"; validate then
    said INVALID (a newcomer trial). The intake is still written, for the user to fix; the exit status and the
    summary say it is invalid, as the command-line contract has it for an invalid document."""
    src = _zero_microbatch(tmp_path)
    out = tmp_path / "zero.intake.yaml"
    code, _, err = run_cli("import", src, "-o", out)
    assert code == 1 and out.is_file()
    assert "INVALID (1 error(s): `ledgerspec validate` lists them)" in err.splitlines()[-1]


def test_init_from_a_tool_config_says_what_the_ledger_it_writes_supports(tmp_path: Path) -> None:
    """``init --from axolotl.yml -o run.ledger.yaml`` ended with "the intake supports INSUFFICIENT DATA (1
    reason(s))" while the file written was a ledger that validate holds for other reasons (a newcomer trial): the
    last line names the ledger, with the status and reasons ``validate`` gives that file; a ledger validate refuses
    is written and exits 1, as ``import`` does."""
    out = tmp_path / "run.ledger.yaml"
    code, _, err = run_cli("init", "--from", IMPORTS / "axolotl/qlora.yml", "-o", out)
    assert code == 0, err
    last = err.splitlines()[-1]
    assert "the ledger supports" in last and "intake" not in last
    code, stdout, _ = run_cli("validate", "-v", out)
    status = re.search(r"status (\S+(?: DATA)?) \(declared", stdout)
    reasons = re.search(r"every reason \((\d+)\)", stdout)
    assert status and reasons
    assert f"supports {status.group(1)} ({reasons.group(1)} reason(s)" in last
    src = _zero_microbatch(tmp_path)
    code, _, err = run_cli("init", "--from", src, "-o", tmp_path / "zero.ledger.yaml")
    assert code == 1 and (tmp_path / "zero.ledger.yaml").is_file()
    assert "the ledger supports" in err.splitlines()[-1] and "INVALID" in err.splitlines()[-1]
    # written over the file it imports (--force): the same line and exit status (it read the file written before)
    code, _, err = run_cli("init", "--from", src, "-o", src, "--force")
    assert code == 1 and "the ledger supports" in err.splitlines()[-1] and "INVALID" in err.splitlines()[-1]
