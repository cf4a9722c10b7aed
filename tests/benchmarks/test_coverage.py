"""The committed coverage matrix (``benchmarks/results/coverage.md``) is what the tools say today, cell by cell, and
the docs show that matrix.

Every resolve cell is re-run on the intake ``benchmarks/coverage.py`` writes for its row, as ``ledgerspec resolve``
runs it (validate's input checks, then the meta-device build), and its text compared: a committed cell cannot go
stale silently (issue 26: the GPTQ QLoRA cell said ✓ while resolve refused its intake with LS030). The whole set
takes about 40 s on 2 cores, so it runs in the slow tier; the fast tier re-runs a subset, and runs every cell's
input checks (no torch), which is where that refusal came from. Estimates are slow: a few are re-run."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script

RESULTS = REPO_ROOT / "benchmarks" / "results" / "coverage.md"
DOCS = REPO_ROOT / "docs" / "models.md"


pytestmark = pytest.mark.skipif(not RESULTS.exists(), reason="no committed matrix: run benchmarks/coverage.py")


def _table(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def _split(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split(" | ")]


def _header() -> list[str]:
    return _split(_table(RESULTS.read_text(encoding="utf-8"))[0])


def _committed() -> dict[tuple[str, str], str]:
    rows = _table(RESULTS.read_text(encoding="utf-8"))
    header = _header()
    out = {}
    for row in rows[2:]:  # after the header and its --- line
        cells = _split(row)
        for column, cell in zip(header[2:], cells[2:], strict=True):
            out[(cells[0], column)] = cell.replace("\\|", "|")
    return out


@functools.cache
def _benchmark() -> Any:
    """``benchmarks/coverage.py`` as a module (it imports no torch until a cell runs)."""
    return load_script(REPO_ROOT / "benchmarks" / "coverage.py", "coverage_benchmark")


@pytest.fixture(scope="module")
def coverage() -> Any:
    pytest.importorskip("torch")
    return _benchmark()


def _family(family: str) -> Any:
    return next(f for f in _benchmark().FAMILIES if f.family == family)


def _cells(step: str) -> list[tuple[str, str]]:
    """The committed matrix's cells of ``step`` (resolve or estimate), in its order."""
    return [(family, column) for family, column in _committed() if column.endswith(f" {step}")]


RESOLVE = _cells("resolve") if RESULTS.exists() else []
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
SLOW_RESOLVE = [cell for cell in RESOLVE if cell not in FAST]
SLOW_ESTIMATE = [("Qwen2.5 dense", "LoRA estimate"), ("Qwen2.5-VL", "LoRA estimate"), ("gpt-oss", "LoRA estimate")]


def _ids(cells: list[tuple[str, str]]) -> list[str]:
    return [f"{a}-{b}" for a, b in cells]


def _check(coverage: Any, family: str, column: str) -> None:
    kind, step = column.split()
    got = coverage.run_cell(_family(family), kind, step).render()
    assert got == _committed()[(family, column)], (
        f"the committed matrix is stale at {family} / {column}: run `python benchmarks/coverage.py` (and copy the "
        "table into docs/models.md)"
    )


@pytest.mark.parametrize(("family", "column"), FAST, ids=_ids(FAST))
def test_fast_cells_of_the_committed_matrix(coverage: Any, family: str, column: str) -> None:
    _check(coverage, family, column)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "column"), SLOW_RESOLVE, ids=_ids(SLOW_RESOLVE))
def test_every_other_resolve_cell_of_the_committed_matrix(coverage: Any, family: str, column: str) -> None:
    _check(coverage, family, column)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "column"), SLOW_ESTIMATE, ids=_ids(SLOW_ESTIMATE))
def test_estimate_cells_of_the_committed_matrix(coverage: Any, family: str, column: str) -> None:
    _check(coverage, family, column)


def test_every_resolve_cell_is_checked() -> None:
    """The fast subset and the slow set together are every resolve cell the committed matrix holds."""
    assert len(RESOLVE) == 2 * len(_benchmark().FAMILIES)
    fast_resolve = {c for c in FAST if c[1].endswith(" resolve")}
    assert fast_resolve <= set(RESOLVE) and fast_resolve | set(SLOW_RESOLVE) == set(RESOLVE)
    assert set(FAST) | set(SLOW_ESTIMATE) <= set(_committed())


def test_the_committed_rows_are_the_benchmarks_families() -> None:
    """Each family the benchmark runs has its row, in order, under the benchmark's columns (a renamed or dropped
    family cannot leave a row nothing re-runs)."""
    committed = _committed()
    assert list(dict.fromkeys(family for family, _ in committed)) == [f.family for f in _benchmark().FAMILIES]
    assert _header()[2:] == list(_benchmark().COLUMNS)


def test_every_cell_passes_the_input_checks_its_command_runs() -> None:
    """The cheap part of every cell, estimates too, in the fast tier: the input checks (validate's rules such as
    LS030, no torch) refuse exactly the cells the committed matrix says they refuse."""
    from ledgerspec.errors import LedgerspecError

    bench = _benchmark()
    for (family, column), committed in _committed().items():
        kind, step = column.split()
        if step == "estimate" and _family(family).no_estimate:
            continue
        try:
            bench.checked_intake(_family(family), kind, step)
        except LedgerspecError as exc:
            assert bench.refusal(exc).render() == committed, f"{family} / {column}: {exc.message}"
        else:  # preflight's refusal: "message [RULE] (hint: ...)"
            assert not re.search(r" \[(LS\d{3}|schema)\] \(hint: ", committed), f"{family} / {column}: not refused now"


def test_every_family_has_a_row_and_no_cell_is_a_crash() -> None:
    committed = _committed()
    families = {family for family, _ in committed}
    assert len(families) >= 20
    for cell in committed.values():
        assert cell.startswith(("✓", "refused: ")), cell


def test_the_docs_show_the_committed_matrix() -> None:
    assert _table(RESULTS.read_text(encoding="utf-8")) == _table(DOCS.read_text(encoding="utf-8"))
