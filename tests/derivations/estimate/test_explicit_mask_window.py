"""transformers 4.38-4.39's explicit causal mask for SDPA (known difference
``transformers-sdpa-explicit-causal-mask``, a window): not modelled, recorded next to an SDPA estimate of the model
types it concerns, printed when the ledger declares a version inside the window, and reported by LS012."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import from_text, load
from tests.support import CliRunner

KEY = "transformers-sdpa-explicit-causal-mask"


def _doc(declared: str | None) -> object:
    software = f"software: {{transformers: '{declared}'}}\n" if declared else ""
    return from_text("ledgerspec: ledger/v1\n" + software, "x.ledger.yaml")


@pytest.mark.parametrize(
    ("model_type", "attention", "declared", "recorded", "noted"),
    [
        ("llama", "sdpa", "4.39.1", True, True),
        ("gemma", "sdpa", "4.38.2", True, True),
        ("cohere", "sdpa", "4.39.3", True, True),
        ("llama", "sdpa", "4.40.0", True, False),  # past the window: the figures are the declared run's
        ("llama", "sdpa", "4.37.2", True, False),  # before it, too
        ("llama", "sdpa", None, True, False),  # undeclared: recorded, so a later declaration shows (LS012)
        ("mistral", "sdpa", "4.39.1", False, False),  # 4.39's Mistral kept the mask helper that returns None
        ("qwen2", "sdpa", "4.39.1", False, False),
        ("llama", "eager", "4.39.1", False, False),  # eager attention always takes a mask
        ("llama", "flash_attention_2", "4.39.1", False, False),
    ],
)
def test_recorded_for_sdpa_llama_gemma_and_cohere(
    model_type: str, attention: str, declared: str | None, recorded: bool, noted: bool
) -> None:
    from ledgerspec.derivations.estimate.estimator import causal_mask_window

    found = causal_mask_window(_doc(declared), attention, model_type)  # type: ignore[arg-type]
    assert (found is not None) is recorded
    if found is None:
        return
    key, entry, note = found
    assert (key, entry) == (KEY, {"computed_as": "newer"})  # the installed transformers (5.x) is past the window
    assert (note is not None) is noted
    if note:
        assert f"declares {declared}: Llama and Gemma models" in note and "not modelled" in note


@pytest.mark.slow
def test_an_estimate_of_a_declared_4_39_names_it_and_validate_reports_it(tmp_path: Path, cli: CliRunner) -> None:
    pytest.importorskip("torch")
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    path = tmp_path / "t.ledger.yaml"
    text = ledger_text(microbatch=1, seq=32)
    path.write_text(text.replace("software:\n", "software:\n  transformers: '4.39.1'\n", 1), encoding="utf-8")
    code, out, err = cli("estimate", path)
    assert code == 0, err
    assert "stack: software.transformers declares 4.39.1" in out and f"[{KEY}]" in out
    assert load(path).get("x-estimate", "differences", KEY).raw == {"computed_as": "newer"}
    code, out, _ = cli("validate", path)
    assert "LS012" in out and KEY in out
    # accepted, the rule becomes info and the ladder no longer holds on it
    accepted = path.read_text(encoding="utf-8").replace(
        "software:\n", f"software:\n  accepted_differences: [{KEY}]\n", 1
    )
    path.write_text(accepted, encoding="utf-8")
    code, out, _ = cli("validate", path)
    assert not any("LS012" in line and "warning" in line for line in out.splitlines())
