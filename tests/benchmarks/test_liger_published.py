"""The committed re-estimate of Liger-Kernel's published memory rows (`benchmarks/results/liger.md`) re-derives: its
published cells are the source CSV's figures, its arithmetic holds, and a re-run of cheap rows gives the committed
estimated cells (a change of the allocation models in ``ledgerspec/derivations/kernels/liger.py`` or of the tracker
cannot leave it stale)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script

RESULTS = REPO_ROOT / "benchmarks" / "results" / "liger.md"
SCRIPT = REPO_ROOT / "benchmarks" / "liger_published.py"

pytestmark = pytest.mark.skipif(not RESULTS.exists(), reason="no committed results: run the benchmark")


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script(SCRIPT, "liger_published_benchmark")


def _rows() -> dict[tuple[str, str, str, str, int], list[str]]:
    """(kernel, x name, provider, mode, x) -> the row's cells."""
    out: dict[tuple[str, str, str, str, int], list[str]] = {}
    kernel = x_name = ""
    for line in RESULTS.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            kernel = line[3:].strip()
        elif line.startswith("| ") and "| provider |" in line:
            x_name = line.strip("| ").split(" | ")[0]
        elif line.startswith("| ") and kernel in ("fused_linear_cross_entropy", "rms_norm", "swiglu", "geglu", "rope"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if cells[0].isdigit():
                out[(kernel, x_name, cells[1], cells[2], int(cells[0]))] = cells
    return out


def _key(row: Any) -> tuple[str, str, str, str, int]:
    return (row.kernel, row.x_name, row.provider, row.mode, row.x)


def test_every_published_row_has_its_row(bench: Any) -> None:
    rows = bench.published_rows()
    assert len(rows) == 68
    assert sorted(map(_key, rows)) == sorted(_rows())


def test_published_cells_are_the_source_figures(bench: Any) -> None:
    table = _rows()
    for row in bench.published_rows():
        assert table[_key(row)][3] == f"{row.published_mib:.2f}", row


def test_the_arithmetic_of_every_row(bench: Any) -> None:
    for cells in _rows().values():
        published, estimated = float(cells[3]), float(cells[4])
        tolerance = 0.05 + 100 * 0.005 * (1 + estimated / published) / published  # cells rounded to 0.01 MiB, 0.1 %
        assert abs((estimated - published) / published * 100 - float(cells[6].rstrip("%"))) <= tolerance
        assert (cells[7] != "") == (abs(float(cells[6].rstrip("%"))) > bench.THRESHOLD)


CHEAP = [
    ("rms_norm", "liger", "full", 1024),
    ("rms_norm", "huggingface", "full", 1024),
    ("rope", "liger", "full", 512),
    ("rope", "huggingface", "full", 512),
    ("geglu", "huggingface", "backward", 1024),
    ("fused_linear_cross_entropy", "liger", "full", 4096),
]


@pytest.mark.parametrize("kernel,provider,mode,x", CHEAP)
def test_a_row_re_estimated_gives_the_committed_cells(
    bench: Any, kernel: str, provider: str, mode: str, x: int
) -> None:
    pytest.importorskip("torch")
    (row,) = [r for r in bench.published_rows() if (r.kernel, r.provider, r.mode, r.x) == (kernel, provider, mode, x)][
        :1
    ]
    assert bench.estimate(row).cells() == _rows()[_key(row)][:7]
