"""The terminal face of ``ledgerspec report``: rich tables and a coloured bar, or plain text without rich.

rich is the optional extra ``ledgerspec[report]`` and is imported only here, only when used. Both
renderers draw the same :class:`~ledgerspec.faces.report.data.ReportData`; neither computes figures.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from ledgerspec.checks.findings import ERROR, INFO, WARNING
from ledgerspec.contract.units import format_size
from ledgerspec.faces.report.bar import Bar, cells, layout
from ledgerspec.faces.report.data import (
    COMPONENT_CODES,
    COMPONENT_LABELS,
    PROVENANCE,
    DeviceRow,
    Entry,
    FitRow,
    PhasePoint,
    ReportData,
    decided_on_device,
    largest_label,
    shown,
)

#: rich styles per provenance word: text colour in tables, background in the bar
RICH_STYLES = {
    "MEASURED": "green",
    "VERIFIED": "blue",
    "CALCULATED": "magenta",
    "ASSUMPTION": "dark_orange",
    "CONFIGURATION-SPECIFIC": "hot_pink",
    "UNKNOWN": "bright_black",
    "DECLARED": "default",
}
#: rich background per memory component in the bar (provenance is the letter line below it)
COMPONENT_STYLES = {
    "frozen_base": "bold white on dodger_blue3",
    "adapter": "bold black on orange1",
    "gradients": "bold white on green4",
    "optimizer": "bold black on orchid",
    "activations": "bold black on sky_blue1",
    "temporary": "bold white on red3",
}
#: one letter per provenance, on the line under the bar
PROVENANCE_CODES = {
    "MEASURED": "M",
    "VERIFIED": "V",
    "CALCULATED": "C",
    "ASSUMPTION": "A",
    "CONFIGURATION-SPECIFIC": "S",
    "UNKNOWN": "?",
    "DECLARED": "D",
}
VERDICT_STYLES = {
    "FITS": "bold white on green4",
    "DOES NOT FIT": "bold white on red3",
    "UNKNOWN": "bold white on grey42",
}
STATUS_STYLES = {
    "INSUFFICIENT DATA": "bold red",
    "CALCULATED": "bold magenta",
    "CANDIDATE": "bold blue",
    "VALIDATED": "bold green",
}
BAR_WIDTH = 60
#: width of the plain-text report; the method / note column wraps within it (never truncated)
PLAIN_WIDTH = 120
_MIN_DETAIL = 40


def _flat(text: str) -> str:
    """One line: a method string is read whole, wrapped by the table, never cut."""
    return " ".join(text.split())


def _status_line(d: ReportData) -> str:
    declared = d.declared_status or "none declared"
    return f"status {d.supported_status} (declared: {declared})"


def _verdict_line(d: ReportData) -> str:
    return shown(d.verdict.sentence()) if d.verdict is not None else "UNKNOWN"


def _step_lines(d: ReportData, verbose: bool) -> list[str]:
    """What the next status needs, one line per kind of evidence; every reason with ``verbose``."""
    if not d.steps:
        return []
    head = f"to reach {d.next_status}:" if d.next_status else "what holds it down:"
    lines = [f"  {head}", *(f"  - {shown(step.line())}" for step in d.steps)]
    if verbose:
        lines.append(f"  every reason ({len(d.reasons)}):")
        lines += [f"    - {r}" for r in d.reasons]
    elif len(d.reasons) > len(d.steps):
        lines.append(f"  ({len(d.reasons)} reasons in all: `ledgerspec report -v` or `ledgerspec validate -v`)")
    return lines


def _provenance_line(spans: list[tuple[Entry, int]]) -> str:
    """The provenance of each segment, one letter per cell, under the bar."""
    return "".join(PROVENANCE_CODES.get(e.source, "?") * n for e, n in spans)


def _provenance_legend(spans: list[tuple[Entry, int]]) -> str:
    seen = list(dict.fromkeys(e.source for e, _ in spans))
    return "provenance (letters under the bar): " + "  ".join(f"{PROVENANCE_CODES.get(s, '?')}={s}" for s in seen)


def _bar_caption(d: ReportData) -> list[str]:
    lines = [f"stacked components: {format_size(d.stacked_total)}"]
    if d.capacity is not None:
        share = 100 * d.stacked_total / d.capacity
        lines[0] += f" of {format_size(d.capacity)} ({d.capacity_label}), {share:.1f} %"
    else:
        lines[0] += " (no device memory given: result.target_device.memory)"
    if d.peak is not None:
        lines.append(f"best peak figure: {format_size(d.peak)} from {d.peak_label}")
    if d.missing:
        lines.append("not in the bar: " + ", ".join(f"{COMPONENT_LABELS[e.name]} ({e.display})" for e in d.missing))
    return lines


def _bar_cells(bar: Bar, width: int) -> tuple[list[tuple[Entry, int]], int | None, int | None]:
    counts = cells(bar, width)
    cap = min(width - 1, round(bar.capacity * width)) if bar.capacity is not None else None
    peak = min(width - 1, round(bar.peak * width)) if bar.peak is not None else None
    return [(s.entry, n) for s, n in zip(bar.spans, counts, strict=True)], cap, peak


def _inputs_summary(d: ReportData) -> tuple[str, list[Entry]]:
    counts = {p: sum(1 for e in d.inputs if e.source == p) for p in PROVENANCE}
    shown = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
    return f"configuration inputs: {shown or 'none'}", [e for e in d.inputs if e.source != "DECLARED"]


def _input_line(e: Entry) -> str:
    value = "" if e.display == e.source else f"{e.display} "
    return f"{e.key}: {value}[{e.source}]" + (f" {_flat(e.detail)}" if e.detail else "")


def _finding_line(d: ReportData) -> str:
    return (
        f"findings: {d.count(ERROR)} error(s), {d.count(WARNING)} warning(s), {d.count(INFO)} info "
        f"(`ledgerspec validate -v {d.path}` lists them all)"
    )


# -- plain text -------------------------------------------------------------------------------------
def render_plain(d: ReportData, out: TextIO, width: int = BAR_WIDTH, verbose: bool = False) -> None:
    w = out.write
    w(_verdict_line(d) + "\n")
    w(f"{d.path}  {d.kind}/v1" + (f"  {d.title}" if d.title else "") + "\n")
    w(_status_line(d) + "\n")
    for step in _step_lines(d, verbose):
        w(step + "\n")
    if d.fits:
        w("\nlargest that fits (estimate --fit)\n")
        _plain_table(out, FIT_HEAD, [_fit_cells(r) for r in d.fits])
    if d.what_if_device:
        w(f"\nwhat if (estimate --what-if): {d.what_if_device}\n")
    if d.devices:
        w("\nwhich device (estimate --devices)\n")
        _plain_table(out, device_head(decided_on_device(d.devices)), [_device_cells(r) for r in d.devices])
        if d.devices_note:
            w(textwrap.fill(d.devices_note, PLAIN_WIDTH, initial_indent="  ", subsequent_indent="  ") + "\n")
    w("\nmemory components (ledger)\n")
    rows = [(COMPONENT_LABELS.get(e.name, e.name), e.display, e.source, _flat(e.detail)) for e in d.components]
    _plain_table(out, ("component", "value", "source", "method / note"), rows)
    bar = layout(d)
    if bar is not None:
        spans, cap, peak = _bar_cells(bar, width)
        chars = "".join(COMPONENT_CODES[e.name] * n for e, n in spans)
        line = list(chars.ljust(width, " "))
        if cap is not None:
            for i in range(len(chars), cap):
                line[i] = "."
            line[cap] = "|"
        w("\n[" + "".join(line) + "]\n")
        w(" " + _provenance_line(spans) + "\n")
        if peak is not None:
            w(" " + " " * peak + "^ best peak\n")
        legend = "  ".join(f"{COMPONENT_CODES[e.name]}={COMPONENT_LABELS[e.name]}" for e, _ in spans)
        if legend:
            w(legend + "\n")
            w(_provenance_legend(spans) + "\n")
        if cap is not None:
            w("|=device memory\n")
    for caption in _bar_caption(d):
        w(caption + "\n")
    if d.figures:
        w("\nother figures\n")
        _plain_table(
            out,
            ("field", "value", "source", "method / note"),
            [(e.key, e.display, e.source, _flat(e.detail)) for e in d.figures],
        )
    head, notable = _inputs_summary(d)
    w(f"\n{head}\n")
    for e in notable:
        w(textwrap.fill(_input_line(e), PLAIN_WIDTH, initial_indent="  ", subsequent_indent="    ") + "\n")
    if d.has_phases:
        w(f"\n{_phases_title(d)}\n")
        _plain_table(out, _phase_head(d), [_phase_cells(d, p) for p in d.phases])
        if d.has_device_phases:
            w(f"  ({DEVICE_PHASES_NOTE})\n")
    if d.at_peak:
        w(f"\n{_at_peak_title(d)}\n")
        _plain_table(
            out, ("component", "alive"), [(COMPONENT_LABELS.get(name, name), format_size(n)) for name, n in d.at_peak]
        )
        w(f"  ({AT_PEAK_NOTE})\n")
    w("\n" + _finding_line(d) + "\n")
    for f in d.findings:
        if f.severity != INFO:
            w(f"  {f.line}:{f.column} {f.rule} {f.severity}: {f.message}\n")


DEVICE_PHASES_NOTE = (
    "reserved: the allocator model's segments; device-level: reserved + what lies outside the allocator "
    "(x-estimate.outside_allocator); predicted, not measured"
)


def _phases_title(d: ReportData) -> str:
    if d.has_device_phases:
        return "phases (estimated: allocated, reserved, device-level; vs measured)"
    return "phases (estimated vs measured)"


def _phase_head(d: ReportData) -> tuple[str, ...]:
    if d.has_device_phases:
        return ("phase", "allocated", "reserved", "device-level", "measured")
    return ("phase", "estimated", "measured")


def _phase_cells(d: ReportData, p: PhasePoint) -> tuple[str, ...]:
    def cell(e: Entry | None) -> str:
        return e.display if e is not None else "-"

    if d.has_device_phases:
        return (p.label, cell(p.estimated), cell(p.reserved), cell(p.device), cell(p.measured))
    return (p.label, cell(p.estimated), cell(p.measured))


FIT_HEAD = (
    "input",
    "on the device",
    "allocated: largest",
    "its peak",
    "next value",
    "its peak",
    "device",
    "note",
)
DEVICE_HEAD = (
    "device",
    "GPUs",
    "sold as",
    "usable",
    "peak/GPU",
    "device peak",
    "fits",
    "headroom",
    largest_label(False),
)


def device_head(on_device: bool) -> tuple[str, ...]:
    """The device table's head (the report's and ``estimate --devices``'): its last column is
    :func:`~ledgerspec.faces.report.data.largest_label`'s."""
    return (*DEVICE_HEAD[:-1], largest_label(on_device))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return format_size(n) if n >= 0 else "-" + format_size(-n)


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fit_cells(r: FitRow) -> tuple[str, ...]:
    return (
        r.name,
        r.on_device_text(),
        _count(r.largest),
        _size(r.peak),
        _count(r.above),
        _size(r.peak_above),
        _size(r.device_memory),
        r.note,
    )


