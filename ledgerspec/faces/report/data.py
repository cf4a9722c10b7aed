"""What ``ledgerspec report`` shows, read from the core API (``Document``, ``validate``) and nothing else.

This module only gathers: every figure, source and status comes from :class:`Document`,
:func:`~ledgerspec.checks.validate.validate` and the ladder's :func:`best_peak`. The terminal and
HTML renderers (``terminal``, ``html``) draw this data and compute nothing of their own. Every user string in it
is already :func:`shown` (one line, no control character or escape sequence): the renderers print it as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ledgerspec.checks.findings import ERROR, INFO, WARNING, Finding
from ledgerspec.checks.ladder import best_peak
from ledgerspec.checks.validate import Report, validate
from ledgerspec.checks.verdict import Step, Verdict, next_status, next_steps
from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document
from ledgerspec.contract.units import format_size
from ledgerspec.contract.values import Value
from ledgerspec.errors import LedgerspecError, printable

#: the memory components of the ledger, in the order they stack
COMPONENTS = F.COMPONENTS
COMPONENT_LABELS = {
    "frozen_base": "frozen base",
    "adapter": "adapter",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "temporary": "temporary/runtime",
    "calculated_subtotal": "calculated subtotal",
}
#: one letter per component, for the plain-text bar
COMPONENT_CODES = {
    "frozen_base": "B",
    "adapter": "A",
    "gradients": "G",
    "optimizer": "O",
    "activations": "X",
    "temporary": "T",
}
#: provenance words in the order of the legend; DECLARED is a plain configuration input (no source written)
PROVENANCE = ("MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION", "CONFIGURATION-SPECIFIC", "UNKNOWN", "DECLARED")
PHASE_LABELS = {
    "after_load": "after load",
    "after_adapter_injection": "after adapter injection",
    "after_optimizer_init": "after optimizer init",
    "generation_peak": "generation peak",
    "forward_peak": "forward peak",
    "backward_peak": "backward peak",
    "optimizer_step_peak": "optimizer-step peak",
    "steady_state_peak": "steady-state peak",
}
ESTIMATE = "x-estimate"


@dataclass(frozen=True)
class Entry:
    """One field as the report shows it."""

    path: tuple[str, ...]
    display: str  # the value as a reader wants it (sizes with units, counts with separators)
    source: str  # the effective provenance word (see PROVENANCE)
    nbytes: int | None = None  # for memory figures
    detail: str = ""  # `method` or `note`

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def name(self) -> str:
        return self.path[-1]


@dataclass(frozen=True)
class DeviceRow:
    """One accelerator and GPU count of ``x-devices`` (``estimate --devices``)."""

    name: str
    gpus: int
    memory: int  # usable bytes per device the verdict was judged against
    vendor_memory: str  # the memory as the vendor states it (e.g. "24 GB")
    peak: int | None  # predicted peak per device (the worst rank)
    fits: bool | None
    headroom: int | None
    largest_microbatch: int | None
    note: str = ""
    #: at the edge (``uncertain``): it completes only with the typical bytes outside the allocator, so ``fits`` is
    #: false (also for a row an earlier estimate wrote ``fits: true`` beside it)
    edge: bool = False
    #: a NO that fragmentation decided: the bytes free but unusable (``x-devices.rows[].fragmentation``)
    fragmentation: int | None = None
    #: decided on the device: the device-level peak (the allocator model's reserved bytes + what lies outside it)
    device_peak: int | None = None
    #: ``largest_microbatch`` is an upper bound (decided on the device: the allocated tensors against what the
    #: allocator can get; ``x-devices.rows[].largest_at_most``)
    largest_at_most: bool = False

    @property
    def largest_text(self) -> str:
        """The row's largest-microbatch cell: ``<= N`` for an upper bound, "-" when it has none."""
        if self.largest_microbatch is None:
            return "-"
        return f"<= {self.largest_microbatch:,}" if self.largest_at_most else f"{self.largest_microbatch:,}"

    @property
    def fits_text(self) -> str:
        """The row's ``fits`` cell ("-" when it has none)."""
        return "-" if self.fits is None else fits_words(self.fits, self.fragmentation, self.edge)


def decided_on_device(rows: list[DeviceRow]) -> bool:
    """Whether a device table's rows were decided on the device (their largest microbatch an upper bound)."""
    return any(r.largest_at_most for r in rows)


