"""``ledgerspec report A --beside B``: two ledgers' components side by side (plain text), e.g. LoRA and full fine-tuning
of the same model: "LoRA or full fine-tuning on this card?" (issue 26).

Each column is what its ledger says, with its provenance word; the last column is B minus A where both give bytes.
Nothing is computed here beyond that difference: the figures are the ledgers' own (``resolve``, ``estimate``,
``measure``).
"""

from __future__ import annotations

from typing import TextIO

from ledgerspec.contract.units import format_size
from ledgerspec.faces.report.data import COMPONENT_LABELS, Entry, ReportData, shown

#: the rows: what each ledger is, then its components, then its best peak
_ROWS = ("frozen_base", "adapter", "gradients", "optimizer", "activations", "temporary", "calculated_subtotal")


def _cell(e: Entry | None) -> str:
    if e is None:
        return "-"
    return f"{shown(e.display)} ({e.source})" if e.source != "DECLARED" else shown(e.display)


def _input(d: ReportData, path: tuple[str, ...]) -> str:
    found = next((e for e in d.inputs + d.figures if e.path == path), None)
    return _cell(found)


def rows(a: ReportData, b: ReportData) -> list[tuple[str, str, str, str]]:
    """(label, A, B, B - A) for the table."""
    out: list[tuple[str, str, str, str]] = [
        ("file", shown(a.path), shown(b.path), ""),
        ("method.kind", _input(a, ("method", "kind")), _input(b, ("method", "kind")), ""),
        (
            "trainable parameters",
            _input(a, ("method", "trainable_parameters")),
            _input(b, ("method", "trainable_parameters")),
            "",
        ),
    ]
    comp_a = {e.path[-1]: e for e in a.components}
    comp_b = {e.path[-1]: e for e in b.components}
    for key in _ROWS:
        ea, eb = comp_a.get(key), comp_b.get(key)
        if (ea is None or ea.source == "UNKNOWN") and (eb is None or eb.source == "UNKNOWN"):
            continue
        size_a = ea.nbytes if ea is not None else None
        size_b = eb.nbytes if eb is not None else None
        out.append((COMPONENT_LABELS.get(key, key), _cell(ea), _cell(eb), _diff(size_a, size_b)))
    peak_a = format_size(a.peak) if a.peak is not None else "-"
    peak_b = format_size(b.peak) if b.peak is not None else "-"
    out.append(
        (
            "peak",
            f"{peak_a} ({shown(a.peak_label)})" if a.peak_label else peak_a,
            f"{peak_b} ({shown(b.peak_label)})" if b.peak_label else peak_b,
            _diff(a.peak, b.peak),
        )
    )
    out.append(("status", a.supported_status, b.supported_status, ""))
    return out


def _diff(x: int | None, y: int | None) -> str:
    if x is None or y is None:
        return ""
    d = y - x
    return ("+" if d >= 0 else "-") + format_size(abs(d))


def render_beside(a: ReportData, b: ReportData, out: TextIO) -> None:
    table = [("", "A", "B", "B - A"), *rows(a, b)]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    out.write(
        "each figure as its ledger gives it (provenance in brackets); a sum of components is never a peak: the peak "
        "row is each ledger's best peak figure\n"
    )


__all__ = ["render_beside", "rows"]
