"""The report answers first (issue 13): the verdict line, the next status's evidence grouped, the largest batch
and the device table, consistent words for a missing figure, and a page that fits a 1280 px screen."""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ledgerspec.checks.ladder import supported_status
from ledgerspec.checks.verdict import next_steps
from ledgerspec.contract.document import load
from tests.support import EXAMPLES, REPO_ROOT, TESTS, CliRunner

ESTIMATED = EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml"
SAMPLE = TESTS / "data" / "report" / "fit-and-devices.ledger.yaml"
XHTML = ""  # the page is XML without a default namespace


def test_the_terminal_report_opens_with_the_verdict(cli: CliRunner) -> None:
    code, out, _ = cli("report", "--plain", ESTIMATED)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("FITS on the target device (24.00 GiB): predicted peak 14.79 GiB")
    assert "headroom 8.91 GiB" in lines[0]
    assert lines[2] == "status CANDIDATE (declared: CANDIDATE)" and lines[3] == "  to reach VALIDATED:"
    reasons = supported_status(load(ESTIMATED)).reasons
    steps = [line for line in lines if line.startswith("  - ")]
    assert len(steps) == len(next_steps(reasons)) < len(reasons)  # one line per kind of evidence
    assert f"({len(reasons)} reasons in all" in out
    _, verbose, _ = cli("report", "--plain", "-v", ESTIMATED)
    assert [line[6:] for line in verbose.splitlines() if line.startswith("    - ")] == reasons


def test_the_rich_report_opens_with_the_verdict(cli: CliRunner) -> None:
    pytest.importorskip("rich")
    code, out, _ = cli("report", ESTIMATED)
    assert code == 0 and out.splitlines()[0].strip().startswith("FITS") and "headroom 8.91 GiB" in out.splitlines()[0]


def test_validate_verbose_says_the_verdict_first(cli: CliRunner) -> None:
    _, out, _ = cli("validate", "-v", ESTIMATED)
    assert out.splitlines()[0] == f"{ESTIMATED}: " + (
        "FITS on the target device (24.00 GiB): predicted peak 14.79 GiB (x-estimate.device_peak), headroom "
        "8.91 GiB (an RTX 3090's CUDA total is 23.70 GiB, not the declared 24.00 GiB; device-level: reserved 14.29 GiB "
        "(allocator model) + 512.00 MiB outside the allocator (ASSUMPTION); allocated 13.88 GiB; a model, not measured)"
    )


def _html(cli: CliRunner, path: Path, tmp_path: Path) -> ET.Element:
    out = tmp_path / "r.html"
    assert cli("report", path, "--html", out)[0] == 0
    return ET.fromstring(out.read_text(encoding="utf-8"))


def test_the_html_page_opens_with_the_verdict_and_hides_the_full_list(cli: CliRunner, tmp_path: Path) -> None:
    root = _html(cli, ESTIMATED, tmp_path)
    main = root.find(f".//{XHTML}main")
    assert main is not None
    first = main[0]
    assert first.tag == f"{XHTML}h1" and first.get("data-verdict") == "FITS"
    text = "".join(first.itertext())
    assert text.startswith("FITS") and "headroom 8.91 GiB" in text
    details = main.find(f".//{XHTML}details")
    assert details is not None and "Every reason (15)" in "".join(details.itertext())
    steps = main.find(f".//{XHTML}ul[@class='reasons steps']")
    assert steps is not None and 0 < len(steps) < 15


def test_the_largest_batch_and_the_device_table_are_shown(cli: CliRunner, tmp_path: Path) -> None:
    doc = load(SAMPLE)
    fit = doc.get("x-fit", "microbatch").raw
    root = _html(cli, SAMPLE, tmp_path)
    fit_table = root.find(f".//{XHTML}table[@class='fit']")
    devices = root.find(f".//{XHTML}table[@class='devices']")
    assert fit_table is not None and devices is not None
    row = "".join(fit_table[1][0].itertext())
    assert row.startswith("microbatch") and str(fit["largest"]) in row
    names = ["".join(r[0].itertext()) for r in devices[1]]
    assert "NVIDIA GeForce RTX 4090" in names and "AMD Instinct MI300X" in names
    _, out, _ = cli("report", "--plain", SAMPLE)
    assert "largest that fits (estimate --fit)" in out and "which device (estimate --devices)" in out
    assert "usable memory = the total PyTorch reports" in out


