"""Shared by the ``benchmarks/estimate_*.py`` scripts: the machine line, Markdown tables and the sectioned results
file."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "estimate.md"
HEADER = "# `ledgerspec estimate`: benchmark results\n\nEach section is written by the script named in it.\n"
#: fms-acceleration's A100-80GB reference benchmarks at the commit the published-run scripts cite
FMS_A100_CSV = (
    "https://github.com/foundation-model-stack/fms-acceleration/blob/876e2ed6fc4e966785e3f4315f5ee3cdf8e3d097/"
    "scripts/benchmarks/refs/a100_80gb.csv"
)
#: the columns of a table of `TrainerMemoryTracker` figures (peak over train(), held after it) against the estimate
TRACKER_HEADER = [
    "run",
    "ledger",
    "published peak GB",
    "estimated peak GB",
    "difference",
    "published after train() GB",
    "estimated GB",
    "difference",
    "nvidia-smi peak GiB (not compared)",
]


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )


#: ``shard --estimate`` results by (ledger path, ledger text): see :func:`shard_estimate`
_SHARDED: dict[tuple[str, str], Any] = {}


def shard_estimate(path: Path, text: str | None = None) -> Any:
    """``shard(LEDGER, estimate=True, target="cuda")`` of the ledger at ``path`` (or of ``text`` read as that file),
    simulated once per process: the multi-GPU comparison (``estimate_vs_published_fsdp.py``) and its device-level
    table (``device_vs_published_fsdp.py``) estimate the same declared ledgers, and their tests re-estimating a row
    share one simulation (each reads the result, neither changes it)."""
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.shard.sharder import shard

    if text is None:
        text = path.read_text(encoding="utf-8")
    key = (str(path), text)
    if key not in _SHARDED:
        _SHARDED[key] = shard(from_text(text, str(path)), estimate=True, target="cuda")
    return _SHARDED[key]


def device_word(fits: bool, edge: bool, decided: str | None = None) -> str:
    """A device-level verdict in the results pages' words: ``fits``; ``does not fit, at the edge`` (the replay
    completes only with the typical bytes outside the allocator); else ``does not fit``, with what decided it when
    ``decided`` is given."""
    if fits:
        return "fits"
    if edge:
        return "does not fit, at the edge"
    return f"does not fit ({decided})" if decided else "does not fit"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def publish(body: str, results: Path, partial: bool) -> None:
    """Print ``body``; write it to ``results`` too unless it covers only some rows (``partial``: rows named on the
    command line, a look at them, not the committed table)."""
    if not partial:
        results.write_text(body.rstrip() + "\n", encoding="utf-8")
    print(body)


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of benchmarks/results/estimate.md."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    start, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
