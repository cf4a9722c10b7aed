"""docs/training-step.md: its 7B QLoRA table is what ``estimate`` says for the ledger the page shows, and its
table of known stack differences is the data the rule reads."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "training-step.md"
GIB = 1 << 30


def _page_ledger() -> str:
    text = PAGE.read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(ledgerspec: ledger/v1\n.*?)```", text, re.S)
    assert block is not None
    return block.group(1).replace("examples/", f"{REPO_ROOT.as_posix()}/examples/")


def _variant(name: str) -> str:
    text = _page_ledger()
    lines = text.replace('training: {mixed_precision: "no"}  # or bf16', "").splitlines()
    out = [line for line in lines if "# variant" not in line]
    extra = []
    if "PEFT preparation" in name:
        extra.append("  prepare_for_kbit_training: true")
    if "TRL casts" in name:
        extra.append("  module_dtypes: {norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}")
    i = out.index("  quantized: true") + 1
    out[i:i] = extra
    training = '{mixed_precision: "no"}' if name.startswith('`mixed_precision: "no"`') else "{mixed_precision: bf16}"
    return "\n".join(out) + f"\ntraining: {training}\n"


def _rows() -> list[list[str]]:
    text = PAGE.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "GiB" not in line and "---" not in line]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    return [c for c in cells if c[0].startswith(("`mixed_precision", "bf16 + PEFT"))]


@pytest.mark.slow
def test_the_7b_qlora_table_is_what_estimate_says() -> None:
    pytest.importorskip("torch")
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.estimate.estimator import estimate

    rows = _rows()
    assert len(rows) == 4, rows
    peaks = []
    for name, peak, phase, frozen, alive, temporary in rows:
        est = estimate(from_text(_variant(name), str(REPO_ROOT / "page.ledger.yaml")))
        got = [
            f"{est.peak_allocated / GIB:.2f}",
            f"{est.at_peak['frozen_base'] / GIB:.2f}",
            f"{est.at_peak['activations'] / GIB:.2f}",
            f"{est.at_peak['temporary'] / GIB:.2f}",
        ]
        assert got == [peak, frozen, alive, temporary], name
        assert phase.split()[0] in est.peak_phase.replace("_", " "), (name, est.peak_phase)
        peaks.append(est.peak_allocated)
    assert len(set(peaks[1:3])) == 2  # the declarations give different estimates


def test_the_differences_table_is_the_rules_data() -> None:
    import sys

    sys.path.insert(0, str(REPO_ROOT / "docs" / "hooks"))
    try:
        import ledgerspec_docs
    finally:
        sys.path.pop(0)
    from ledgerspec.contract.differences import KNOWN

    table = ledgerspec_docs.differences_markdown()
    assert "<!-- ledgerspec:differences -->" in PAGE.read_text(encoding="utf-8")
    for d in KNOWN:
        assert f"`{d.id}`" in table and d.changed_in in table and d.sources[0] in table
        assert d.introduced_in is None or f"{d.introduced_in} <= {d.package} < {d.changed_in}" in table
