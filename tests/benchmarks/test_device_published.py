"""The committed comparison of the verdict on the device with published single-GPU runs
(`benchmarks/results/device.md`) re-derives: its published cells are the source's figures, its arithmetic holds, and
a re-run of a row gives the committed cells (a change of the allocator model or the catalogue cannot leave it stale)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script
from tests.support.results import ledger_rows

RESULTS = REPO_ROOT / "benchmarks" / "results" / "device.md"
SCRIPT = REPO_ROOT / "benchmarks" / "device_vs_published.py"
GiB = 2**30

pytestmark = pytest.mark.skipif(not RESULTS.exists(), reason="no committed results: run the benchmark")


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script(SCRIPT, "device_published_benchmark")


def _rows() -> dict[str, list[str]]:
    """The rows naming a ledger, by ledger name."""
    return ledger_rows(RESULTS)


def test_every_run_has_its_ledger_and_row(bench: Any) -> None:
    assert [r.key for r in bench.RUNS] == list(_rows())
    for run in bench.RUNS:
        assert (bench.LEDGERS / f"{run.key}.ledger.yaml").exists(), run.key


def test_published_cells_are_the_source_figures(bench: Any) -> None:
    for run in bench.RUNS:
        cells = _rows()[run.key]
        assert cells[2] == (f"{run.peak / GiB:.2f}" if run.peak else "- (no metrics)")
        assert cells[5] == f"{run.nvidia / GiB:.2f}"
        assert cells[10] == ("ran" if run.ran else "out of memory")


def test_the_arithmetic_of_every_row(bench: Any) -> None:
    for run in bench.RUNS:
        c = _rows()[run.key]
        if run.peak:
            assert abs((float(c[3]) - float(c[2])) / float(c[2]) - float(c[4].rstrip("%")) / 100) <= 0.0005 + 0.01 / 20
            assert abs((float(c[6]) - float(c[5])) / float(c[5]) - float(c[7].rstrip("%")) / 100) <= 0.0005 + 0.01 / 20
            assert abs(float(c[5]) - float(c[2]) - float(c[8])) <= 0.011
        assert abs(float(c[6]) - float(c[3]) - float(c[9])) <= 0.011


@pytest.mark.slow  # a 7B estimate at full depth: about 10 s
def test_a_row_re_estimated_gives_the_committed_cells(bench: Any) -> None:
    pytest.importorskip("torch")
    run = bench.RUNS[0]
    assert bench.estimate_run(run).cells() == _rows()[run.key]
