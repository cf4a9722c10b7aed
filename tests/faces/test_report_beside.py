"""``ledgerspec report A --beside B``: a LoRA and a full fine-tuning ledger of the same model side by side (issue 26).

The two ledgers are resolved from the tiny Llama's intake sections (``tests/data/sharding``); the report must show
each ledger's own figures (read back from the files, not computed again) and their difference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.contract.units import format_size
from tests.support import TESTS, CliRunner

DATA = TESTS / "data" / "sharding"

pytestmark = pytest.mark.slow  # resolves two models (torch, transformers, PEFT)


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("peft")
    from ledgerspec.contract.writer import save
    from ledgerspec.derivations.resolve.resolver import resolve

    folder = tmp_path_factory.mktemp("beside")
    shutil.copytree(DATA / "tiny", folder / "tiny")
    out = []
    for name in ("tiny-lora", "tiny-full"):
        path = folder / f"{name}.ledger.yaml"
        shutil.copy(DATA / f"{name}.ledger.yaml", path)
        result = resolve(load(path), offline=True)
        save(result.doc, str(path))
        out.append(path)
    return out[0], out[1]


def test_a_lora_and_a_full_ledger_side_by_side(cli: CliRunner, ledgers: tuple[Path, Path]) -> None:
    lora, full = ledgers
    code, out, err = cli("report", lora, "--beside", full)
    assert code == 0, err
    a, b = load(lora), load(full)
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "LoRA" in lines["method.kind"] and "full" in lines["method.kind"]
    for key, label in (("adapter", "adapter"), ("gradients", "gradients"), ("optimizer", "optimizer state")):
        x, y = a.get("ledger", key).size(), b.get("ledger", key).size()
        assert x is not None and y is not None and y > x  # full fine-tuning trains every weight
        assert format_size(x) in lines[label] and format_size(y) in lines[label], lines[label]
        assert "+" + format_size(y - x) in lines[label], lines[label]
    trainable = b.get("method", "trainable_parameters").integer()
    assert trainable == b.get("identity", "total_parameters").integer()
    assert f"{trainable:,}" in lines["trainable parameters"]


def test_beside_and_html_are_one_line_apart(cli: CliRunner, ledgers: tuple[Path, Path], tmp_path: Path) -> None:
    code, _, err = cli("report", ledgers[0], "--beside", ledgers[1], "--html", tmp_path / "x.html")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--beside" in err