def test_a_device_row_at_the_edge_reads_no(cli: CliRunner, tmp_path: Path) -> None:
    """A row of ``x-devices`` at the edge (``uncertain: true``: it completes only with the typical bytes outside the
    allocator) does not fit, in the plain report and the page alike, also as an earlier estimate wrote it (``fits:
    true`` beside it)."""
    text = SAMPLE.read_text(encoding="utf-8").replace(
        "fits: true, headroom: 9918937088", "fits: true, uncertain: true, headroom: 9918937088", 1
    )
    edge = tmp_path / "edge.ledger.yaml"
    edge.write_text(text, encoding="utf-8")
    _, out, _ = cli("report", "--plain", edge)
    row = next(line for line in out.splitlines() if "NVIDIA GeForce RTX 4090" in line)
    assert "NO (at the edge)" in row
    assert "NO (at the edge)" not in next(line for line in out.splitlines() if "NVIDIA L40S" in line)
    devices = _html(cli, edge, tmp_path).find(f".//{XHTML}table[@class='devices']")
    assert devices is not None
    first = devices[1][0]
    assert first.get("class") == "no" and "NO (at the edge)" in "".join(first.itertext())


def test_a_missing_component_reads_the_same_everywhere(cli: CliRunner) -> None:
    """Issue 13: "missing" in the table and "UNKNOWN" in the bar's caption for the same row."""
    _, out, _ = cli("report", "--plain", ESTIMATED)
    assert "temporary/runtime    missing" in out and "not in the bar: temporary/runtime (missing)" in out


@pytest.mark.slow
def test_no_page_overflows_a_1280_px_screen(tmp_path: Path) -> None:
    """scripts/screenshots renders every example's page in headless Chromium at 1280 px and finds no element
    past the report's right edge (a long sha256 wraps; tables fit)."""
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "screenshots"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "fit-and-devices.png" in pngs and "llama-2-7b-lora.estimated.top.png" in pngs
    assert "OVERFLOW" not in proc.stdout


def test_the_fit_table_leads_with_the_answer_on_the_device(cli: CliRunner, tmp_path: Path) -> None:
    """``estimate --fit`` on the CUDA target checks its allocated answer on the device (``x-fit.NAME.device``): the
    table's first figure is the largest value that fits there (the one to act on), then the allocated answer; a fit
    without that check (the CPU target) shows ``-`` there."""
    text = SAMPLE.read_text(encoding="utf-8")
    note = "    note: traced at microbatch 2, 8;"
    assert text.count(note) == 1
    device = (
        "    device: {largest: 6, compared: device peaks, checked: {'8': {fits: false, device_peak: 26000000000, "
        "margin: -600000000}, '6': {fits: true, device_peak: 24000000000, margin: 1400000000}}}\n"
    )
    checked = tmp_path / "checked.ledger.yaml"
    checked.write_text(text.replace(note, device + note), encoding="utf-8")
    for path, on_device in ((checked, "6"), (SAMPLE, "-")):
        root = _html(cli, path, tmp_path)
        table = root.find(f".//{XHTML}table[@class='fit']")
        assert table is not None
        head = ["".join(c.itertext()) for c in table[0][0]]
        assert head[:3] == ["input", "on the device", "allocated: largest"]
        cells = ["".join(c.itertext()) for c in table[1][0]]
        assert cells[:3] == ["microbatch", on_device, "8"], cells
        _, out, _ = cli("report", "--plain", path)
        row = next(line for line in out.splitlines() if line.strip().startswith("microbatch "))
        assert row.split()[:3] == ["microbatch", on_device, "8"], row


def _with_what_if(tmp_path: Path, device: str) -> Path:
    path = tmp_path / "w.ledger.yaml"
    text = ESTIMATED.read_text(encoding="utf-8")
    if not (tmp_path / "configs").exists():
        shutil.copytree(EXAMPLES / "configs", tmp_path / "configs")
    path.write_text(text + f"x-what-if:\n  device_memory: 25769803776\n  device: {device}\n", encoding="utf-8")
    return path


