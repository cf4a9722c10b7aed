"""``ledger.calculated_subtotal``: the sum of the exact components a ledger holds (no torch).

Written by ``resolve`` (frozen base + adapter + gradients + optimizer) and again by ``estimate`` once
``ledger.activations`` is CALCULATED, so that re-running either leaves the other's figure unchanged.
Not a peak: no overhead factor is ever applied.
"""

from __future__ import annotations

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import Change, set_figure
from ledgerspec.contract.values import EXACT_SOURCES

REQUIRED = F.RESIDENT
OPTIONAL = ("activations", "temporary")


def calculated_subtotal(doc: Document) -> tuple[int, str] | None:
    """(bytes, method) over the exact components, or None while a required one is not exact."""
    total = 0
    used = []
    for key in (*REQUIRED, *OPTIONAL):
        v = doc.get("ledger", key)
        size = v.size()
        if size is None or v.effective_source(True) not in EXACT_SOURCES:
            if key in OPTIONAL:
                continue
            return None
        total += size
        used.append(key)
    return total, "sum of ledger." + " + ".join(used) + " (not a peak: no overhead factor)"


def write_subtotal(doc: Document) -> Change | None:
    sub = calculated_subtotal(doc)
    if sub is None:
        return None
    return set_figure(doc, ("ledger", "calculated_subtotal"), sub[0], "CALCULATED", sub[1])
