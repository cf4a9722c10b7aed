"""The committed re-estimate of Liger-Kernel's published memory rows (`benchmarks/results/liger.md`) re-derives: its
published cells are the source CSV's figures, its arithmetic holds, every row is within 10 % and every row whose
estimated cell is not the published one says why, the staging table's residuals are the CSV's figures less the
shapes' tensors, and a re-run of cheap rows gives the committed estimated cells (a change of the allocation models in
``ledgerspec/derivations/kernels/liger.py``, of the reduction staging or of the tracker cannot leave it stale)."""

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
        assert (cells[7] != "") == (cells[3] != cells[4])  # an explanation exactly where the cells differ
        assert "not explained" not in cells[7]


def test_every_row_is_within_the_threshold(bench: Any) -> None:
    for cells in _rows().values():
        assert abs(float(cells[6].rstrip("%"))) <= bench.THRESHOLD, cells


def test_each_row_declares_the_release_it_was_written_with(bench: Any) -> None:
    """The CSV's liger_version column, as `software.kernels.packages` would declare it."""
    releases = {(r.kernel, bench.declared_release(r)) for r in bench.published_rows() if r.provider == "liger"}
    assert releases == {
        ("fused_linear_cross_entropy", (0, 4, 2)),
        ("rms_norm", (0, 2, 1)),
        ("swiglu", (0, 2, 1)),
        ("geglu", (0, 2, 1)),
        ("rope", (0, 2, 1)),
    }


def test_the_staging_table_residuals_are_the_published_rows_less_their_tensors(bench: Any) -> None:
    """Residual = published - x, dy, y (bf16) - dW (float32), from the CSV and the shapes; the committed table's
    residual less the port's staging is the small tensors (four H-float32 vectors, the M-float32 reciprocal RMS, one
    512-B block of semaphores)."""
    text = RESULTS.read_text(encoding="utf-8").split("## The CUDA reduction's staging buffer", 1)[1]
    table = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    published = {r.x: r for r in bench.published_rows() if (r.kernel, r.provider) == ("rms_norm", "liger")}
    assert sorted(int(c[0]) for c in table) == sorted(published)
    for cells in table:
        h = int(cells[0])
        m = published[h].config["M"]
        residual = round(published[h].published_mib * 2**20) - 3 * m * h * 2 - m * h * 4
        assert f"{residual / 2**20:.4f}" == cells[2].strip()
        staging = float(cells[4]) * 2**20
        rest = 4 * h * 4 + m * 4 + 512 * -(-int(cells[5]) // 512)
        assert int(cells[6]) == residual - staging == rest == int(cells[7])


CHEAP = [
    ("rms_norm", "liger", "full", 1024),
    ("rms_norm", "liger", "full", 8192),
    ("rms_norm", "huggingface", "full", 1024),
    ("rope", "liger", "full", 512),
    ("rope", "huggingface", "full", 512),
    ("geglu", "huggingface", "backward", 1024),
    ("fused_linear_cross_entropy", "liger", "full", 4096),
    ("fused_linear_cross_entropy", "liger", "full", 8192),
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


@pytest.mark.slow  # replays the allocator model over every published row (seconds)
def test_the_allocator_replay_figures_in_the_explanations_re_derive(bench: Any) -> None:
    pytest.importorskip("torch")
    replayed = bench.allocator_replay("fused_linear_cross_entropy", "liger")
    table = _rows()
    for row in bench.published_rows():
        cells = table[_key(row)]
        if (row.kernel, row.provider) != ("fused_linear_cross_entropy", "liger") or not cells[7]:
            continue
        assert f"gives {replayed[row.x] - float(cells[4]):+.2f} MiB more than the estimate" in cells[7]
