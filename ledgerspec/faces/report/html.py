"""The HTML face of ``ledgerspec report --html``: one self-contained file, inline CSS and SVG; a script only for
the what-if sliders, when the ledger holds a what-if grid (``estimate --what-if``).

The page is well-formed XML (XHTML-compatible) so that it can be checked by a parser and embedded
anywhere; it loads nothing from the network. It draws :class:`~ledgerspec.faces.report.data.ReportData`.
"""

from __future__ import annotations

import html
import json

from ledgerspec.checks.findings import ERROR, INFO, WARNING
from ledgerspec.contract.units import format_size
from ledgerspec.errors import printable
from ledgerspec.faces.report.bar import layout
from ledgerspec.faces.report.data import (
    COMPONENT_LABELS,
    PROVENANCE,
    DeviceRow,
    Entry,
    FitRow,
    Pair,
    PhasePoint,
    ReportData,
    WhatIfData,
    decided_on_device,
    largest_label,
    shown,
)
from ledgerspec.version import __version__

#: one colour per provenance word, used for table badges, bar segments and the legend
COLORS = {
    "MEASURED": "#1a7f37",
    "VERIFIED": "#0969da",
    "CALCULATED": "#8250df",
    "ASSUMPTION": "#d4760a",
    "CONFIGURATION-SPECIFIC": "#bf3989",
    "UNKNOWN": "#8c959f",
    "DECLARED": "#57606a",
}
#: one colour per memory component (the Okabe-Ito palette: told apart with colour-vision deficiencies), with
#: the text colour that reads on it; provenance is drawn over it as a pattern (:data:`PATTERNS`)
COMPONENT_COLORS = {
    "frozen_base": ("#0072B2", "#fff"),
    "adapter": ("#E69F00", "#1f2328"),
    "gradients": ("#009E73", "#fff"),
    "optimizer": ("#CC79A7", "#1f2328"),
    "activations": ("#56B4E9", "#1f2328"),
    "temporary": ("#D55E00", "#fff"),
}
#: how each provenance is drawn over a component's colour in the bar, and how the legend says it
PATTERNS = {
    "MEASURED": "solid",
    "VERIFIED": "dotted",
    "CALCULATED": "striped",
    "ASSUMPTION": "cross-hatched, dashed border",
    "CONFIGURATION-SPECIFIC": "horizontal lines, dashed border",
    "UNKNOWN": "not drawn",
    "DECLARED": "not drawn",
}
UNKNOWN_PATTERN = "solid (not a provenance word)"
VERDICT_COLORS = {"FITS": "#1a7f37", "DOES NOT FIT": "#cf222e", "UNKNOWN": "#57606a"}
STATUS_COLORS = {
    "INSUFFICIENT DATA": "#cf222e",
    "CALCULATED": "#8250df",
    "CANDIDATE": "#0969da",
    "VALIDATED": "#1a7f37",
}
MEANINGS = {
    "MEASURED": "read from a real run",
    "VERIFIED": "read off the instantiated stack",
    "CALCULATED": "derived by formula or simulation from exact inputs",
    "ASSUMPTION": "taken without proof (the note says why)",
    "CONFIGURATION-SPECIFIC": "depends on a stack detail not yet known",
    "UNKNOWN": "not known",
    "DECLARED": "a configuration input as written",
}
PHASE_SHORT = {
    "after_load": "load",
    "after_adapter_injection": "adapters",
    "after_optimizer_init": "optim init",
    "generation_peak": "generation",
    "forward_peak": "forward",
    "backward_peak": "backward",
    "optimizer_step_peak": "optim step",
    "steady_state_peak": "steady state",
}

