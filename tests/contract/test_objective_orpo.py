"""``training.objective: orpo`` (issue 24): ORPO's step on a 16/32-bit base is simulated as TRL 1.16's
``trl.experimental.orpo.ORPOTrainer`` runs it (its truths: tests/derivations/engine/test_orpo_truth.py); on a
quantized base it is not (TRL prepares the model, casts modules and autocasts its loss, orpo_trainer.py:220-262,
880-892): LS014 names it and the step refuses it in one line; nor on a declared older TRL (LLaMA-Factory's)."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract import config
from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS

EXAMPLE = IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml"


def _doc(training: str, software: str = "", quantized: bool = False) -> Any:
    text = EXAMPLE.read_text(encoding="utf-8")
    if quantized:
        assert "  quantized: false" in text
        text = text.replace(
            "  quantized: false",
            "  quantized: true\n  quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16}",
            1,
        )
    text += f"software:\n{software}" if software else ""
    return from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))


def _ls014(doc: Any) -> list[str]:
    return [f.message for f in validate(doc).findings if f.rule == "LS014"]


def test_orpo_is_simulated_on_a_16_bit_base_and_trl_1_16() -> None:
    assert config.Training(objective="orpo").simulated
    assert not config.Training(objective="orpo", trl="0.9.6").simulated
    assert _ls014(_doc("  objective: orpo\n")) == []
    hits = _ls014(_doc("  objective: orpo\n", "  trl: 0.9.6\n"))
    assert len(hits) == 1 and "orpo on TRL 0.9.6" in hits[0]


def test_orpo_on_a_quantized_base_is_not_simulated() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    doc = _doc("  objective: orpo\n", quantized=True)
    hits = _ls014(doc)
    assert len(hits) == 1 and "orpo on a quantized base" in hits[0]
    with pytest.raises(LedgerspecError, match=r"orpo on a quantized base") as err:
        WorkloadSpec.from_document(doc)
    assert "\n" not in str(err.value) and err.value.hint and "LedgerCallback" in err.value.hint
    spec = WorkloadSpec.from_document(_doc("  objective: orpo\n"))
    assert (spec.objective, spec.reference, spec.padded, spec.disable_dropout) == ("orpo", None, True, True)


def test_a_trl_orpo_config_dump_is_read_with_its_own_fields() -> None:
    """A real TRL 1.16 ``trl.experimental`` ``ORPOConfig`` dump (tests/data/imports/hf/make_fixtures.py orpo) beside a
    LoRA adapter and model config: ORPO (its ``padding_value``, which no other TRL 1.16 config has), no reference,
    its fields known, nothing left for LS014."""
    from tests.support.imports import imported, plain

    doc, result = imported("hf/orpo/orpo_config.json", "hf/orpo/adapter_config.json", "hf/orpo/config.json")
    assert plain(doc, "training", "objective") == "orpo"
    assert plain(doc, "training", "objective_settings", "reference") == "none"
    assert [f.key for f in result.findings if f.kind == "unknown-key"] == []
    assert _ls014(doc) == []