def largest_label(on_device: bool) -> str:
    """The device table's last column, in the terminal and the HTML report alike: the allocated tensors' answer,
    unless the rows were decided on the device (an upper bound, ``<= N``)."""
    return "largest microbatch" if on_device else "largest microbatch (allocated)"


def fits_words(fits: bool, fragmentation: int | None = None, edge: bool = False) -> str:
    """A device row's answer in words, the same in ``estimate --devices`` and both reports: yes or NO, the bytes
    free but unusable when fragmentation decided a NO, and a verdict at the edge."""
    text = "yes" if fits else "NO"
    if not fits and fragmentation is not None:
        text += f" (fragmentation: {format_size(fragmentation)} free but unusable)"
    return text + (" (at the edge)" if edge else "")


@dataclass(frozen=True)
class FitRow:
    """One input of ``x-fit`` (``estimate --fit``): the largest value that fits and the peaks around it."""

    name: str
    largest: int | None
    peak: int | None
    above: int | None
    peak_above: int | None
    device_memory: int | None
    note: str = ""
    #: the largest value that fits on the device (``x-fit.NAME.device.largest``: allocator model + outside the
    #: allocator), when ``estimate --fit`` checked it there; ``checked``: whether it did (then None: none fits)
    on_device: int | None = None
    checked: bool = False

    def on_device_text(self) -> str:
        """The on-device answer as a cell: the value, ``none`` when none checked fits, ``-`` when ``estimate --fit``
        did not check it there (the CPU target)."""
        if not self.checked:
            return "-"
        return "none" if self.on_device is None else f"{self.on_device:,}"


@dataclass(frozen=True)
class PhasePoint:
    name: str
    label: str
    measured: Entry | None
    estimated: Entry | None  # allocated (``x-estimate.phases``)
    #: the estimate's device-level prediction (``estimate`` with a device): the allocator model's reserved bytes
    #: (``x-estimate.reserved_phases``) and reserved plus what lies outside the allocator (``device_phases``)
    reserved: Entry | None = None
    device: Entry | None = None


@dataclass(frozen=True)
class Pair:
    """A calculated (or estimated) figure beside the measured one it is compared with."""

    label: str
    calculated: Entry | None
    measured: Entry | None


@dataclass
class WhatIfData:
    """``x-what-if`` (``estimate --what-if``): the grid's axes and every point's predicted peak, for the sliders."""

    microbatch: list[int]
    max_length: list[int]
    checkpointing: list[bool]
    #: (microbatch, max_length, checkpointing) -> (peak, phase, traced)
    cells: dict[tuple[int, int, bool], tuple[int, str, bool]]
    declared: tuple[int, int, bool]
    device_memory: int | None
    note: str

    def data(self) -> dict[str, object]:
        """What the page's script reads (plain JSON: every key the script uses, nothing else)."""
        return {
            "microbatch": self.microbatch,
            "max_length": self.max_length,
            "checkpointing": self.checkpointing,
            "cells": [
                [b, n, c, peak, phase, traced] for (b, n, c), (peak, phase, traced) in sorted(self.cells.items())
            ],
            "declared": list(self.declared),
            "device_memory": self.device_memory,
        }