def test_the_what_ifs_answer_on_the_device_is_in_the_report(tmp_path: Path, cli: CliRunner) -> None:
    """``estimate --what-if`` on a CUDA target stores its answer on the device (``x-what-if.device``): the terminal
    report says it in one line, the page beside the sliders; a user's string in it is shown escaped."""
    device = (
        "{largest: {microbatch: 8, max_length: 2048, gradient_checkpointing: true}, checked: [{point: {microbatch: 8, "
        "max_length: 2048, gradient_checkpointing: true}, fits: true, device_peak: 21206523904, margin: 1}]}"
    )
    code, out, _ = cli("report", "--plain", _with_what_if(tmp_path, device))
    assert code == 0
    assert (
        "what if (estimate --what-if): largest configuration that fits on the device of 24.00 GiB: microbatch=8, "
        "max_length=2048, gradient_checkpointing=on (device peak 19.75 GiB)"
    ) in out
    none = "{largest: null, checked: [], not_replayed: [{point: {microbatch: 1}, peak_allocated: 1, capacity: 0}]}"
    code, out, _ = cli("report", "--plain", _with_what_if(tmp_path, none))
    assert "what if (estimate --what-if): no configuration checked fits on the device of 24.00 GiB" in out
    hostile = '{largest: {"m\\e[31m": 1}, checked: []}'
    code, out, _ = cli("report", "--plain", _with_what_if(tmp_path, hostile))
    assert code == 0 and "\x1b" not in out and "largest configuration that fits on the device" in out
    for malformed in ("{largest: 5, checked: 5}", "{largest: {microbatch: 2}, checked: true}", "[1, 2]"):
        code, out, err = cli("report", "--plain", _with_what_if(tmp_path, malformed))
        assert code == 0 and "Traceback" not in err, malformed  # a hand-edited block is read as far as it goes
    code, out, _ = cli("report", "--plain", ESTIMATED)
    assert "what if (estimate --what-if)" not in out  # not checked on the device: nothing said


def test_the_fit_table_names_the_card_its_answer_on_the_device_was_decided_on(tmp_path: Path, cli: CliRunner) -> None:
    """``--fit --device-memory 80GiB`` on a ledger whose target is another card: the report's fit row says which card
    (and its CUDA total) the values were checked on, not only the memory asked."""
    path = tmp_path / "f.ledger.yaml"
    shutil.copytree(EXAMPLES / "configs", tmp_path / "configs")
    fit = (
        "x-fit:\n  microbatch:\n    largest: 21\n    peak: 1\n    above: 22\n    peak_above: 2\n"
        "    device_memory: 85899345920\n    device:\n      largest: 20\n      card: NVIDIA A100-SXM4-80GB\n"
        "      cuda_total: 85093187584\n      checked: {'20': {fits: true, device_peak: 85000000000, margin: 1}}\n"
    )
    path.write_text(ESTIMATED.read_text(encoding="utf-8") + fit, encoding="utf-8")
    code, out, _ = cli("report", "--plain", path)
    assert code == 0
    assert (
        "on the device (NVIDIA A100-SXM4-80GB, its CUDA total 79.25 GiB; allocator model + outside the allocator): "
        "largest 20;"
    ) in " ".join(out.split())


def test_a_device_row_decided_by_fragmentation_says_how_much_in_both_reports() -> None:
    """A ``x-devices`` row that fragmentation decided keeps the bytes free but unusable: the terminal table, the HTML
    table and ``estimate --devices`` say them in the same words."""
    from ledgerspec.faces.report.data import DeviceRow, fits_words

    row = DeviceRow("Card", 1, 2**30, "1 GB", 2**29, False, -(2**20), None, fragmentation=18 * 2**20)
    assert row.fits_text == fits_words(False, 18 * 2**20) == "NO (fragmentation: 18.00 MiB free but unusable)"
    assert DeviceRow("Card", 1, 2**30, "1 GB", 2**29, False, 1, None, edge=True).fits_text == "NO (at the edge)"
    assert DeviceRow("Card", 1, 2**30, "1 GB", None, None, None, None).fits_text == "-"
