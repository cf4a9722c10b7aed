"""docs/objectives.md says what the code does: its table of simulated objectives is the contract's, and its worked
example's peaks are what `estimate` gives for the shipped ledger with the edits each row names (a check that the page
is not stale, not a truth: the DPO step's truths are tests/derivations/engine/test_dpo_truth.py)."""

from __future__ import annotations

import pytest

from ledgerspec.contract import config
from ledgerspec.contract.document import from_text
from tests.support import EXAMPLES, REPO_ROOT

PAGE = (REPO_ROOT / "docs" / "objectives.md").read_text(encoding="utf-8")
EXAMPLE = EXAMPLES / "objectives" / "llama-3.1-8b-lora-dpo.ledger.yaml"
FUSED_HEAD = "software:\n  attention_implementation: sdpa\n  kernels: {cross_entropy: trl_chunked_nll}\n"


def _rows(header: str) -> list[list[str]]:
    table = PAGE.split(header, 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def test_the_simulated_objectives_are_the_contracts() -> None:
    rows = _rows("| objective | simulated | how |")
    simulated = {r[0].split(",")[0].strip("` ") for r in rows if r[1] == "yes"}
    assert simulated == set(config.SIMULATED_OBJECTIVES)
    # each DPO row's claim, against what the contract answers
    assert "`adapter_disabled`, `adapter_copy`, `model` or `precomputed`" in rows[1][0] and rows[1][1] == "yes"
    references = ("adapter_disabled", "adapter_copy", "model", "precomputed")
    assert all(config.Training(objective=o, reference=r).simulated for r in references for o in ("dpo", "kto"))
    assert not config.Training(objective="dpo", reference="none").simulated
    assert "older than 1.16" in rows[2][0] and rows[2][1].startswith("no")
    assert not config.Training(objective="dpo", trl="0.9.6").simulated
    assert config.Training(objective="dpo", trl="1.16.0").simulated


def _edited(step: str, checkpointing: str) -> str:
    text = EXAMPLE.read_text(encoding="utf-8")
    if step.startswith("SFT"):
        text = text.replace("  objective: dpo\n", "  objective: sft\n")
        text = text.replace("software:\n  attention_implementation: sdpa\n", FUSED_HEAD)
        if "4 rows" in step:
            text = text.replace("  microbatch: 2 ", "  microbatch: 4 ")
    elif "separate reference model" in step:
        text = text.replace(
            "  # objective_settings: {reference: precomputed}", "  objective_settings: {reference: model}"
        )
    elif "precomputed" in step:
        text = text.replace(
            "  # objective_settings: {reference: precomputed}", "  objective_settings: {reference: precomputed}"
        )
    if checkpointing == "off":
        text = text.replace("  gradient_checkpointing: true", "  gradient_checkpointing: false")
    return text


@pytest.mark.slow
@pytest.mark.parametrize("row", _rows("| step | checkpointing | forward peak | peak allocated |"), ids=str)
def test_the_example_table_is_what_estimate_says(row: list[str]) -> None:
    from ledgerspec.derivations.estimate.estimator import estimate

    est = estimate(from_text(_edited(row[0], row[1]), str(EXAMPLE)))
    gib = 2**30
    assert [f"{est.phases['forward_peak'] / gib:.2f} GiB", f"{est.peak_allocated / gib:.2f} GiB"] == row[2:4]