@dataclass
class ReportData:
    path: str
    kind: str
    title: str | None
    declared_status: str | None
    supported_status: str
    reasons: list[str]
    findings: list[Finding]
    components: list[Entry]  # the ledger section: the six components, then the subtotal
    figures: list[Entry]  # every other present figure except phases (parameter counts, metrics, comparison ...)
    inputs: list[Entry]  # the configuration inputs (intake sections, figures left out) as written
    capacity: int | None  # the device the components are drawn against
    capacity_label: str | None
    peak: int | None  # the strongest peak figure (the ladder's best_peak)
    peak_label: str | None
    phases: list[PhasePoint] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    explanation: str | None = None
    #: the estimate's split of its peak into what is alive then (``x-estimate.at_peak``): (component, bytes)
    at_peak: list[tuple[str, int]] = field(default_factory=list)
    at_peak_phase: str | None = None
    #: FITS / DOES NOT FIT / UNKNOWN on the target device: the report's first line
    verdict: Verdict | None = None
    #: what the next status needs, one step per kind of missing evidence
    steps: list[Step] = field(default_factory=list)
    next_status: str | None = None
    #: ``estimate --devices`` as stored in ``x-devices``: the catalogue's rows (see :func:`_devices`)
    devices: list[DeviceRow] = field(default_factory=list)
    devices_note: str | None = None
    #: ``estimate --fit`` as stored in ``x-fit``: the largest values that fit, one row per searched input
    fits: list[FitRow] = field(default_factory=list)
    #: ``estimate --what-if`` as stored in ``x-what-if`` (None: absent or unreadable)
    what_if: WhatIfData | None = None
    #: the what-if's answer decided on the device (``x-what-if.device``), in one sentence (None: not checked)
    what_if_device: str | None = None

    @property
    def segments(self) -> list[Entry]:
        """The stacked bar: the components with a known size, in stacking order."""
        return [e for e in self.components if e.name in COMPONENTS and e.nbytes is not None]

    @property
    def missing(self) -> list[Entry]:
        """Components left out of the bar because their size is not known."""
        return [e for e in self.components if e.name in COMPONENTS and e.nbytes is None]

    @property
    def stacked_total(self) -> int:
        return sum(e.nbytes or 0 for e in self.segments)

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def has_phases(self) -> bool:
        return any(p.measured is not None or p.estimated is not None for p in self.phases)

    @property
    def has_device_phases(self) -> bool:
        """The estimate predicted reserved and device-level bytes per phase (``estimate`` asked a verdict)."""
        return any(p.reserved is not None or p.device is not None for p in self.phases)


def shown(text: object) -> str:
    """A user's string as the report shows it, in every form (terminal, plain, HTML): on one line (whitespace runs,
    line breaks included, become one space) and :func:`~ledgerspec.errors.printable` (an escape sequence, a control
    or bidirectional character is shown escaped, never sent to the terminal or into the page)."""
    return printable(" ".join(str(text).split()))


def entry(doc: Document, path: tuple[str, ...], f: F.Field | None = None) -> Entry:
    """Read ``path`` from ``doc`` into an :class:`Entry` (value, provenance, bytes when it is a size)."""
    f = f if f is not None else doc.field(*path)
    v = doc.get(*path)
    figure = f.figure if f is not None else True
    kind = f.kind if f is not None else F.MEMORY
    source = v.effective_source(figure)
    nbytes = v.size() if kind in (F.MEMORY, F.SIZE) else None
    return Entry(path, shown(_display(v, kind, nbytes)), shown(source), nbytes, shown(v.method or v.note or ""))


