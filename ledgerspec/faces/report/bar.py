"""Geometry of the stacked bar: where each component starts and ends on a scale, shared by both renderers.

The scale is the largest of the device memory, the stacked components and the best peak, so every
mark fits. Terminal cells are whole characters: :func:`cells` splits them by largest remainder, so
the cells of the segments add up exactly to the cells of the stacked total.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledgerspec.faces.report.data import Entry, ReportData


@dataclass(frozen=True)
class Span:
    entry: Entry
    start: float  # fraction of the scale, 0..1
    width: float  # fraction of the scale


@dataclass(frozen=True)
class Bar:
    scale: int  # bytes the full bar width stands for
    spans: list[Span]
    capacity: float | None  # fraction of the scale where the device memory ends
    peak: float | None  # fraction of the scale of the best peak figure

    @property
    def stacked(self) -> float:
        return sum(s.width for s in self.spans)


def layout(data: ReportData) -> Bar | None:
    """The bar for ``data``, or None when there is nothing to draw."""
    candidates = [data.stacked_total, data.capacity or 0, data.peak or 0]
    scale = max(candidates)
    if scale <= 0:
        return None
    spans: list[Span] = []
    at = 0
    for e in data.segments:
        n = e.nbytes or 0
        spans.append(Span(e, at / scale, n / scale))
        at += n
    return Bar(scale, spans, data.capacity / scale if data.capacity else None, data.peak / scale if data.peak else None)


def cells(bar: Bar, width: int) -> list[int]:
    """Whole characters per span (largest remainder), summing to round(stacked fraction x width)."""
    total = round(bar.stacked * width)
    exact = [s.width * width for s in bar.spans]
    base = [int(x) for x in exact]
    left = total - sum(base)
    order = sorted(range(len(exact)), key=lambda i: exact[i] - base[i], reverse=True)
    for i in order[: max(left, 0)]:
        base[i] += 1
    return base