def _device_cells(r: DeviceRow) -> tuple[str, ...]:
    fits = r.fits_text
    return (
        r.name,
        str(r.gpus),
        r.vendor_memory,
        _size(r.memory),
        _size(r.peak),
        _size(r.device_peak),
        fits,
        _size(r.headroom),
        r.largest_text,
    )


AT_PEAK_NOTE = "temporary/runtime: what no component owns (fp32 logits and loss, gradients in flight, workspaces)"


def _at_peak_title(d: ReportData) -> str:
    return f"alive at the estimated peak ({d.at_peak_phase}, {format_size(sum(n for _, n in d.at_peak))})"


def _plain_table(out: TextIO, head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last column wraps to fit :data:`PLAIN_WIDTH`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    left = 2 + sum(w + 2 for w in widths[:-1])
    last = max(_MIN_DETAIL, PLAIN_WIDTH - left)
    for row in (head, *rows):
        lines = textwrap.wrap(row[-1], last, break_long_words=True, break_on_hyphens=False) or [""]
        cells = [c.ljust(widths[i]) for i, c in enumerate(row[:-1])]
        out.write(("  " + "  ".join([*cells, lines[0]])).rstrip() + "\n")
        for more in lines[1:]:
            out.write(" " * left + more + "\n")


# -- rich -------------------------------------------------------------------------------------------
def render_rich(
    d: ReportData, out: TextIO, width: int = BAR_WIDTH, color: bool | None = None, verbose: bool = False
) -> None:
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # markup and emoji codes off: a note such as "[/red]" or "[link=...]" is text, never a style or a hidden link
    # (every user string is already `shown`: no control character reaches the terminal)
    console = Console(
        file=out,
        force_terminal=color,
        no_color=color is False,
        highlight=False,
        markup=False,
        emoji=False,
        width=None if out.isatty() else 120,
    )
    verdict = Text()
    if d.verdict is not None:
        answer = d.verdict.answer
        verdict.append(f" {answer} ", style=VERDICT_STYLES.get(answer, "bold"))
        verdict.append(" " + _verdict_line(d)[len(answer) :].lstrip(" :"), style="bold")
    else:
        verdict.append(" UNKNOWN ", style=VERDICT_STYLES["UNKNOWN"])
    console.print(verdict)
    head = Text(d.path, style="bold")
    head.append(f"  {d.kind}/v1")
    if d.title:
        head.append(f"  {d.title}", style="italic")
    console.print(head)
    status = Text("status ")
    status.append(d.supported_status, style=STATUS_STYLES.get(d.supported_status, "bold"))
    status.append(f" (declared: {d.declared_status or 'none declared'})")
    console.print(status)
    for step in _step_lines(d, verbose):
        console.print(Text(step))
    for title, head_cells, rows in (
        ("largest that fits (estimate --fit)", FIT_HEAD, [_fit_cells(r) for r in d.fits]),
        (
            "which device (estimate --devices)",
            device_head(decided_on_device(d.devices)),
            [_device_cells(r) for r in d.devices],
        ),
    ):
        if rows:
            t = Table(title=title, title_justify="left", box=SIMPLE_HEAD)
            for col in head_cells:
                t.add_column(col, overflow="fold")
            for cells_ in rows:
                t.add_row(*cells_)
            console.print()
            console.print(t)
    if d.devices and d.devices_note:
        console.print(Text(f"  {d.devices_note}"))
    if d.what_if_device:
        console.print()
        console.print(Text(f"what if (estimate --what-if): {d.what_if_device}"))

    table = Table(title="memory components (ledger)", title_justify="left", box=SIMPLE_HEAD)
    for col in ("component", "value", "source"):
        table.add_column(col, no_wrap=True)
    table.add_column("method / note", overflow="fold")  # wraps: the method is meant to be read whole
    for e in d.components:
        table.add_row(COMPONENT_LABELS.get(e.name, e.name), e.display, _src(e.source), _flat(e.detail))
    console.print()
    console.print(table)

    bar = layout(d)
    if bar is not None:
        spans, cap, peak = _bar_cells(bar, width)
        line = Text("[")
        used = 0
        for e, n in spans:
            line.append(COMPONENT_CODES[e.name] * n, style=COMPONENT_STYLES[e.name])
            used += n
        if cap is not None:
            line.append("·" * max(cap - used, 0), style="bright_black")
            line.append("|", style="bold red")
            used = max(used, cap + 1)
        line.append(" " * max(width - used, 0))
        line.append("]")
        console.print()
        console.print(line)
        prov = Text(" ")
        for e, n in spans:
            prov.append(PROVENANCE_CODES.get(e.source, "?") * n, style=RICH_STYLES.get(e.source, "default"))
        console.print(prov)
        if peak is not None:
            console.print(Text(" " + " " * peak + "^ best peak", style="bold"))
        legend = Text()
        for e, _ in spans:
            legend.append(f" {COMPONENT_CODES[e.name]} ", style=COMPONENT_STYLES[e.name])
            legend.append(f" {COMPONENT_LABELS[e.name]} ({e.source})  ")
        console.print(legend)
        console.print(Text(_provenance_legend(spans), style="bright_black"))
    for text in _bar_caption(d):
        console.print(Text(text))

    if d.figures:
        t = Table(title="other figures", title_justify="left", box=SIMPLE_HEAD)
        t.add_column("field", overflow="fold")
        for col in ("value", "source"):
            t.add_column(col, no_wrap=True)
        t.add_column("method / note", overflow="fold")
        for e in d.figures:
            t.add_row(e.key, e.display, _src(e.source), _flat(e.detail))
        console.print()
        console.print(t)
    head_line, notable = _inputs_summary(d)
    console.print()
    console.print(Text(head_line))
    for e in notable:
        row = Text(f"  {e.key}: ")
        if e.display != e.source:
            row.append(f"{e.display} ")
        row.append_text(_src(e.source))
        if e.detail:
            row.append(f" {_flat(e.detail)}")
        console.print(row)
    if d.has_phases:
        t = Table(title=_phases_title(d), title_justify="left", box=SIMPLE_HEAD)
        for col in _phase_head(d):
            t.add_column(col)
        for p in d.phases:
            t.add_row(*_phase_cells(d, p))
        console.print()
        console.print(t)
        if d.has_device_phases:
            console.print(Text(f"  ({DEVICE_PHASES_NOTE})"))
    if d.at_peak:
        t = Table(box=SIMPLE_HEAD)
        t.add_column("component")
        t.add_column("alive", justify="right")
        for name, n in d.at_peak:
            t.add_row(COMPONENT_LABELS.get(name, name), format_size(n))
        console.print()
        console.print(Text(_at_peak_title(d), style="italic"))
        console.print(t)
        console.print(Text(f"  ({AT_PEAK_NOTE})"))
    console.print()
    console.print(Text(_finding_line(d)))
    for f in d.findings:
        if f.severity != INFO:
            style = "red" if f.severity == ERROR else "dark_orange"
            console.print(Text(f"  {f.line}:{f.column} {f.rule} {f.severity}: {f.message}", style=style))


def _style(source: str) -> str:
    """The rich colour of a provenance word (a word that is none, which validate reports, in grey)."""
    return RICH_STYLES.get(source, "bright_black")


def _src(source: str) -> Any:
    from rich.text import Text

    return Text(source, style=RICH_STYLES.get(source, "default"))


def render_terminal(
    d: ReportData, out: TextIO, plain: bool = False, color: bool | None = None, verbose: bool = False
) -> None:
    """rich when installed (and not ``plain``), else plain text; ``verbose``: every status reason."""
    if not plain:
        try:
            import rich  # noqa: F401
        except ImportError:
            plain = True
    if plain:
        render_plain(d, out, verbose=verbose)
    else:
        render_rich(d, out, color=color, verbose=verbose)
