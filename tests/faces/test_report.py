"""``ledgerspec report``: terminal and HTML faces of every example, self-containment, colours, bar arithmetic.

Expected figures are read from the YAML files directly (ruamel, not the ledgerspec loader), so the
report is checked against the documents, not against itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ruamel.yaml import YAML

from ledgerspec.contract.units import format_size, parse_size
from ledgerspec.faces.report.bar import Bar, Span, cells
from ledgerspec.faces.report.data import COMPONENTS, Entry
from ledgerspec.faces.report.html import BAR_W, COLORS, COMPONENT_COLORS
from tests.support import EXAMPLES, REPO_ROOT, CliRunner

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
IDS = [p.name for p in EXAMPLE_FILES]
SVG = "{http://www.w3.org/2000/svg}"


def raw_yaml(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    return data


def expected_source(raw: Any, present: bool = True) -> str:
    """The provenance a reader sees for a memory figure, from the raw YAML (the spec's rules)."""
    if not present:
        return "UNKNOWN"
    if isinstance(raw, dict):
        return str(raw.get("source"))
    if raw in ("UNKNOWN", "CONFIGURATION-SPECIFIC"):
        return str(raw)
    return "ASSUMPTION"  # a bare figure counts as an assumption


def expected_bytes(raw: Any) -> int | None:
    value = raw.get("value") if isinstance(raw, dict) else raw
    if value is None or value in ("UNKNOWN", "CONFIGURATION-SPECIFIC"):
        return None
    return parse_size(value)


def html_report(cli: CliRunner, src: Path, out: Path) -> ET.Element:
    code, _stdout, err = cli("report", src, "--html", out)
    assert code == 0, err
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    return ET.fromstring(text)


# -- the terminal -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=IDS)
@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_terminal_report_of_every_example(cli: CliRunner, path: Path, plain: bool) -> None:
    code, out, err = cli("report", path, *(["--plain"] if plain else []))
    assert code == 0, err
    _code_v, out_v, _ = cli("validate", "--format", "json", path)
    import json

    status = json.loads(out_v)["files"][0]["supported_status"]
    assert f"status {status}" in out
    raw = raw_yaml(path)
    ledger = raw.get("ledger") or {}
    for key in COMPONENTS:
        present = key in ledger
        assert expected_source(ledger.get(key), present) in out
    for label in ("frozen base", "adapter", "gradients", "optimizer state", "activations"):
        assert label in out
    assert "\x1b[" not in out  # not a terminal: no escape codes in a pipe


def test_terminal_rich_colours_follow_provenance(cli: CliRunner) -> None:
    from io import StringIO

    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import gather
    from ledgerspec.faces.report.terminal import render_rich

    buf = StringIO()
    render_rich(gather(load(EXAMPLES / "llama-2-7b-lora.ledger.yaml")), buf, color=True)
    text = buf.getvalue()
    # magenta (35) for CALCULATED sources, bright black (90) for UNKNOWN ones
    assert re.search(r"\x1b\[35mCALCULATED", text)
    assert re.search(r"\x1b\[90mUNKNOWN", text)


def test_plain_fallback_without_rich(monkeypatch: pytest.MonkeyPatch, cli: CliRunner) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # `import rich` now fails as if it were not installed
    code, out, err = cli("report", EXAMPLES / "llama-2-7b-lora.ledger.yaml")
    assert code == 0, err
    assert "memory components (ledger)" in out
    assert "  component " in out  # the plain table header


def test_plain_bar_letters_match_component_sizes(cli: CliRunner) -> None:
    path = EXAMPLES / "llama-2-7b-lora.ledger.yaml"
    code, out, _ = cli("report", "--plain", path)
    assert code == 0
    bar = next(line for line in out.splitlines() if line.startswith("["))
    ledger = raw_yaml(path)["ledger"]
    sizes = {k: expected_bytes(ledger.get(k)) for k in ("frozen_base", "adapter", "gradients", "optimizer")}
    total = sum(v or 0 for v in sizes.values())
    # no device memory in this ledger: the stacked components fill the whole 60-character bar
    assert len(bar) == 62 and bar.endswith("]")
    assert bar.count("B") + bar.count("A") + bar.count("G") + bar.count("O") == 60
    assert abs(bar.count("B") - 60 * (sizes["frozen_base"] or 0) / total) < 1


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_method_strings_wrap_and_are_never_cut(cli: CliRunner, plain: bool) -> None:
    """Every method string of the ledger is in the report whole (wrapped over lines, no "…")."""
    path = EXAMPLES / "llama-2-7b-lora.ledger.yaml"
    code, out, _ = cli("report", path, *(["--plain"] if plain else []))
    assert code == 0
    assert "…" not in out
    table = out.split("memory components (ledger)")[1].split("configuration inputs")[0]
    assert max(len(line.rstrip()) for line in table.splitlines()) <= 120  # wrapped to the width, not overflowing
    words = " ".join(out.split())  # a wrapped cell reads as one run of words, column by column
    ledger = raw_yaml(path)["ledger"]
    methods = [str(v["method"]) for v in ledger.values() if isinstance(v, dict) and v.get("method")]
    assert methods, "the example has method strings"
    for m in methods:
        first, last = " ".join(m.split()[:4]), " ".join(m.split()[-3:])
        assert first in words and last in words, m  # the start and the end of each method, both shown
    assert any(len(m) > 70 for m in methods)  # at least one that the old 70-character cut truncated


def test_report_does_not_import_torch() -> None:
    code = (
        "import sys; from ledgerspec.faces.cli import main; "
        f"rc = main(['report', '--plain', {str(EXAMPLES / 'llama-2-7b-lora.ledger.yaml')!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- HTML -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=IDS)
def test_html_is_self_contained(cli: CliRunner, path: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    root = html_report(cli, path, out)
    text = out.read_text(encoding="utf-8")
    for el in root.iter():
        for attr in ("src", "href", "{http://www.w3.org/1999/xlink}href"):
            value = el.get(attr)
            assert value is None or not re.match(r"^\s*(https?:)?//", value), f"<{el.tag} {attr}={value}> loads"
    scripts = root.findall(".//script")
    assert all(el.get("src") is None for el in scripts), "inline scripts only"
    assert len(scripts) == (1 if root.find(".//*[@id='what-if']") is not None else 0), "a script only for the what-if"
    assert "@import" not in text and not re.search(r"url\((?!#)", text)  # url(#pattern): in the page itself
    assert root.find(".//style") is not None  # inline CSS
    assert root.find(f".//{SVG}svg") is not None or "No component has a known size yet" in text


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=IDS)
def test_html_colours_follow_provenance(cli: CliRunner, path: Path, tmp_path: Path) -> None:
    root = html_report(cli, path, tmp_path / "r.html")
    ledger = raw_yaml(path).get("ledger") or {}
    for key in COMPONENTS:
        row = root.find(f".//tr[@data-component='{key}']")
        assert row is not None, key
        badge = row.find(".//span[@class]")
        assert badge is not None
        source = expected_source(ledger.get(key), key in ledger)
        assert badge.text == source
        assert f"background:{COLORS[source]}" in (badge.get("style") or "")
    # the bar segments carry the colour of their component; their provenance is the pattern drawn over them
    rects = list(root.iter(f"{SVG}rect"))
    for i, seg in enumerate(rects):
        if seg.get("class") != "seg":
            continue
        assert seg.get("fill") == COMPONENT_COLORS[seg.get("data-component") or ""][0]
        source = seg.get("data-source") or ""
        overlay = rects[i + 1] if i + 1 < len(rects) and rects[i + 1].get("class") == "provenance" else None
        if source == "MEASURED":
            assert overlay is None  # solid
        else:
            assert overlay is not None and overlay.get("fill") == f"url(#prov-{source.lower()})"
            assert overlay.get("x") == seg.get("x") and overlay.get("width") == seg.get("width")


def test_components_have_their_own_colours_and_the_legend_says_what_patterns_mean(
    cli: CliRunner, tmp_path: Path
) -> None:
    """Issue 13: the bar coloured every component alike (colour followed provenance)."""
    assert len({fill for fill, _ in COMPONENT_COLORS.values()}) == len(COMPONENT_COLORS) == len(COMPONENTS)
    out = tmp_path / "r.html"
    html_report(cli, EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml", out)
    text = out.read_text(encoding="utf-8")
    assert "colour = component; pattern = provenance:" in text and "CALCULATED: striped" in text
    for pattern in ("prov-verified", "prov-calculated", "prov-assumption", "prov-configuration-specific"):
        assert text.count(f'id="{pattern}"') == 1  # defined once, used by the bar and the legend


def test_every_provenance_word_has_its_own_colour() -> None:
    assert len(set(COLORS.values())) == len(COLORS)
    assert {"MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION", "UNKNOWN"} <= set(COLORS)


@pytest.mark.parametrize("path", [p for p in EXAMPLE_FILES if (raw_yaml(p).get("ledger") or {})], ids=lambda p: p.name)
def test_bar_segments_sum_to_the_components(cli: CliRunner, path: Path, tmp_path: Path) -> None:
    root = html_report(cli, path, tmp_path / "r.html")
    ledger = raw_yaml(path)["ledger"]
    sizes = {k: expected_bytes(ledger[k]) for k in COMPONENTS if k in ledger}
    expected = {k: v for k, v in sizes.items() if v is not None}
    svg = next(s for s in root.iter(f"{SVG}svg") if s.get("class") == "bar")
    segs = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "seg"]
    assert {r.get("data-component"): int(r.get("data-bytes") or -1) for r in segs} == expected
    scale = int(svg.get("data-scale") or 0)
    total = sum(expected.values())
    assert scale >= total
    target = (raw_yaml(path).get("result") or {}).get("target_device", {}).get("memory")
    if target is not None:
        assert scale >= parse_size(target)
    # contiguous, in stacking order, widths proportional to bytes, summing to the stacked share of the bar
    x = float(segs[0].get("x") or 0)
    for r in segs:
        assert float(r.get("x") or 0) == pytest.approx(x, abs=0.002)
        width = float(r.get("width") or 0)
        assert width == pytest.approx(int(r.get("data-bytes") or 0) / scale * BAR_W, abs=0.002)
        x += width
    widths = sum(float(r.get("width") or 0) for r in segs)
    assert widths == pytest.approx(total / scale * BAR_W, abs=0.01)


MEASURED_LEDGER = """\
ledgerspec: ledger/v1
title: synthetic measured ledger
ledger:
  frozen_base: {value: 10GiB, source: CALCULATED, method: params x 2}
  adapter: {value: 100MiB, source: VERIFIED}
  gradients: {value: 100MiB, source: CALCULATED, method: x}
  optimizer: {value: 200MiB, source: CALCULATED, method: x}
  activations: {value: 3GiB, source: MEASURED}
  temporary: {value: 1GiB, source: ASSUMPTION, note: allocator slack}
  calculated_subtotal: {value: 10700MiB, source: CALCULATED, method: sum}
phases:
  after_load: {value: 10GiB, source: MEASURED}
  forward_peak: {value: 13GiB, source: MEASURED}
  steady_state_peak: {value: 15GiB, source: MEASURED}
metrics:
  peak_allocated: {value: 15GiB, source: MEASURED}
  peak_reserved: {value: 16GiB, source: MEASURED}
comparison:
  calculated_subtotal: {value: 10700MiB, source: CALCULATED, method: ledger}
  measured_peak: {value: 15GiB, source: MEASURED}
  known_explanation: activations and temporaries
measurement: {device: cuda, device_memory: 24GiB}
software: {torch: "2.13.0"}
x-estimate:
  after_load: {value: 10GiB, source: CALCULATED, method: fake tensors}
  forward_peak: {value: 12GiB, source: CALCULATED, method: fake tensors}
  peak_allocated: {value: 14GiB, source: CALCULATED, method: fake tensors}
"""


def test_html_timeline_and_calculated_vs_measured(cli: CliRunner, tmp_path: Path) -> None:
    src = tmp_path / "m.ledger.yaml"
    src.write_text(MEASURED_LEDGER, encoding="utf-8")
    root = html_report(cli, src, tmp_path / "m.html")
    timeline = next(s for s in root.iter(f"{SVG}svg") if s.get("class") == "timeline")
    rects = {
        (r.get("data-phase"), (r.get("class") or "").split()[-1]): int(r.get("data-bytes") or 0)
        for r in timeline.iter(f"{SVG}rect")
        if (r.get("class") or "").startswith("phase")
    }
    assert rects == {
        ("after_load", "measured"): 10 * 2**30,
        ("forward_peak", "measured"): 13 * 2**30,
        ("steady_state_peak", "measured"): 15 * 2**30,
        ("after_load", "estimated"): 10 * 2**30,
        ("forward_peak", "estimated"): 12 * 2**30,
    }
    text = ET.tostring(root, encoding="unicode")
    assert "Calculated vs measured" in text
    assert "activations and temporaries" in text
    # the measured device's memory is the capacity when no target device is given
    bar = next(s for s in root.iter(f"{SVG}svg") if s.get("class") == "bar")
    assert int(bar.get("data-scale") or 0) == 24 * 2**30
    # every component has a size here: six segments, one per provenance colour used
    segs = [r for r in bar.iter(f"{SVG}rect") if r.get("class") == "seg"]
    assert [r.get("data-source") for r in segs] == [
        "CALCULATED",
        "VERIFIED",
        "CALCULATED",
        "CALCULATED",
        "MEASURED",
        "ASSUMPTION",
    ]


def test_terminal_phases_estimated_vs_measured(cli: CliRunner, tmp_path: Path) -> None:
    src = tmp_path / "m.ledger.yaml"
    src.write_text(MEASURED_LEDGER, encoding="utf-8")
    code, out, err = cli("report", "--plain", src)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("forward peak"))
    assert line.split()[2:] == ["12.00", "GiB", "13.00", "GiB"]
    bar = next(x for x in out.splitlines() if x.startswith("["))
    assert "|" in bar  # the device memory mark


@pytest.mark.parametrize("plain", [True, False])
def test_the_estimated_peak_is_split_into_what_is_alive(cli: CliRunner, tmp_path: Path, plain: bool) -> None:
    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import COMPONENT_LABELS

    path = EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml"
    split = load(path).get("x-estimate", "at_peak").raw  # written by `ledgerspec estimate`
    code, out, err = cli("report", *(["--plain"] if plain else []), path)
    assert code == 0, err
    assert "alive at the estimated peak (backward peak, 13.88 GiB" in out
    for name in ("frozen_base", "activations", "temporary"):
        assert any(COMPONENT_LABELS[name] in line and format_size(split[name]) in line for line in out.splitlines())
    assert sum(v for k, v in split.items() if k != "phase") == load(path).get("x-estimate", "peak_allocated").size()
    html = tmp_path / "r.html"
    assert cli("report", path, "--html", html)[0] == 0
    assert "Alive at the estimated peak (backward peak)" in html.read_text(encoding="utf-8")
    code, out, _ = cli("report", "--plain", EXAMPLES / "llama-2-7b-lora.ledger.yaml")  # no estimate: no split
    assert code == 0 and "alive at the estimated peak" not in out


# -- bar arithmetic ---------------------------------------------------------------------------------
@given(
    st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=2**41),
    st.integers(min_value=10, max_value=200),
)
def test_cells_sum_to_the_stacked_share(sizes: list[int], capacity: int, width: int) -> None:
    scale = max(sum(sizes), capacity, 1)
    spans, at = [], 0
    for n in sizes:
        spans.append(Span(Entry(("ledger", "adapter"), "", "CALCULATED", n), at / scale, n / scale))
        at += n
    bar = Bar(scale, spans, None, None)
    got = cells(bar, width)
    assert sum(got) == round(sum(sizes) / scale * width)
    for n, c in zip(sizes, got, strict=True):
        assert abs(c - n / scale * width) < 1


