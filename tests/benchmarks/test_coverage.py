"""The committed coverage matrix (``benchmarks/results/coverage.md``) is what the tools say today, cell by cell, and
the docs show that matrix. Fast cells (resolve) run in the fast tier; estimates are slow."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results" / "coverage.md"
DOCS = REPO_ROOT / "docs" / "models.md"


pytestmark = pytest.mark.skipif(not RESULTS.exists(), reason="no committed matrix: run benchmarks/coverage.py")


def _table(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def _committed() -> dict[tuple[str, str], str]:
    rows = _table(RESULTS.read_text(encoding="utf-8"))
    header = [c.strip() for c in rows[0].strip("|").split(" | ")]
    out = {}
    for row in rows[2:]:  # after the header and its --- line
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        for column, cell in zip(header[2:], cells[2:], strict=True):
            out[(cells[0], column)] = cell.replace("\\|", "|")
    return out


@pytest.fixture(scope="module")
def coverage() -> Any:
    pytest.importorskip("torch")
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("coverage_benchmark", REPO_ROOT / "benchmarks" / "coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_benchmark"] = module  # its dataclasses need the module in sys.modules
    spec.loader.exec_module(module)
    return module


FAST = [
    ("Llama 3.x", "LoRA resolve"),
    ("Llama 3.x", "QLoRA resolve"),
    ("Qwen2.5-VL", "LoRA resolve"),
    ("gpt-oss", "QLoRA resolve"),
    ("DeepSeek-V2", "LoRA resolve"),
    ("DeepSeek-V2, lora_dropout 0.05", "LoRA resolve"),
    ("Qwen2.5 GPTQ (published int4 base)", "QLoRA resolve"),
    ("Qwen2.5 GPTQ (published int4 base)", "QLoRA estimate"),
]
SLOW = [("Qwen2.5 dense", "LoRA estimate"), ("Qwen2.5-VL", "LoRA estimate"), ("gpt-oss", "LoRA estimate")]


def _check(coverage: Any, family: str, column: str) -> None:
    f = next(f for f in coverage.FAMILIES if f.family == family)
    kind, step = column.split()
    assert coverage.run_cell(f, kind, step).render() == _committed()[(family, column)]


@pytest.mark.parametrize(("family", "column"), FAST, ids=[f"{a}-{b}" for a, b in FAST])
def test_fast_cells_of_the_committed_matrix(coverage: Any, family: str, column: str) -> None:
    _check(coverage, family, column)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "column"), SLOW, ids=[f"{a}-{b}" for a, b in SLOW])
def test_estimate_cells_of_the_committed_matrix(coverage: Any, family: str, column: str) -> None:
    _check(coverage, family, column)


def test_every_family_has_a_row_and_no_cell_is_a_crash() -> None:
    committed = _committed()
    families = {family for family, _ in committed}
    assert len(families) >= 20
    for cell in committed.values():
        assert cell.startswith(("✓", "refused: ")), cell


def test_the_docs_show_the_committed_matrix() -> None:
    assert _table(RESULTS.read_text(encoding="utf-8")) == _table(DOCS.read_text(encoding="utf-8"))
