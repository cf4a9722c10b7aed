"""Reading the committed benchmark results (``benchmarks/results/*.md``) back, for the tests that re-derive them."""

from __future__ import annotations

import re
from pathlib import Path


def ledger_rows(path: Path) -> dict[str, list[str]]:
    """The rows of a results file's tables that name a ledger (`` `KEY.ledger.yaml` `` in the second cell), by ledger
    name, each as its cells; a ledger named again in a later table keeps its first row (the main table's)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| ") and ".ledger.yaml`" in line:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            out.setdefault(re.sub(r"`(.*)\.ledger\.yaml`", r"\1", cells[1]), cells)
    return out