# -- bad input --------------------------------------------------------------------------------------
def test_missing_file_is_one_line_exit_2(cli: CliRunner, tmp_path: Path) -> None:
    code, _out, err = cli("report", tmp_path / "nope.ledger.yaml")
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "nope.ledger.yaml" in err


@pytest.mark.parametrize(
    "text, expect",
    [
        ("ledgerspec: ledger/v9\n", "unsupported version"),
        ("title: no header\n", "missing header"),
        ("- a list\n", "not a mapping"),
        ("ledgerspec: ledger/v1\nledger: {adapter: 1\n", ""),
    ],
)
def test_bad_documents_are_one_line_errors(cli: CliRunner, tmp_path: Path, text: str, expect: str) -> None:
    src = tmp_path / "bad.ledger.yaml"
    src.write_text(text, encoding="utf-8")
    code, _out, err = cli("report", src)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(str(src)) and expect in err


def test_html_into_missing_folder_creates_it(cli: CliRunner, tmp_path: Path) -> None:
    code, _out, err = cli("report", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--html", tmp_path / "no" / "r.html")
    assert code == 0, err
    assert (tmp_path / "no" / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_html_that_cannot_be_written_is_an_error(cli: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x", encoding="utf-8")  # a folder path that runs through a file
    code, _out, err = cli("report", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--html", tmp_path / "a-file" / "r.html")
    assert code == 2
    assert "Traceback" not in err and "cannot create the folder" in err and "r.html" in err


def test_html_write_is_atomic_and_replaces(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    out.write_text("old", encoding="utf-8")
    code, _o, err = cli("report", EXAMPLES / "14b-qlora.intake.yaml", "--html", out)
    assert code == 0, err
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temp file left behind
    assert "INSUFFICIENT DATA" in err  # the one-line summary names the status


def test_html_never_overwrites_the_ledger(cli: CliRunner, tmp_path: Path) -> None:
    src = tmp_path / "x.ledger.yaml"
    text = (EXAMPLES / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")
    src.write_text(text, encoding="utf-8")
    code, _out, err = cli("report", src, "--html", src)
    assert code == 2 and "refusing to overwrite" in err
    assert src.read_text(encoding="utf-8") == text


def test_the_temporary_row_points_at_the_transient_the_estimate_found() -> None:
    """ledger.temporary is MEASURED only; beside an estimate its row says what the estimate found at its peak."""
    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import gather

    path = EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml"
    doc = load(path)
    row = next(e for e in gather(doc).components if e.path == ("ledger", "temporary"))
    alive = YAML(typ="safe").load(path.read_text(encoding="utf-8"))["x-estimate"]["at_peak"]["temporary"]
    assert row.display == "missing" and f": {format_size(alive)} (x-estimate.at_peak.temporary)" in row.detail
    plain = next(e for e in gather(load(EXAMPLES / "llama-2-7b-lora.ledger.yaml")).components if e.name == "temporary")
    assert plain.detail == ""  # no estimate, nothing to point at
