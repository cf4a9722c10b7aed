"""``-o OUT`` in another folder: a relative identity.config_path must still name the same config file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import from_text, load, relocate
from ledgerspec.contract.writer import render
from tests.support import EXAMPLES, run_cli


def test_relocate_rewrites_a_relative_config_path_and_keeps_its_comment(tmp_path: Path) -> None:
    src = tmp_path / "a" / "x.ledger.yaml"
    src.parent.mkdir()
    (tmp_path / "cfg").mkdir()
    text = "ledgerspec: ledger/v1\nidentity:\n  config_path: '../cfg/config.json'  # the model\n"
    src.write_text(text)
    doc = load(str(src))
    relocate(doc, str(tmp_path / "b" / "c" / "y.ledger.yaml"))
    out = render(doc.data, doc.text)
    line = next(ln for ln in out.splitlines() if "config_path" in ln)
    assert line.startswith("  config_path: '../../cfg/config.json'") and line.endswith("# the model")
    assert doc.get("identity", "config_path").text() == "../../cfg/config.json"
    assert doc.path == str(tmp_path / "b" / "c" / "y.ledger.yaml")


@pytest.mark.parametrize("value", ["/abs/config.json", "UNKNOWN"])
def test_relocate_leaves_absolute_and_unknown_paths(tmp_path: Path, value: str) -> None:
    doc = from_text(f"ledgerspec: ledger/v1\nidentity:\n  config_path: {value}\n", str(tmp_path / "x.ledger.yaml"))
    relocate(doc, str(tmp_path / "sub" / "y.ledger.yaml"))
    assert doc.get("identity", "config_path").raw == value


@pytest.mark.slow
def test_resolve_then_estimate_in_another_folder(tmp_path: Path) -> None:
    """The README demo's chain: resolve an example intake into out/, then estimate the written ledger there."""
    ex = tmp_path / "examples"
    shutil.copytree(EXAMPLES, ex)
    out = tmp_path / "out" / "l.ledger.yaml"
    code, _, err = run_cli("resolve", str(ex / "llama-2-7b-lora.intake.yaml"), "-o", str(out))
    assert code == 0, err
    assert "config_path: ../examples/configs/llama-2-7b/config.json" in out.read_text()
    code, _, err = run_cli("estimate", str(out), "--device-memory", "24GiB")
    assert code == 0, err
    assert load(str(out)).get("ledger", "activations").source == "CALCULATED"
