"""``estimate --what-if``: the grid around the declared configuration, stored in ``x-what-if``; each traced point
equals a plain estimate of that configuration."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ledgerspec.contract.document import load
from ledgerspec.contract.edit import set_plain
from ledgerspec.derivations.estimate.estimator import estimate
from ledgerspec.derivations.estimate.sweep import apply
from ledgerspec.derivations.estimate.whatif import default_axes
from tests.support import EXAMPLES, CliRunner

TINY = EXAMPLES / "tiny"


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    shutil.copytree(TINY / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / "tiny.ledger.yaml"
    path.write_text((TINY / "tiny-llama-lora.ledger.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def test_the_default_grid_centres_on_the_declared_configuration(ledger: Path) -> None:
    doc = load(ledger)
    set_plain(doc, ("workload", "max_length"), 2000, force=True)
    set_plain(doc, ("workload", "microbatch"), 3, force=True)
    axes = {a.name: a.values for a in default_axes(doc)}
    assert axes == {
        "microbatch": (1, 2, 3, 4, 8, 16),
        "max_length": (500, 1000, 2000, 4000),
        "gradient_checkpointing": (False, True),
    }


def test_without_a_length_it_says_what_is_missing(ledger: Path, cli: CliRunner) -> None:
    text = ledger.read_text(encoding="utf-8").replace("  max_length: 64\n", "")
    ledger.write_text(text, encoding="utf-8")
    code, _, err = cli("estimate", ledger, "--what-if")
    assert code == 2 and "--what-if needs workload.max_length" in err and "Traceback" not in err


@pytest.mark.slow
def test_what_if_is_stored_and_its_traced_points_are_plain_estimates(ledger: Path, cli: CliRunner) -> None:
    code, out, err = cli("estimate", ledger, "--what-if", "--device-memory", "3MiB")
    assert code == 0, err
    assert "x-what-if written" in err and "configurations from" in out
    doc = load(ledger)
    block = doc.get("x-what-if").raw
    assert block["axes"] == {
        "microbatch": [1, 2, 4, 8, 16],
        "max_length": [16, 32, 64, 128],
        "gradient_checkpointing": [False, True],
    }
    assert len(block["cells"]) == 5 * 4 * 2 and block["device_memory"] == 3 * 2**20
    # the answer decided on the device: what lies outside the allocator (the catalogue's figure for an unnamed GPU)
    # fills 3 MiB, so no configuration whose allocated tensors fit fits there, none replayed
    assert "fills the device's 3.00 MiB): microbatch=" in out and "ruled out without a replay)" in out
    fitting = [c for c in block["cells"] if c["peak"] <= 3 * 2**20]
    assert block["device"]["largest"] is None and block["device"]["checked"] == []
    assert len(block["device"]["not_replayed"]) == len(fitting) > 0
    traced = [c for c in block["cells"] if c["traced"]]
    assert traced and len(traced) < len(block["cells"])
    for cell in traced[:3]:
        point = {k: cell[k] for k in ("microbatch", "max_length", "gradient_checkpointing")}
        est = estimate(apply(load(ledger), point))
        assert (cell["peak"], cell["phase"]) == (est.peak_allocated, est.peak_phase), point
