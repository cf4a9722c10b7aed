"""``training.objective: kto`` (issue 24): KTO's step is simulated as TRL 1.16's ``KTOTrainer`` runs it, its reference
from the policy (adapters off, or TRL's frozen copy of the adapter), a separate reference model or precomputed (its
truths: tests/derivations/engine/test_kto_truth.py), so LS014 stays quiet for it, but not for no reference at all nor
a declared older TRL; a ``KTOConfig`` dump imports with its own fields.

Expected values: TRL 1.16's own ``KTOConfig`` dump (tests/data/imports/hf/make_fixtures.py kto) and its source lines,
cited on each test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract import config
from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS, imported, plain

EXAMPLE = IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml"
FILES = ("hf/kto/kto_config.json", "hf/kto/adapter_config.json", "hf/kto/config.json")


def _doc(training: str, software: str = "", microbatch: int = 2) -> Any:
    """The example ledger (one row per micro-step) with ``microbatch`` rows: KTO needs two or more."""
    text = EXAMPLE.read_text(encoding="utf-8").replace("  microbatch: 1", f"  microbatch: {microbatch}", 1)
    text += f"software:\n{software}" if software else ""
    return from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))


def _ls014(doc: Any) -> list[str]:
    return [f.message for f in validate(doc).findings if f.rule == "LS014"]


def test_kto_is_simulated_with_its_reference_from_the_policy_a_model_or_precomputed() -> None:
    assert "kto" in config.SIMULATED_OBJECTIVES
    for reference in (None, "adapter_disabled", "adapter_copy", "model", "precomputed"):
        assert config.Training(objective="kto", reference=reference).simulated
    assert not config.Training(objective="kto", reference="none").simulated
    assert not config.Training(objective="kto", trl="0.9.6").simulated
    assert _ls014(_doc("  objective: kto\n")) == []
    assert _ls014(_doc("  objective: kto\n  objective_settings: {reference: model}\n")) == []
    hits = _ls014(_doc("  objective: kto\n  objective_settings: {reference: none}\n"))
    assert len(hits) == 1 and "kto with reference none" in hits[0]
    hits = _ls014(_doc("  objective: kto\n", "  trl: 0.9.6\n"))
    assert len(hits) == 1 and "kto on TRL 0.9.6" in hits[0]


def test_the_step_refuses_no_reference_and_a_custom_loop_in_one_line() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    spec = WorkloadSpec.from_document(_doc("  objective: kto\n  objective_settings: {reference: model}\n"))
    assert spec.reference == "model"
    with pytest.raises(LedgerspecError, match=r"kto with reference none") as err:
        WorkloadSpec.from_document(_doc("  objective: kto\n  objective_settings: {reference: none}\n"))
    assert "\n" not in str(err.value) and err.value.hint and "LedgerCallback" in err.value.hint
    with pytest.raises(LedgerspecError, match=r"KTOTrainer, a transformers\.Trainer") as err:
        WorkloadSpec.from_document(_doc("  objective: kto\n  loop: custom\n"))
    assert "\n" not in str(err.value)


def test_one_row_per_micro_step_is_refused_as_trl_refuses_it() -> None:
    """TRL 1.16's KTOTrainer raises for ``per_device_train_batch_size <= 1`` with its KL term (kto_trainer.py:844-847):
    the step refuses it in one line at workload.microbatch."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    with pytest.raises(LedgerspecError, match=r"KTOTrainer refuses it") as err:
        WorkloadSpec.from_document(_doc("  objective: kto\n", microbatch=1))
    assert "\n" not in str(err.value)


def test_the_kto_spec_reads_its_settings() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    spec = WorkloadSpec.from_document(_doc("  objective: kto\n"))
    assert (spec.objective, spec.reference, spec.disable_dropout) == ("kto", "adapter_disabled", True)
    spec = WorkloadSpec.from_document(
        _doc("  objective: kto\n  objective_settings: {reference: precomputed, max_completion_length: 100}\n")
    )
    assert (spec.reference, spec.completion) == ("precomputed", 100)


def test_a_trl_kto_config_dump_is_read_with_its_own_fields() -> None:
    """A real TRL 1.16 ``KTOConfig`` dump beside a QLoRA adapter and model config: KTO, its fields known (no "not a
    setting" finding), its default loss and the losses' weights ignored (floats), the adapters bfloat16 as TRL casts
    them on a quantized base (kto_trainer.py:777-780), the reference the policy with its adapters off."""
    doc, result = imported(*FILES)
    assert plain(doc, "training", "objective") == "kto"
    assert [f.key for f in result.findings if f.kind == "unknown-key"] == []
    assert not {"loss_type", "desirable_weight", "undesirable_weight"} & {f.key for f in result.findings}
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "bfloat16")
    assert plain(doc, "training", "objective_settings", "reference") == ("ASSUMPTION", "adapter_disabled")
    assert _ls014(doc) == []


def test_axolotl_kto_on_a_quantized_base_trains_bfloat16_adapters(tmp_path: Path) -> None:
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8")
    (tmp_path / "kto.yml").write_text(text + "rl: kto\n", encoding="utf-8")
    doc, _ = imported(tmp_path / "kto.yml")
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "bfloat16")
    assert _ls014(doc) == []


def test_llamafactory_kto_is_not_simulated(tmp_path: Path) -> None:
    """LLaMA-Factory's KTO trainer subclasses TRL's at the TRL it pins (the importer assumes 0.9.6): LS014."""
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: kto\nfinetuning_type: lora\n", "utf-8")
    doc, _ = imported(path)
    hits = _ls014(doc)
    assert len(hits) == 1 and "kto on TRL 0.9.6" in hits[0]