BAR_W, BAR_X = 900, 10
CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2328;margin:0;background:#fff}
main{max-width:960px;margin:0 auto;padding:16px 20px 40px;overflow-wrap:break-word}
h1.verdict{font-size:20px;margin:8px 0 4px;padding:8px 12px;border-radius:6px;color:#fff;line-height:1.35}
h1.verdict .answer{font-size:24px;font-weight:800;margin-right:10px;white-space:nowrap}
h1.verdict .detail{font-weight:500;font-size:16px}
h1.verdict .why{display:block;font-weight:400;font-size:13px;opacity:.9;margin-top:2px}
h1.verdict code{font-size:14px;background:rgba(255,255,255,.18);padding:0 4px;border-radius:3px}
p.title{font-size:18px;font-weight:600;margin:10px 0 2px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
details{margin:4px 0 0;font-size:13.5px}summary{cursor:pointer;color:#57606a}
.path{color:#57606a;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px;margin:0}
.status{display:inline-block;color:#fff;font-weight:700;padding:3px 10px;border-radius:4px;margin:10px 8px 4px 0}
table{border-collapse:collapse;width:100%;font-size:13.5px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eaeef2;vertical-align:top;overflow-wrap:break-word}
td.value,td code{overflow-wrap:anywhere}td.label,td.label code{white-space:nowrap;overflow-wrap:normal}
tr.no td{color:#cf222e}
th{background:#f6f8fa;font-weight:600}
th.num{text-align:right}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.detail{color:#57606a;font-size:12.5px}
.src{display:inline-block;color:#fff;font-size:11px;font-weight:700;padding:1px 6px;border-radius:3px;
white-space:nowrap}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;font-size:12.5px;margin:6px 0}
.legend span.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px;margin-right:4px}
.legend svg{vertical-align:-3px;margin-right:4px}
ul.reasons{margin:4px 0;padding-left:20px;font-size:13.5px}
.muted{color:#57606a;font-size:13px}
.f-error{color:#cf222e}.f-warning{color:#9a6700}.f-info{color:#57606a}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
footer{color:#8c959f;font-size:12px;margin-top:32px}
.whatif .controls{display:flex;flex-wrap:wrap;gap:8px 24px;align-items:center;margin:8px 0}
.whatif label{font-size:13.5px;white-space:nowrap}.whatif input[type=range]{vertical-align:middle;width:180px}
.whatif output{font-weight:700;font-variant-numeric:tabular-nums;display:inline-block;min-width:3.5em}
.whatif input[type=number]{width:5em}
.wi-verdict{color:#fff;font-weight:700;padding:6px 12px;border-radius:6px;font-size:17px;margin:6px 0}
"""


def escape(text: object) -> str:
    """``text`` as HTML text or attribute value (``<``, ``&``, quotes escaped; a control character, which XML
    forbids, or a file name's undecodable byte shown escaped, so the page is well-formed UTF-8 whatever it holds)."""
    return html.escape(printable(str(text)), quote=True)


def colour(source: str) -> str:
    """The colour of a provenance word (one that is none, which validate reports, in the DECLARED grey)."""
    return COLORS.get(source, COLORS["DECLARED"])


def badge(source: str) -> str:
    colour = COLORS.get(source, "#57606a")
    return f'<span class="src src-{escape(source)}" style="background:{colour}">{escape(source)}</span>'


def _entry_cells(e: Entry | None) -> str:
    if e is None:
        return '<td class="num">-</td><td></td>'
    return f'<td class="num">{escape(e.display)}</td><td>{badge(e.source)}</td>'


def render_html(d: ReportData) -> str:
    """The whole report as one HTML document (a string)."""
    title = d.title or d.path
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"/>',
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
        f"<title>{escape(title)} — ledgerspec report</title><style>{CSS}</style></head><body>",
        '<svg xmlns="http://www.w3.org/2000/svg" width="0" height="0" style="position:absolute" aria-hidden="true">'
        f"{_pattern_defs()}</svg><main>",
        _verdict(d),
        f'<p class="title">{escape(title)}</p>',
        f'<p class="path">{escape(d.path)} · {escape(d.kind)}/v1</p>',
        _status(d),
    ]
    if d.fits:
        parts += ["<h2>Largest that fits</h2>", _fits_table(d.fits)]
    if d.devices:
        parts += ["<h2>Which device</h2>", _devices_table(d.devices, d.devices_note)]
    if d.what_if is not None:
        parts += ["<h2>What if</h2>", _what_if(d.what_if)]
        if d.what_if_device:
            parts.append(f'<p class="wi-device">Checked on the device: {escape(d.what_if_device)}</p>')
    parts += [
        "<h2>Memory components</h2>",
        _bar_svg(d),
        _legend(d),
        _components_table(d),
    ]
    if d.has_phases:
        parts += ["<h2>Phase timeline</h2>", _timeline_svg(d.phases, d.capacity)]
    if d.has_device_phases:
        parts += ["<h2>On the device (predicted)</h2>", _device_phases_table(d)]
    if d.at_peak:
        parts += [f"<h2>Alive at the estimated peak ({escape(d.at_peak_phase or '')})</h2>", _at_peak_table(d)]
    if d.pairs:
        parts += ["<h2>Calculated vs measured</h2>", _pairs_table(d.pairs, d.explanation)]
    if d.figures:
        parts += ["<h2>Other figures</h2>", _figures_table(d.figures)]
    parts += [
        "<h2>Configuration inputs</h2>",
        _figures_table(d.inputs, detail_head="note"),
        "<h2>Findings</h2>",
        _findings(d),
        "<h2>Provenance</h2>",
        _provenance_legend(),
        f"<footer>ledgerspec {escape(__version__)} · a self-contained page: "
        f"{'one inline script (the what-if sliders)' if d.what_if is not None else 'no script'}, nothing loaded from "
        "the network</footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _verdict(d: ReportData) -> str:
    """The first line: FITS / DOES NOT FIT / UNKNOWN on the target device, and by how much."""
    v = d.verdict
    if v is None:
        return '<h1 class="verdict" data-verdict="UNKNOWN" style="background:#57606a">UNKNOWN</h1>'
    rest = v.headline()[len(v.answer) :].lstrip(" :")
    why = f'<span class="why">{_code_spans(v.why)}</span>' if v.why and v.answer != "UNKNOWN" else ""
    return (
        f'<h1 class="verdict" data-verdict="{escape(v.answer)}" style="background:{VERDICT_COLORS[v.answer]}">'
        f'<span class="answer">{escape(v.answer)}</span><span class="detail">{_code_spans(rest)}</span>{why}</h1>'
    )


def _code_spans(text: str) -> str:
    """``text`` escaped, with its `backticked` commands as <code>."""
    parts = escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)) if len(parts) % 2 else escape(text)


def _status(d: ReportData) -> str:
    color = STATUS_COLORS.get(d.supported_status, "#57606a")
    out = [
        f'<div><span class="status" data-status="{escape(d.supported_status)}" style="background:{color}">'
        f'{escape(d.supported_status)}</span><span class="muted">supported by the evidence · declared: '
        f"{escape(d.declared_status or 'none declared')}</span></div>"
    ]
    if d.steps:
        head = f"To reach {d.next_status}" if d.next_status else "What holds it down"
        out.append(f'<p class="muted">{escape(head)}:</p><ul class="reasons steps">')
        out += [f"<li>{_code_spans(shown(step.line()))}</li>" for step in d.steps]
        out.append("</ul>")
        out.append(
            f'<details class="reasons"><summary>Every reason ({len(d.reasons)})</summary><ul class="reasons">'
            + "".join(f"<li>{escape(r)}</li>" for r in d.reasons)
            + "</ul></details>"
        )
    return "\n".join(out)


def _fit_on_device(r: FitRow) -> str:
    """:meth:`FitRow.on_device_text`, a value in bold (the answer to act on)."""
    text = r.on_device_text()
    return f"<strong>{text}</strong>" if r.on_device is not None else text


def _fits_table(rows: list[FitRow]) -> str:
    out = [
        '<table class="fit"><thead><tr><th>input</th><th class="num">on the device</th>'
        '<th class="num">allocated: largest</th><th class="num">its peak</th><th class="num">the next value</th>'
        '<th class="num">its peak</th><th class="num">device</th><th>note</th></tr></thead><tbody>'
    ]
    for r in rows:
        out.append(
            f'<tr><td class="label"><code>{escape(r.name)}</code></td><td class="num">{_fit_on_device(r)}</td>'
            f'<td class="num">{_opt(r.largest)}</td>'
            f'<td class="num">{_size(r.peak)}</td><td class="num">{_opt(r.above)}</td>'
            f'<td class="num">{_size(r.peak_above)}</td><td class="num">{_size(r.device_memory)}</td>'
            f'<td class="detail">{escape(r.note)}</td></tr>'
        )
    out.append("</tbody></table>")
    return "\n".join(out)


def _devices_table(rows: list[DeviceRow], note: str | None) -> str:
    out = [
        '<table class="devices"><thead><tr><th>device</th><th class="num">GPUs</th><th class="num">memory '
        '(vendor)</th><th class="num">usable</th><th class="num">peak per GPU</th><th class="num">device peak</th>'
        f'<th>fits</th><th class="num">headroom</th><th class="num">{escape(largest_label(decided_on_device(rows)))}'
        "</th></tr></thead><tbody>"
    ]
    for r in rows:
        fits = "" if r.fits is None else escape(r.fits_text)
        cls = "" if r.fits is None else (' class="yes"' if r.fits else ' class="no"')
        out.append(
            f'<tr{cls}><td>{escape(r.name)}</td><td class="num">{r.gpus}</td>'
            f'<td class="num">{escape(r.vendor_memory)}</td><td class="num">{_size(r.memory)}</td>'
            f'<td class="num">{_size(r.peak)}</td><td class="num">{_size(r.device_peak)}</td><td>{fits}</td>'
            f'<td class="num">{_size(r.headroom)}</td><td class="num">{escape(r.largest_text)}</td></tr>'
        )
    out.append("</tbody></table>")
    if note:
        out.append(f'<p class="muted">{escape(note)}</p>')
    return "\n".join(out)


#: the what-if sliders: reads the grid from the section's ``data-grid``, shows the chosen cell; a starting point may
#: come from the address (``#what-if=microbatch:4,max_length:2048,gradient_checkpointing:on,memory_gib:24``). Kept
#: well-formed XML (inside CDATA, no ``]]>``) and without a network or storage access.
WHAT_IF_SCRIPT = """//<![CDATA[
(function () {
  var root = document.getElementById("what-if");
  if (!root) { return; }
  var g = JSON.parse(root.getAttribute("data-grid"));
  var cells = {};
  g.cells.forEach(function (c) { cells[c[0] + "/" + c[1] + "/" + c[2]] = c; });
  var el = function (id) { return document.getElementById(id); };
  var GiB = 1073741824;
  function size(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = Math.abs(n);
    while (v >= 1024 && i !== units.length - 1) { v /= 1024; i += 1; }
    return (n >= 0 ? "" : "\u2212") + (i === 0 ? String(v) : v.toFixed(2)) + " " + units[i];
  }
  function set(point) {
    var b = g.microbatch.indexOf(point[0]), n = g.max_length.indexOf(point[1]);
    if (b >= 0) { el("wi-b").value = b; }
    if (n >= 0) { el("wi-n").value = n; }
    el("wi-c").checked = point[2] === true;
  }
  function fromAddress() {
    var m = /what-if=([^&]*)/.exec(decodeURIComponent(window.location.hash || ""));
    if (!m) { return; }
    var p = g.declared.slice();
    m[1].split(",").forEach(function (kv) {
      var parts = kv.split(":"), k = parts[0], v = parts[1];
      if (k === "microbatch") { p[0] = parseInt(v, 10); }
      if (k === "max_length") { p[1] = parseInt(v, 10); }
      if (k === "gradient_checkpointing") { p[2] = (v === "on" || v === "true"); }
      if (k === "memory_gib") { el("wi-m").value = v; }
    });
    set(p);
  }
  function show() {
    var b = g.microbatch[el("wi-b").value], n = g.max_length[el("wi-n").value], c = el("wi-c").checked;
    var cell = cells[b + "/" + n + "/" + c];
    el("wi-b-v").textContent = String(b);
    el("wi-n-v").textContent = String(n);
    el("wi-peak").textContent = size(cell[3]);
    el("wi-phase").textContent = cell[4];
    el("wi-how").textContent = cell[5] ? "traced" : "microbatch model";
    var gib = parseFloat(el("wi-m").value);
    var v = el("wi-verdict");
    if (!(gib > 0)) {
      v.textContent = "UNKNOWN: no device memory";
      v.setAttribute("data-verdict", "UNKNOWN");
      v.style.background = "#57606a";
      el("wi-headroom").textContent = "-";
      return;
    }
    var memory = Math.round(gib * GiB), headroom = memory - cell[3], fits = headroom >= 0;
    v.setAttribute("data-verdict", fits ? "FITS" : "DOES NOT FIT");
    v.style.background = fits ? "#1a7f37" : "#cf222e";
    v.textContent = (fits ? "FITS" : "DOES NOT FIT") + ": peak " + size(cell[3]) + " on " + size(memory) +
      (fits ? ", headroom " + size(headroom) : ", short by " + size(-headroom)) + " (" + cell[4] + ")";
    el("wi-headroom").textContent = size(headroom);
  }
  ["wi-b", "wi-n", "wi-c", "wi-m"].forEach(function (id) { el(id).addEventListener("input", show); });
  window.addEventListener("hashchange", function () { fromAddress(); show(); });
  fromAddress();
  show();
})();
//]]>"""


def _what_if(w: WhatIfData) -> str:
    """The sliders over ``x-what-if`` and what they show (without a script: the declared point, as text)."""
    b0, n0, c0 = w.declared
    peak, phase, traced = w.cells[w.declared]
    memory = "" if w.device_memory is None else f"{w.device_memory / 2**30:g}"
    grid = escape(json.dumps(w.data(), separators=(",", ":")))
    checked = ' checked="checked"' if c0 else ""
    note = f'<p class="muted">{escape(w.note)}</p>' if w.note else ""
    return "\n".join(
        [
            f'<div class="whatif" id="what-if" data-grid="{grid}">',
            '<p class="muted">Move the sliders: the predicted peak of each configuration (<code>ledgerspec estimate '
            "--what-if</code>: traced estimates, and the microbatch model between them), against the device memory. "
            "Allocated tensors only: the CUDA context, allocator cache and fragmentation need headroom too.</p>",
            note,
            '<div class="controls">',
            f'<label>microbatch <input type="range" id="wi-b" min="0" max="{len(w.microbatch) - 1}" step="1" '
            f'value="{w.microbatch.index(b0)}"/> <output id="wi-b-v">{b0}</output></label>',
            f'<label>max_length <input type="range" id="wi-n" min="0" max="{len(w.max_length) - 1}" step="1" '
            f'value="{w.max_length.index(n0)}"/> <output id="wi-n-v">{n0}</output></label>',
            f'<label><input type="checkbox" id="wi-c"{checked}/> gradient checkpointing</label>',
            f'<label>device memory <input type="number" id="wi-m" min="0" step="0.5" value="{memory}"/> GiB</label>',
            "</div>",
            f'<div class="wi-verdict" id="wi-verdict" data-verdict="UNKNOWN" style="background:#57606a">declared: '
            f"peak {_size(peak)} ({escape(phase)})</div>",
            '<table class="whatif-cell"><thead><tr><th class="num">predicted peak</th><th>peak phase</th>'
            '<th class="num">headroom</th><th>how</th></tr></thead><tbody><tr>'
            f'<td class="num" id="wi-peak">{_size(peak)}</td><td id="wi-phase">{escape(phase)}</td>'
            f'<td class="num" id="wi-headroom">-</td><td id="wi-how">{"traced" if traced else "microbatch model"}</td>'
            "</tr></tbody></table>",
            "</div>",
            f"<script>{WHAT_IF_SCRIPT}</script>",
        ]
    )


def _opt(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return escape(format_size(n) if n >= 0 else "−" + format_size(-n))


def _bar_svg(d: ReportData) -> str:
    bar = layout(d)
    if bar is None:
        missing = ", ".join(COMPONENT_LABELS[e.name] for e in d.missing)
        return (
            f'<p class="muted">No component has a known size yet ({escape(missing)}): <code>ledgerspec resolve'
            "</code> derives the exact ones.</p>"
        )
    h = 118
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="bar" width="100%" viewBox="0 0 {BAR_W + 2 * BAR_X} {h}" '
        f'role="img" aria-label="stacked memory components" data-scale="{bar.scale}" '
        f'data-bar-width="{BAR_W}">',
    ]
    if bar.capacity is not None:
        out.append(
            f'<rect class="room" x="{BAR_X}" y="28" width="{bar.capacity * BAR_W:.3f}" height="40" '
            'fill="#f6f8fa" stroke="#d0d7de"/>'
        )
    for s in bar.spans:
        x, w = BAR_X + s.start * BAR_W, s.width * BAR_W
        label = COMPONENT_LABELS[s.entry.name]
        fill, ink = COMPONENT_COLORS[s.entry.name]
        source = s.entry.source
        dashed = ' stroke-dasharray="4 2"' if source in ("ASSUMPTION", "CONFIGURATION-SPECIFIC") else ""
        out.append(
            f'<rect class="seg" data-component="{escape(s.entry.name)}" data-bytes="{s.entry.nbytes}" '
            f'data-source="{escape(source)}" x="{x:.3f}" y="28" width="{w:.3f}" height="40" '
            f'fill="{fill}" stroke="#1f2328" stroke-width="1"{dashed}>'
            f"<title>{escape(label)}: {escape(s.entry.display)} ({escape(source)})</title></rect>"
        )
        if source in _PATTERN_IDS:
            out.append(
                f'<rect class="provenance" x="{x:.3f}" y="28" width="{w:.3f}" height="40" '
                f'fill="url(#{_PATTERN_IDS[source]})" pointer-events="none"/>'
            )
        if w > 7.5 * len(label) + 10:
            out.append(
                f'<text x="{x + w / 2:.1f}" y="53" text-anchor="middle" fill="{ink}" font-size="13" '
                f'font-weight="700" paint-order="stroke" stroke="{fill}" stroke-width="3">{escape(label)}</text>'
            )
    total_x = BAR_X + bar.stacked * BAR_W
    out.append(
        f'<text x="{BAR_X}" y="18" font-size="13" fill="#1f2328">stacked components '
        f"{escape(format_size(d.stacked_total))}</text>"
    )
    if bar.capacity is not None and d.capacity is not None:
        cx = BAR_X + bar.capacity * BAR_W
        over = d.stacked_total - d.capacity
        label = f"{d.capacity_label}: {format_size(d.capacity)}"
        if over > 0:
            label += f" — the stacked components exceed it by {format_size(over)}"
        out.append(
            f'<line class="capacity" x1="{cx:.3f}" y1="24" x2="{cx:.3f}" y2="74" stroke="#cf222e" '
            'stroke-width="2" stroke-dasharray="4 3"/>'
        )
        x, anchor = _label_at(cx, label)
        out.append(
            f'<text x="{x:.1f}" y="88" text-anchor="{anchor}" font-size="12.5" fill="#cf222e">{escape(label)}</text>'
        )
    if bar.peak is not None and d.peak is not None:
        px = BAR_X + bar.peak * BAR_W
        label = f"best peak {format_size(d.peak)} · {d.peak_label}"
        x, anchor = _label_at(px, label)
        out.append(f'<path class="peak" d="M{px:.3f} 70 l-6 10 h12 z" fill="#1f2328"/>')
        out.append(
            f'<text x="{x:.1f}" y="108" text-anchor="{anchor}" font-size="12.5" fill="#1f2328">{escape(label)}</text>'
        )
    out.append(f'<line x1="{total_x:.3f}" y1="28" x2="{total_x:.3f}" y2="68" stroke="#1f2328" stroke-width="1"/>')
    out.append("</svg>")
    return "\n".join(out)


#: the SVG pattern drawn over a component's colour for each provenance (MEASURED: none, solid colour)
_PATTERN_IDS = {
    "VERIFIED": "prov-verified",
    "CALCULATED": "prov-calculated",
    "ASSUMPTION": "prov-assumption",
    "CONFIGURATION-SPECIFIC": "prov-configuration-specific",
}


def _pattern_defs() -> str:
    """The provenance patterns: white marks over the component's colour (dots, stripes, cross-hatch, lines)."""
    ink = 'stroke="#fff" stroke-opacity="0.75"'
    return (
        "<defs>"
        '<pattern id="prov-verified" width="6" height="6" patternUnits="userSpaceOnUse">'
        '<circle cx="3" cy="3" r="1.3" fill="#fff" fill-opacity="0.8"/></pattern>'
        '<pattern id="prov-calculated" width="7" height="7" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="7" {ink} stroke-width="2.2"/></pattern>'
        '<pattern id="prov-assumption" width="7" height="7" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="7" {ink} stroke-width="1.6"/>'
        f'<line x1="0" y1="0" x2="7" y2="0" {ink} stroke-width="1.6"/></pattern>'
        '<pattern id="prov-configuration-specific" width="6" height="6" patternUnits="userSpaceOnUse">'
        f'<line x1="0" y1="3" x2="6" y2="3" {ink} stroke-width="1.6"/></pattern>'
        "</defs>"
    )


def _swatch(fill: str, source: str) -> str:
    """A small square in the legend: a component's colour with a provenance's pattern."""
    dashed = ' stroke-dasharray="3 1.5"' if source in ("ASSUMPTION", "CONFIGURATION-SPECIFIC") else ""
    mark = f'<rect width="14" height="14" fill="url(#{_PATTERN_IDS[source]})"/>' if source in _PATTERN_IDS else ""
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="14" height="14" viewBox="0 0 14 14">'
        f'<rect width="14" height="14" fill="{fill}" stroke="#1f2328" stroke-width="1"{dashed}/>{mark}</svg>'
    )


def _label_at(x: float, label: str, char_px: float = 7.0) -> tuple[float, str]:
    """Where a label beside the mark at ``x`` fits inside the bar's width: right of it, left of it, or flush left."""
    width = len(label) * char_px
    if x + 6 + width <= BAR_X + BAR_W:
        return x + 6, "start"
    if x - 6 - width >= 0:
        return x - 6, "end"
    return BAR_X, "start"


def _legend(d: ReportData) -> str:
    """The components (colour) with their provenance (pattern), then what each pattern means."""
    items = [
        f'<span data-component="{escape(e.name)}">{_swatch(COMPONENT_COLORS[e.name][0], e.source)}'
        f"{escape(COMPONENT_LABELS[e.name])} {escape(e.display)} ({escape(e.source)})</span>"
        for e in d.segments
    ]
    if d.missing and d.segments:
        items.append(
            '<span class="muted">not in the bar: '
            + ", ".join(f"{escape(COMPONENT_LABELS[e.name])} ({escape(e.display)})" for e in d.missing)
            + "</span>"
        )
    if d.capacity is None and d.segments:
        items.append('<span class="muted">no device memory given (result.target_device.memory)</span>')
    sources = list(dict.fromkeys(e.source for e in d.segments))
    key = "".join(
        f'<span class="muted">{_swatch("#8c959f", s)}{escape(s)}: {escape(PATTERNS.get(s, UNKNOWN_PATTERN))}</span>'
        for s in sources
    )
    explain = (
        f'<div class="legend"><span class="muted">colour = component; pattern = provenance:</span>{key}</div>'
        if sources
        else ""
    )
    return '<div class="legend">' + "".join(items) + "</div>" + explain


def _components_table(d: ReportData) -> str:
    rows = [
        '<table><thead><tr><th>component</th><th class="num">value</th><th class="num">bytes</th>'
        "<th>source</th><th>method / note</th></tr></thead><tbody>"
    ]
    for e in d.components:
        nbytes = f"{e.nbytes:,}" if e.nbytes is not None else ""
        rows.append(
            f'<tr data-component="{escape(e.name)}">'
            f'<td class="label">{escape(COMPONENT_LABELS.get(e.name, e.name))}</td>'
            f'<td class="num">{escape(e.display)}</td><td class="num">{nbytes}</td><td>{badge(e.source)}</td>'
            f'<td class="detail">{escape(e.detail)}</td></tr>'
        )
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _device_phases_table(d: ReportData) -> str:
    """Per phase, the estimate's allocated bytes beside the allocator model's reserved bytes and the device-level
    bytes (reserved + outside the allocator), and the measured figure where there is one."""
    rows = [
        '<table class="device-phases"><thead><tr><th>phase</th><th class="num">allocated</th>'
        '<th class="num">reserved</th><th></th><th class="num">device-level</th><th></th>'
        '<th class="num">measured</th></tr></thead><tbody>'
    ]
    for p in d.phases:
        allocated = escape(p.estimated.display) if p.estimated is not None else "-"
        measured = escape(p.measured.display) if p.measured is not None else "-"
        rows.append(
            f'<tr data-phase="{escape(p.name)}"><td>{escape(p.label)}</td><td class="num">{allocated}</td>'
            f'{_entry_cells(p.reserved)}{_entry_cells(p.device)}<td class="num">{measured}</td></tr>'
        )
    rows.append(
        '</tbody></table><p class="muted">Allocated: the tensors (x-estimate.phases). Reserved: the segments of '
        "PyTorch's caching allocator, modelled by replaying the step's allocations (x-estimate.reserved_phases). "
        "Device-level: reserved plus what lies outside the allocator, the CUDA context and modules, NCCL's buffers "
        "(x-estimate.device_phases). Predicted, not measured: <code>ledgerspec measure --device cuda</code> measures "
        "them.</p>"
    )
    return "\n".join(rows)


def _at_peak_table(d: ReportData) -> str:
    rows = [
        '<table><thead><tr><th>component</th><th class="num">alive</th><th class="num">bytes</th></tr></thead><tbody>'
    ]
    for name, n in d.at_peak:
        rows.append(
            f'<tr><td>{escape(COMPONENT_LABELS.get(name, name))}</td><td class="num">{escape(format_size(n))}</td>'
            f'<td class="num">{n:,}</td></tr>'
        )
    rows.append(
        '</tbody></table><p class="muted">From the estimate (x-estimate.at_peak); they add up to the '
        "predicted peak. Temporary: what no component owns (fp32 logits and loss, gradients in flight, "
        "attention and dequantization workspaces).</p>"
    )
    return "\n".join(rows)


def _figures_table(entries: list[Entry], detail_head: str = "method / note") -> str:
    if not entries:
        return '<p class="muted">none</p>'
    rows = [
        f"<table><thead><tr><th>field</th><th>value</th><th>source</th><th>{escape(detail_head)}</th></tr></thead><tbody>"
    ]
    for e in entries:
        rows.append(
            f'<tr><td><code>{escape(e.key)}</code></td><td class="value">{escape(e.display)}</td>'
            f"<td>{badge(e.source)}</td>"
            f'<td class="detail">{escape(e.detail)}</td></tr>'
        )
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _pairs_table(pairs: list[Pair], explanation: str | None) -> str:
    rows = [
        "<table><thead><tr><th>figure</th><th>calculated / estimated</th><th></th><th>measured</th><th></th>"
        "<th>measured − calculated</th></tr></thead><tbody>"
    ]
    for p in pairs:
        diff = ""
        if (
            p.calculated is not None
            and p.calculated.nbytes is not None
            and p.measured is not None
            and p.measured.nbytes is not None
        ):
            delta = p.measured.nbytes - p.calculated.nbytes
            sign = "+" if delta >= 0 else "−"
            diff = f"{sign}{format_size(abs(delta))}"
        rows.append(
            f"<tr><td>{escape(p.label)}</td>{_entry_cells(p.calculated)}{_entry_cells(p.measured)}"
            f'<td class="num">{escape(diff)}</td></tr>'
        )
    rows.append("</tbody></table>")
    if explanation:
        rows.append(f'<p class="muted">Known explanation: {escape(explanation)}</p>')
    return "\n".join(rows)


def _timeline_svg(phases: list[PhasePoint], capacity: int | None) -> str:
    values = [e.nbytes for p in phases for e in (p.measured, p.estimated) if e is not None and e.nbytes is not None]
    top = max([*values, capacity or 0, 1])
    w, h, left, bottom, plot_h = 940, 300, 80, 250, 210
    col = (w - left - 10) / len(phases)
    y = lambda n: bottom - n / top * plot_h  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="100%" viewBox="0 0 {w} {h}" '
        'role="img" aria-label="phase timeline">'
    ]
    for i in range(5):
        n = top * i / 4
        out.append(f'<line x1="{left}" y1="{y(n):.1f}" x2="{w - 10}" y2="{y(n):.1f}" stroke="#eaeef2"/>')
        out.append(
            f'<text x="{left - 6}" y="{y(n) + 4:.1f}" text-anchor="end" font-size="11" fill="#57606a">'
            f"{escape(format_size(round(n)))}</text>"
        )
    if capacity:
        out.append(
            f'<line class="capacity" x1="{left}" y1="{y(capacity):.1f}" x2="{w - 10}" y2="{y(capacity):.1f}" '
            'stroke="#cf222e" stroke-dasharray="4 3" stroke-width="1.5"/>'
        )
        out.append(
            f'<text x="{w - 12}" y="{y(capacity) - 5:.1f}" text-anchor="end" font-size="11" fill="#cf222e">'
            f"device {escape(format_size(capacity))}</text>"
        )
    points = []
    for i, p in enumerate(phases):
        x0 = left + i * col
        for j, (e, kind) in enumerate(((p.estimated, "estimated"), (p.measured, "measured"))):
            if e is None or e.nbytes is None:
                continue
            bx, bw = x0 + col * (0.18 + 0.32 * j), col * 0.3
            color = colour(e.source) if kind == "measured" else COLORS["CALCULATED"]
            fill = color if kind == "measured" else "#fff"
            out.append(
                f'<rect class="phase {kind}" data-phase="{escape(p.name)}" data-bytes="{e.nbytes}" '
                f'x="{bx:.1f}" y="{y(e.nbytes):.1f}" width="{bw:.1f}" height="{bottom - y(e.nbytes):.1f}" '
                f'fill="{fill}" stroke="{color}" stroke-width="1.5">'
                f"<title>{escape(p.label)} {kind}: {escape(e.display)} ({escape(e.source)})</title></rect>"
            )
            if kind == "measured":
                points.append(f"{bx + bw / 2:.1f},{y(e.nbytes):.1f}")
        out.append(
            f'<text x="{x0 + col / 2:.1f}" y="{bottom + 18}" text-anchor="middle" font-size="12" '
            f'fill="#1f2328">{escape(PHASE_SHORT.get(p.name, p.name))}</text>'
        )
    if len(points) > 1:
        out.append(
            f'<polyline points="{" ".join(points)}" fill="none" stroke="#1f2328" stroke-width="1" '
            'stroke-dasharray="2 2"/>'
        )
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{w - 10}" y2="{bottom}" stroke="#57606a"/>')
    out.append(
        f'<rect x="{left}" y="{h - 22}" width="12" height="12" fill="#fff" stroke="{COLORS["CALCULATED"]}"/>'
        f'<text x="{left + 16}" y="{h - 12}" font-size="12">estimated (x-estimate)</text>'
        f'<rect x="{left + 190}" y="{h - 22}" width="12" height="12" fill="{COLORS["MEASURED"]}"/>'
        f'<text x="{left + 206}" y="{h - 12}" font-size="12">measured (phases)</text>'
    )
    out.append("</svg>")
    return "\n".join(out)


def _findings(d: ReportData) -> str:
    counts = f"{d.count(ERROR)} error(s), {d.count(WARNING)} warning(s), {d.count(INFO)} info"
    if not d.findings:
        return f'<p class="muted">{counts}</p>'
    rows = [
        f'<p class="muted">{counts}</p><table><thead><tr><th>line</th><th>rule</th><th>severity</th>'
        "<th>message</th></tr></thead><tbody>"
    ]
    for f in d.findings:
        rows.append(
            f'<tr class="f-{escape(f.severity)}"><td class="num">{f.line}:{f.column}</td><td>{escape(f.rule)}</td>'
            f"<td>{escape(f.severity)}</td><td>{escape(f.message)}</td></tr>"
        )
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _provenance_legend() -> str:
    items = "".join(f"<span>{badge(p)} {escape(MEANINGS[p])}</span>" for p in PROVENANCE)
    return '<div class="legend">' + items + "</div>"
