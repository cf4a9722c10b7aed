"""The what-if section of ``report --html``: the grid ``estimate --what-if`` stores (``x-what-if``) behind two sliders,
a checkbox and a device-memory field, checked as data, as well-formed XML, and in a real browser (headless Chromium,
no network): each chosen point shows its own peak, phase and verdict."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from ledgerspec.contract.units import format_size
from tests.support import EXAMPLES, CliRunner

MICROBATCH = [1, 2, 4]
LENGTH = [512, 1024, 2048]
GiB = 2**30


def _peak(b: int, n: int, c: bool) -> int:
    """A made-up grid: the page shows what the ledger holds (the estimates behind it are tested elsewhere)."""
    return (10 * GiB) + b * n * (300_000 if not c else 40_000)


def _grid() -> dict[str, Any]:
    return {
        "source": "CALCULATED",
        "axes": {"microbatch": MICROBATCH, "max_length": LENGTH, "gradient_checkpointing": [False, True]},
        "declared": {"microbatch": 2, "max_length": 1024, "gradient_checkpointing": True},
        "cells": [
            {
                "microbatch": b,
                "max_length": n,
                "gradient_checkpointing": c,
                "peak": _peak(b, n, c),
                "phase": "backward_peak" if c else "forward_peak",
                "traced": b != 2,
            }
            for b, n, c in itertools.product(MICROBATCH, LENGTH, [False, True])
        ],
    }


def _ledger(tmp_path: Path, block: Any, memory: str | None = "12GiB") -> Path:
    yaml = YAML()
    with (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").open(encoding="utf-8") as f:
        data = yaml.load(f)
    data["x-what-if"] = block
    if memory is None:
        data.get("result", {}).pop("target_device", None)
    else:
        data.setdefault("result", {}).setdefault("target_device", {})["memory"] = memory
    ident = data["identity"]
    ident["config_path"] = str(EXAMPLES / "configs" / "llama-2-7b" / "config.json")
    path = tmp_path / "w.ledger.yaml"
    with path.open("w", encoding="utf-8") as f:
        yaml.dump(data, f)
    return path


def _page(cli: CliRunner, src: Path, out: Path) -> ET.Element:
    code, _, err = cli("report", src, "--html", out)
    assert code in (0, 1), err
    return ET.fromstring(out.read_text(encoding="utf-8"))


def test_the_section_starts_at_the_declared_point(cli: CliRunner, tmp_path: Path) -> None:
    root = _page(cli, _ledger(tmp_path, _grid()), tmp_path / "r.html")
    section = root.find(".//*[@id='what-if']")
    assert section is not None
    b = root.find(".//*[@id='wi-b']")
    n = root.find(".//*[@id='wi-n']")
    c = root.find(".//*[@id='wi-c']")
    assert b is not None and n is not None and c is not None
    assert (b.get("max"), b.get("value")) == ("2", "1") and (n.get("max"), n.get("value")) == ("2", "1")
    assert c.get("checked") == "checked"
    peak = root.find(".//*[@id='wi-peak']")
    assert peak is not None and peak.text == format_size(_peak(2, 1024, True))
    memory = root.find(".//*[@id='wi-m']")
    assert memory is not None and memory.get("value") == "12"


@pytest.mark.parametrize(
    "broken",
    [
        "not a mapping",
        {"axes": {"microbatch": [1]}, "cells": []},  # a point of the grid without a cell
        {**_grid(), "cells": _grid()["cells"][1:]},
        {**_grid(), "axes": {**_grid()["axes"], "max_length": ["x"]}},
    ],
    ids=["scalar", "empty", "missing-cell", "bad-axis"],
)
def test_a_partial_or_malformed_grid_shows_no_section(cli: CliRunner, tmp_path: Path, broken: Any) -> None:
    root = _page(cli, _ledger(tmp_path, broken), tmp_path / "r.html")
    assert root.find(".//*[@id='what-if']") is None and root.find(".//script") is None


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium on PATH (apt-get install chromium)")


def _dom(page: Path, fragment: str) -> str:
    """The page after its script ran, as headless Chromium leaves it (no network: every host resolves nowhere)."""
    proc = subprocess.run(
        [
            _browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--dump-dom",
            page.as_uri() + fragment,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _cell(dom: str, id_: str) -> str:
    m = re.search(rf'id="{id_}"[^>]*>([^<]*)<', dom)
    assert m, id_
    return m.group(1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("b", "n", "c", "memory"),
    [(4, 2048, False, 12), (4, 2048, True, 12), (2, 2048, False, 80)],  # does not fit, fits, another memory
)
def test_the_sliders_in_a_real_browser(
    cli: CliRunner, tmp_path: Path, b: int, n: int, c: bool, memory: int | None
) -> None:
    """Chromium runs the page's script: the point chosen (from the address) shows its own peak and phase, and the
    verdict and headroom against the memory field (12 GiB from the ledger unless the address sets another)."""
    page = tmp_path / "r.html"
    _page(cli, _ledger(tmp_path, _grid()), page)
    parts = [f"microbatch:{b}", f"max_length:{n}", f"gradient_checkpointing:{'on' if c else 'off'}"]
    if memory is not None:
        parts.append(f"memory_gib:{memory}")
    dom = _dom(page, "#what-if=" + ",".join(parts))
    peak = _peak(b, n, c)
    device = (memory or 12) * GiB
    assert _cell(dom, "wi-peak") == format_size(peak)
    assert _cell(dom, "wi-phase") == ("backward_peak" if c else "forward_peak")
    assert _cell(dom, "wi-how") == ("microbatch model" if b == 2 else "traced")
    assert _cell(dom, "wi-b-v") == str(b) and _cell(dom, "wi-n-v") == str(n)
    verdict = _cell(dom, "wi-verdict")
    if peak <= device:
        assert verdict.startswith("FITS: ") and f"headroom {format_size(device - peak)}" in verdict
    else:
        assert verdict.startswith("DOES NOT FIT: ") and f"short by {format_size(peak - device)}" in verdict
    assert 'data-verdict="' + ("FITS" if peak <= device else "DOES NOT FIT") + '"' in dom


@pytest.mark.slow
def test_without_a_device_the_browser_says_unknown(cli: CliRunner, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    block = {**_grid(), "device_memory": None}
    _page(cli, _ledger(tmp_path, block, memory=None), page)
    dom = _dom(page, "")
    assert _cell(dom, "wi-verdict") == "UNKNOWN: no device memory"
    assert _cell(dom, "wi-peak") == format_size(_peak(2, 1024, True))
