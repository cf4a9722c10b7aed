"""docs/objectives.md's ORPO example: its peaks are what `estimate` gives for the shipped DPO example with the edits
each row names (a check that the page is not stale, not a truth: the ORPO step's truths are
tests/derivations/engine/test_orpo_truth.py)."""

from __future__ import annotations

import pytest

from tests.support import EXAMPLES, REPO_ROOT

PAGE = (REPO_ROOT / "docs" / "objectives.md").read_text(encoding="utf-8")
EXAMPLE = EXAMPLES / "objectives" / "llama-3.1-8b-lora-dpo.ledger.yaml"
SECTION = PAGE.split("### A 7B/8B example: what ORPO changes", 1)[1]


def _rows() -> list[list[str]]:
    table = SECTION.split("| step | checkpointing | forward peak | peak allocated |", 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def _dpo_peaks(step: str, checkpointing: str) -> list[str]:
    """The peaks of the DPO example's row (tests/docs/test_objectives_page.py estimates them) whose step starts with
    ``step``, with ``checkpointing``."""
    table = PAGE.split("| step | checkpointing | forward peak | peak allocated |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return next(r[2:4] for r in rows if r[0].startswith(step) and r[1] == checkpointing)


def _edited(step: str, checkpointing: str) -> str:
    text = EXAMPLE.read_text(encoding="utf-8")
    if step.startswith("ORPO"):
        text = text.replace("  objective: dpo\n", "  objective: orpo\n")
    if "QLoRA nf4" in step:  # the base in 4-bit as TRL's ORPOTrainer prepares and casts it (docs: on a quantized base)
        text = text.replace("  kind: LoRA\n", "  kind: QLoRA\n", 1).replace(
            "  quantized: false\n",
            "  quantized: true\n  prepare_for_kbit_training: true\n"
            "  module_dtypes: {norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}\n"
            "  quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}\n",
            1,
        )
        assert "kind: QLoRA" in text and "type: nf4" in text
    if checkpointing == "off":
        text = text.replace("  gradient_checkpointing: true", "  gradient_checkpointing: false")
    return text


def test_the_table_has_orpo_and_dpo_with_and_without_checkpointing() -> None:
    assert {(r[0].split(",")[0], r[1]) for r in _rows()} == {
        ("DPO", "on"),
        ("DPO", "off"),
        ("ORPO", "on"),
        ("ORPO", "off"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in _rows() if r[0].startswith("ORPO")], ids=str)
def test_the_orpo_example_table_is_what_estimate_says(row: list[str]) -> None:
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.estimate.estimator import estimate

    est = estimate(from_text(_edited(row[0], row[1]), str(EXAMPLE)))
    gib = 2**30
    assert [f"{est.phases['forward_peak'] / gib:.2f} GiB", f"{est.peak_allocated / gib:.2f} GiB"] == row[2:4]


def test_the_rows_of_other_steps_are_the_dpo_examples() -> None:
    """The SFT and DPO rows are the DPO example's own (the same model, batch and settings), estimated by
    tests/docs/test_objectives_page.py: they are not estimated again here."""
    others = [r for r in _rows() if not r[0].startswith("ORPO")]
    assert others
    for row in others:
        step = row[0].split(" (")[0].split(", 2 pairs")[0]
        assert _dpo_peaks(step, row[1]) == row[2:4], row
