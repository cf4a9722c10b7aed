"""Shared by the ``benchmarks/estimate_*.py`` scripts: the machine line, Markdown tables and the sectioned results
file."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "estimate.md"
HEADER = "# `ledgerspec estimate`: benchmark results\n\nEach section is written by the script named in it.\n"


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of benchmarks/results/estimate.md."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    start, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