def _display(v: Value, kind: str, nbytes: int | None) -> str:
    if not v.present:
        return "missing"
    if v.unknown:
        return v.source or "UNKNOWN"
    if nbytes is not None:
        return format_size(nbytes)
    if kind == F.COUNT and v.integer() is not None:
        return f"{v.integer():,}"
    value = v.value
    if isinstance(value, bool):
        return "true" if value else "false"  # as YAML writes it
    if isinstance(value, list):
        return ", ".join(str(x) for x in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {x}" for k, x in value.items())
    return str(value)


def _present_leaves(doc: Document, sections: tuple[F.Field, ...]) -> list[tuple[tuple[str, ...], F.Field]]:
    out = []
    for path, f in F.walk(sections):
        if f.kind != F.OBJECT and doc.get(*path).present:
            out.append((path, f))
    return out


def _estimate(doc: Document, key: str) -> Entry | None:
    """A predicted figure of ``ledgerspec estimate``: ``x-estimate.KEY`` or ``x-estimate.phases.KEY``."""
    for path in ((ESTIMATE, key), (ESTIMATE, "phases", key)):
        if doc.get(*path).present:
            return entry(doc, path, F.Field(key, F.MEMORY, ""))
    return None


def _predicted_on_device(doc: Document, group: str, key: str, peak: str) -> Entry | None:
    """A phase of the estimate's device-level prediction (``x-estimate.GROUP.KEY``), with the provenance of its peak
    figure (``x-estimate.PEAK``: CALCULATED for the allocator model's reserved bytes; the device-level figure is an
    ASSUMPTION when the bytes outside the allocator are)."""
    path = (ESTIMATE, group, key)
    if not doc.get(*path).present:
        return None
    e = entry(doc, path, F.Field(key, F.MEMORY, ""))
    source = doc.get(ESTIMATE, peak).effective_source(True)
    return replace(e, source=shown(source))


def _transient_said(doc: Document, e: Entry) -> Entry:
    """``ledger.temporary`` is MEASURED only (the estimate never writes it: docs "estimate"); where it is missing or
    UNKNOWN and the estimate found what no component owns at its peak (``x-estimate.at_peak.temporary``), the row
    says so rather than stand empty beside it."""
    at_peak = doc.get(ESTIMATE, "at_peak", "temporary")
    if e.path != ("ledger", "temporary") or e.detail or e.nbytes is not None or at_peak.size() is None:
        return e
    phase = doc.get(ESTIMATE, "at_peak", "phase").text()
    where = f" ({shown(phase)})" if phase else ""
    return replace(
        e,
        detail=f"measured only (`ledgerspec measure`); the estimate's transient memory alive at its peak{where}: "
        f"{format_size(at_peak.size() or 0)} (x-estimate.at_peak.temporary)",
    )


def _measured(doc: Document, *path: str) -> Entry | None:
    e = entry(doc, path)
    return e if e.source == "MEASURED" else None


def gather(doc: Document, report: Report | None = None) -> ReportData:
    """Everything the report shows about ``doc``; raises :class:`LedgerspecError` for a bad header."""
    report = report if report is not None else validate(doc)
    if report.supported_status is None or doc.kind is None:
        first = report.findings[0] if report.findings else None
        raise LedgerspecError(
            first.message if first else "not a ledgerspec document",
            doc.path,
            first.line if first else 1,
            first.column if first else 1,
            rule=first.rule if first else "header",
        )
    kind = doc.kind
    ledger_field = F.lookup("ledger", ("ledger",))
    assert ledger_field is not None
    components = [_transient_said(doc, entry(doc, ("ledger", f.name), f)) for f in ledger_field.children]

    sections = tuple(f for f in F.top_fields(kind) if f.kind == F.OBJECT and f.name not in ("ledger", "phases"))
    leaves = _present_leaves(doc, sections)
    inputs = [entry(doc, p, f) for p, f in leaves if p[0] in F.INPUT_SECTION_NAMES and not f.figure]
    figures = [entry(doc, p, f) for p, f in leaves if f.figure and f.kind != F.FIGURES]
    for i, item in enumerate(_per_rank(doc)):
        figures.append(_item_entry(item, i))

    capacity, capacity_label = _capacity(doc)
    peak, peak_label = best_peak(doc)
    phases = [
        PhasePoint(
            name,
            PHASE_LABELS.get(name, name),
            _measured(doc, "phases", name),
            _estimate(doc, name),
            _predicted_on_device(doc, "reserved_phases", name, "peak_reserved"),
            _predicted_on_device(doc, "device_phases", name, "device_peak"),
        )
        for name in PHASE_LABELS
        if name != "generation_peak" or _measured(doc, "phases", name) is not None or _estimate(doc, name) is not None
    ]
    title = doc.get("title").text()
    at_peak, at_peak_phase = _at_peak(doc)
    explanation = doc.get("comparison", "known_explanation").text()
    return ReportData(
        path=printable(doc.path),
        kind=kind,
        title=shown(title) if title is not None else None,
        declared_status=shown(report.declared_status) if report.declared_status is not None else None,
        supported_status=report.supported_status,
        reasons=[shown(r) for r in report.reasons],
        findings=[replace(f, message=shown(f.message), pointer=printable(f.pointer)) for f in report.findings],
        components=components,
        figures=figures,
        inputs=inputs,
        capacity=capacity,
        capacity_label=shown(capacity_label) if capacity_label is not None else None,
        peak=peak,
        peak_label=shown(peak_label) if peak_label is not None else None,
        phases=phases,
        pairs=_pairs(doc, phases),
        explanation=shown(explanation) if explanation is not None else None,
        at_peak=at_peak,
        at_peak_phase=at_peak_phase,
        verdict=report.verdict,
        steps=next_steps(list(report.reasons), doc.path),
        next_status=next_status(report.supported_status),
        devices=_devices(doc),
        devices_note=" ".join(
            t for t in (_edited_since(doc, "x-devices"), doc.get("x-devices", "usable_memory").text()) if t
        ),
        fits=_fit_rows(doc),
        what_if=_what_if(doc, capacity),
        what_if_device=what_if_device(doc),
    )


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _devices(doc: Document) -> list[DeviceRow]:
    """``x-devices.rows`` (written by ``estimate --devices``), malformed rows left out."""
    raw = doc.get("x-devices", "rows").raw
    rows: list[DeviceRow] = []
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        gpus, memory = _int(item.get("gpus")), _int(item.get("memory"))
        if gpus is None or memory is None:
            continue
        fits = item.get("fits")
        edge = item.get("uncertain") is True
        if edge:
            fits = False
        rows.append(
            DeviceRow(
                item["name"],
                gpus,
                memory,
                str(item.get("vendor_memory", "")),
                _int(item.get("peak")),
                fits if isinstance(fits, bool) else None,
                _int(item.get("headroom")),
                _int(item.get("largest_microbatch")),
                str(item.get("note", "")),
                edge,
                _int(item.get("fragmentation")),
                _int(item.get("device_peak")),
                item.get("largest_at_most") is True,
            )
        )
    return rows


def _fit_rows(doc: Document) -> list[FitRow]:
    """``x-fit`` (written by ``estimate --fit``): one row per input searched."""
    raw = doc.get("x-fit").raw
    out: list[FitRow] = []
    stale = _edited_since(doc, "x-fit")
    for name, item in raw.items() if isinstance(raw, dict) else []:
        if not isinstance(item, dict) or "device_memory" not in item:
            continue
        block = item.get("device")
        device: dict[str, object] = block if isinstance(block, dict) else {}
        checked = "checked" in device
        on_device = _int(device.get("largest")) if checked else None
        raw_card = device.get("card")
        card = raw_card if isinstance(raw_card, str) else None
        total = _int(device.get("cuda_total"))
        out.append(
            FitRow(
                str(name),
                _int(item.get("largest")),
                _int(item.get("peak")),
                _int(item.get("above")),
                _int(item.get("peak_above")),
                _int(item.get("device_memory")),
                stale
                or _on_device(checked, on_device, card, total, _int(item.get("device_memory")))
                + str(item.get("note", "")),
                on_device,
                checked,
            )
        )
    return out


def _on_device(
    checked: bool, largest: int | None, card: str | None = None, total: int | None = None, memory: int | None = None
) -> str:
    """The start of a fit row's note when `estimate --fit` checked its answer on the device (`x-fit.NAME.device`):
    the card it was decided on and its CUDA total when they are not the row's device memory alone."""
    if not checked:
        return ""
    named = shown(card) if card else ""
    if total is not None and total != memory:
        named += f"{', its' if named else ''} CUDA total {format_size(total)}"
    where = f"on the device ({named + '; ' if named else ''}allocator model + outside the allocator)"
    if largest is None:
        return f"{where}: none of the values checked fits; "
    return f"{where}: largest {largest}; "


def _what_if(doc: Document, capacity: int | None) -> WhatIfData | None:
    """``x-what-if`` (written by ``estimate --what-if``); None when absent or not a whole grid of readable cells."""
    raw = doc.get("x-what-if").raw
    if not isinstance(raw, dict) or not isinstance(raw.get("axes"), dict) or not isinstance(raw.get("cells"), list):
        return None
    axes = raw["axes"]
    bs = [b for b in axes.get("microbatch") or [] if _int(b) is not None and b > 0]
    ns = [n for n in axes.get("max_length") or [] if _int(n) is not None and n > 0]
    cs = [c for c in axes.get("gradient_checkpointing") or [] if isinstance(c, bool)]
    cells: dict[tuple[int, int, bool], tuple[int, str, bool]] = {}
    for item in raw["cells"]:
        if not isinstance(item, dict):
            continue
        b, n, peak = _int(item.get("microbatch")), _int(item.get("max_length")), _int(item.get("peak"))
        c = item.get("gradient_checkpointing")
        if b is None or n is None or not isinstance(c, bool) or peak is None:
            continue
        cells[(b, n, c)] = (peak, shown(str(item.get("phase", ""))), bool(item.get("traced")))
    if not bs or not ns or not cs or any((b, n, c) not in cells for b in bs for n in ns for c in cs):
        return None
    declared = raw.get("declared")
    declared = declared if isinstance(declared, dict) else {}
    point = (declared.get("microbatch"), declared.get("max_length"), declared.get("gradient_checkpointing"))
    start = point if point in cells else (bs[0], ns[0], cs[0])
    memory = _int(raw.get("device_memory"))
    return WhatIfData(
        sorted(set(bs)),
        sorted(set(ns)),
        sorted(set(cs)),
        cells,
        (int(start[0]), int(start[1]), bool(start[2])),
        capacity if capacity is not None else memory,
        _edited_since(doc, "x-what-if"),
    )


def what_if_device(doc: Document) -> str | None:
    """``x-what-if.device`` (``estimate --what-if`` on a CUDA target: the grid's answer replayed on the device) in one
    sentence; None when absent or unreadable."""
    raw = doc.get("x-what-if").raw
    device = raw.get("device") if isinstance(raw, dict) else None
    if not isinstance(device, dict):
        return None
    memory = _int(raw.get("device_memory"))
    of = f" of {format_size(memory)}" if memory else ""
    items = device.get("checked")
    checked = [c for c in items if isinstance(c, dict)] if isinstance(items, list) else []
    largest = device.get("largest")
    edited = _edited_since(doc, "x-what-if")
    tail = f"; {edited}" if edited else ""
    if isinstance(largest, dict) and largest:
        from ledgerspec.derivations.estimate.sweep import describe  # as the sweep and the what-if name it

        point = describe(largest)
        peak = next((_int(c.get("device_peak")) for c in checked if c.get("point") == largest), None)
        said = f" (device peak {format_size(peak)})" if peak is not None else ""
        return shown(f"largest configuration that fits on the device{of}: {point}{said}{tail}")
    if checked or device.get("not_replayed"):
        return shown(f"no configuration checked fits on the device{of}{tail}")
    return None


def _edited_since(doc: Document, extension: str) -> str:
    """A note when the inputs an ``estimate --fit``/``--devices`` answer was computed from were edited since."""
    from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, changed_sections

    changed = changed_sections(doc, extension, WORKLOAD_INPUTS)
    if not changed:
        return ""
    return f"from other inputs: {', '.join(changed)} changed since (run `ledgerspec estimate` again)"


def _at_peak(doc: Document) -> tuple[list[tuple[str, int]], str | None]:
    """``x-estimate.at_peak`` as (component, bytes) rows and the phase label; nothing when absent or malformed."""
    raw = doc.get(ESTIMATE, "at_peak").raw
    if not isinstance(raw, dict):
        return [], None
    rows = [
        (shown(k), int(v)) for k, v in raw.items() if k != "phase" and isinstance(v, int) and not isinstance(v, bool)
    ]
    phase = raw.get("phase")
    return rows, PHASE_LABELS.get(str(phase), shown(phase)) if phase is not None else None


def _per_rank(doc: Document) -> list[object]:
    v = doc.get("parallelism", "per_rank_peak")
    return list(v.raw) if v.form == "plain" and isinstance(v.raw, list) else []


def _item_entry(item: object, i: int) -> Entry:
    v = Value.of(item)
    nbytes = v.size()
    return Entry(
        ("parallelism", "per_rank_peak", str(i)),
        shown(_display(v, F.MEMORY, nbytes)),
        shown(v.effective_source(True)),
        nbytes,
        shown(v.method or v.note or ""),
    )


def _capacity(doc: Document) -> tuple[int | None, str | None]:
    """The device to draw against: the target device, else the device that was measured."""
    target = doc.get("result", "target_device", "memory")
    if target.size() is not None:
        name = doc.get("result", "target_device", "name").text()
        return target.size(), f"target device{f' {name}' if name else ''}"
    measured = doc.get("measurement", "device_memory")
    if measured.size() is not None:
        name = doc.get("measurement", "device_name").text()
        return measured.size(), f"measured device{f' {name}' if name else ''}"
    return None, None


def _pairs(doc: Document, phases: list[PhasePoint]) -> list[Pair]:
    """Calculated or estimated figures beside their measured counterparts (only where a measurement exists)."""
    pairs: list[Pair] = []
    subtotal = doc.get("comparison", "calculated_subtotal")
    calc = (
        entry(doc, ("comparison", "calculated_subtotal"))
        if subtotal.present
        else entry(doc, ("ledger", "calculated_subtotal"))
    )
    measured_peak = _measured(doc, "comparison", "measured_peak")
    if measured_peak is not None:
        pairs.append(Pair("calculated subtotal vs measured peak", calc, measured_peak))
    for p in phases:
        if p.measured is not None:
            pairs.append(Pair(p.label, p.estimated, p.measured))
    for key in ("peak_allocated", "peak_reserved", "device_peak"):
        measured = _measured(doc, "metrics", key)
        if measured is not None:
            pairs.append(Pair(key.replace("_", " "), _estimate(doc, key), measured))
    return pairs


SEVERITIES = (ERROR, WARNING, INFO)
