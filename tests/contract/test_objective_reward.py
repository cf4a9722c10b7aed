"""``training.objective: reward`` (issue 24): a reward model's step is simulated as TRL 1.16's ``RewardTrainer`` runs
it (its truths: tests/derivations/engine/test_reward_truth.py), so LS014 stays quiet for it, but not for a declared
older TRL; a ``RewardConfig`` dump imports with its own fields; its settings enter the stamps of reward documents
only, TRL's defaults left out.

Expected values: TRL 1.16's own ``RewardConfig`` dump (tests/data/imports/hf/make_fixtures.py reward) and its source
lines, cited on each test."""

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
FILES = ("hf/reward/reward_config.json", "hf/reward/adapter_config.json", "hf/reward/config.json")


def _doc(training: str, software: str = "") -> Any:
    text = EXAMPLE.read_text(encoding="utf-8") + (f"software:\n{software}" if software else "")
    return from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))


def _ls014(doc: Any) -> list[str]:
    return [f.message for f in validate(doc).findings if f.rule == "LS014"]


def test_a_reward_model_is_simulated_on_trl_1_16_not_on_an_older_one() -> None:
    assert "reward" in config.SIMULATED_OBJECTIVES
    assert config.Training(objective="reward").simulated
    assert config.Training(objective="reward", trl="1.16.0").simulated
    assert not config.Training(objective="reward", trl="0.9.6").simulated
    assert _ls014(_doc("  objective: reward\n")) == []
    hits = _ls014(_doc("  objective: reward\n", "  trl: 0.9.6\n"))
    assert len(hits) == 1 and "reward on TRL 0.9.6" in hits[0]


def test_the_step_refuses_an_older_trl_and_a_custom_loop_in_one_line() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    with pytest.raises(LedgerspecError, match=r"reward on TRL 0\.9\.6") as err:
        WorkloadSpec.from_document(_doc("  objective: reward\n", "  trl: 0.9.6\n"))
    assert "\n" not in str(err.value)
    with pytest.raises(LedgerspecError, match=r"RewardTrainer, a transformers\.Trainer") as err:
        WorkloadSpec.from_document(_doc("  objective: reward\n  loop: custom\n"))
    assert "\n" not in str(err.value)


def test_the_reward_spec_reads_its_settings() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    spec = WorkloadSpec.from_document(_doc("  objective: reward\n"))
    assert (spec.objective, spec.disable_dropout, spec.center_rewards, spec.padded) == ("reward", True, None, True)
    spec = WorkloadSpec.from_document(
        _doc("  objective: reward\n  objective_settings: {center_rewards_coefficient: 0.01, disable_dropout: false}\n")
    )
    assert (spec.center_rewards, spec.disable_dropout) == (0.01, False)


def test_a_trl_reward_config_dump_is_read_with_its_own_fields() -> None:
    """A real TRL 1.16 ``RewardConfig`` dump beside a QLoRA base and a ``SEQ_CLS`` adapter config: a reward model, its
    fields known (no "not a setting" finding), the adapters bfloat16 as TRL casts them on a quantized base
    (reward_trainer.py:549-554), its centring coefficient and dropout switch carried."""
    doc, result = imported(*FILES)
    assert plain(doc, "training", "objective") == "reward"
    assert [f.key for f in result.findings if f.kind == "unknown-key"] == []
    dtype = plain(doc, "adapter", "dtype")
    assert dtype == ("ASSUMPTION", "bfloat16")
    assert plain(doc, "training", "objective_settings", "center_rewards_coefficient") == 0.01
    assert plain(doc, "training", "objective_settings", "disable_dropout") is True
    assert plain(doc, "training", "objective_settings", "reference") == "absent"
    assert _ls014(doc) == []


def test_the_reward_settings_keep_earlier_stamps() -> None:
    """TRL's defaults stay out of a reward document's digest; the centring coefficient is in it; neither enters any
    other objective's."""
    from ledgerspec.contract import fingerprint as F

    def digest(training: str) -> str:
        return F.digests(_doc(training), F.WORKLOAD_INPUTS)["training"]

    reward = "  objective: reward\n"
    assert digest(reward) == digest(reward + "  objective_settings: {disable_dropout: true}\n")
    assert digest(reward) != digest(reward + "  objective_settings: {center_rewards_coefficient: 0.01}\n")
    assert digest(reward) != digest(reward + "  objective_settings: {disable_dropout: false}\n")
    assert digest(reward + "  objective_settings: {center_rewards_coefficient: 0.01}\n") == digest(
        reward + "  objective_settings: {center_rewards_coefficient: 0.010}\n"
    )
    sft = "  objective: sft\n"
    assert digest(sft) == digest(sft + "  objective_settings: {center_rewards_coefficient: 0.01}\n")
    dpo = "  objective: dpo\n"
    assert digest(dpo) == digest(dpo + "  objective_settings: {center_rewards_coefficient: 0.01}\n")


def test_llamafactory_rm_is_not_simulated(tmp_path: Path) -> None:
    """LLaMA-Factory's ``stage: rm`` runs at the TRL it pins (the importer assumes trl 0.9.6), not TRL 1.16's
    RewardTrainer step: LS014 names it."""
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: rm\nfinetuning_type: lora\n", "utf-8")
    doc, _ = imported(path)
    assert plain(doc, "training", "objective") == "reward"
    hits = _ls014(doc)
    assert len(hits) == 1 and "reward on TRL 0.9.6" in hits[0]


@pytest.mark.slow
def test_a_reward_setup_imports_resolves_estimates_and_reports(tmp_path: Path) -> None:
    """TRL's RewardConfig with its adapter and model config import, resolve (a sequence classifier: no LM head, the
    score head and PEFT's trainable copy of it), estimate (the RewardTrainer step) and report."""
    pytest.importorskip("torch")
    from tests.support import run_cli

    intake, ledger = tmp_path / "reward.intake.yaml", tmp_path / "reward.ledger.yaml"
    code, _, err = run_cli("import", *(IMPORTS / f for f in FILES), "-o", intake)
    assert code == 0, err
    code, _, err = run_cli("resolve", intake, "-o", ledger)
    assert code == 0, err
    code, _, err = run_cli("estimate", ledger, "--device-memory", "24GiB")
    assert code == 0, err
    doc = from_text(ledger.read_text("utf-8"), str(ledger))
    assert "RewardTrainer step" in (doc.get("ledger", "activations").method or "")
    code, _, err = run_cli("report", ledger)
    assert code == 0, err
