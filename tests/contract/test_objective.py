"""``training.objective`` (issue 24, first part): every importer says what the run optimizes, and a preference or RL
objective is never sized as supervised fine-tuning in silence: DPO's step is simulated (its reference from the policy or
precomputed), the others get LS014, a hold on the status, and the step refuses them.

Expected values: the tools' own switches (axolotl's ``rl:``, LLaMA-Factory's ``stage:``, the keys only one TRL 1.16
trainer config has)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS, imported, plain
from tests.support.ledgers import candidate, status_of, with_change


@pytest.mark.parametrize(("rl", "objective"), [("dpo", "dpo"), ("ipo", "dpo"), ("kto", "kto"), ("grpo", "grpo")])
def test_axolotl_rl_names_the_objective(tmp_path: Path, rl: str, objective: str) -> None:
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8") + f"rl: {rl}\n"
    (tmp_path / "rl.yml").write_text(text, encoding="utf-8")
    doc, _ = imported(tmp_path / "rl.yml")
    assert plain(doc, "training", "objective") == objective
    # DPO and KTO (axolotl hands the trainer a peft_config: the reference is the policy with its adapters off) and
    # GRPO (transformers' generate, or vLLM with `trl.use_vllm`) are simulated
    expected = [] if objective in ("dpo", "kto", "grpo") else ["/training/objective"]
    assert [f.pointer for f in validate(doc).findings if f.rule == "LS014"] == expected


def test_axolotl_without_rl_is_sft() -> None:
    doc, _ = imported("axolotl/qlora.yml")
    assert plain(doc, "training", "objective") == "sft"


@pytest.mark.parametrize(("stage", "objective"), [("sft", "sft"), ("dpo", "dpo"), ("kto", "kto"), ("rm", "reward")])
def test_llamafactory_stage_names_the_objective(tmp_path: Path, stage: str, objective: str) -> None:
    path = tmp_path / "lf.yaml"
    path.write_text(
        f"model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: {stage}\nfinetuning_type: lora\n", encoding="utf-8"
    )
    doc, _ = imported(path)
    assert plain(doc, "training", "objective") == objective


@pytest.mark.parametrize(
    ("keys", "objective"),
    [
        ({"beta": 0.1, "precompute_ref_log_probs": False, "max_length": 1024}, "dpo"),
        ({"desirable_weight": 1.0, "undesirable_weight": 1.0}, "kto"),
        ({"center_rewards_coefficient": None}, "reward"),
        ({"num_generations": 8, "max_completion_length": 256}, ("ASSUMPTION", "grpo")),
        ({"num_generations": 2, "normalize_advantages": False, "reward_clip_range": None}, "rloo"),
    ],
)
def test_a_trl_config_dump_names_its_trainer(tmp_path: Path, keys: dict[str, object], objective: object) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output_dir": "out", "learning_rate": 1e-5, **keys}), encoding="utf-8")
    doc, _ = imported(path)
    assert plain(doc, "training", "objective") == objective


@pytest.mark.parametrize(
    ("training", "says"),
    [
        ("  objective: ppo\n", "training.objective ppo:"),
        (
            "  objective: dpo\n  objective_settings: {reference: none}\n",
            "training.objective dpo with reference none:",
        ),
    ],
)
def test_the_step_refuses_an_objective_it_does_not_simulate(training: str, says: str) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    text = (IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")
    doc = from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))
    with pytest.raises(LedgerspecError, match="simulates supervised fine-tuning and TRL 1") as err:
        WorkloadSpec.from_document(doc)
    assert says in str(err.value)
    assert err.value.hint and "LedgerCallback" in err.value.hint


def test_dpo_is_simulated_with_its_reference_from_the_policy_or_precomputed() -> None:
    """TRL 1.16's ``DPOTrainer`` given a ``peft_config`` disables the adapters for the reference
    (dpo_trainer.py:1328-1336) or reads precomputed log-probs (:1318-1319), or runs a separate reference model
    (:1337-1338): all simulated, so no LS014; no reference at all is not (LS014 names the reference)."""
    from ledgerspec.contract import config

    text = (IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")
    for settings, simulated in (
        ("", True),
        ("{reference: precomputed}", True),
        ("{reference: model}", True),
        ("{reference: none}", False),
    ):
        body = "training:\n  objective: dpo\n" + (f"  objective_settings: {settings}\n" if settings else "")
        doc = from_text(text + body, str(IMPORTS / "x.ledger.yaml"))
        assert config.read(doc).training.simulated is simulated
        hits = [f.message for f in validate(doc).findings if f.rule == "LS014"]
        assert (hits == []) is simulated
        if not simulated:
            assert "dpo with reference none" in hits[0]


def test_a_predicted_peak_of_another_objective_is_not_candidate() -> None:
    status, reasons = status_of(with_change(candidate, ("training", "objective"), "ppo"))
    assert status == "CALCULATED"
    assert any("training.objective ppo is not simulated" in r for r in reasons)
    assert status_of(with_change(candidate, ("training", "objective"), "sft"))[0] == "CANDIDATE"
    assert status_of(with_change(candidate, ("training", "objective"), "dpo"))[0] == "CANDIDATE"


def test_a_grpo_config_dump_gives_its_generation_settings(tmp_path: Path) -> None:
    """GRPOConfig's fields keep their names (trl 1.16, grpo_config.py); ``beta: 0.0`` (its default) means no
    reference model."""
    path = tmp_path / "grpo.json"
    keys = {
        "num_generations": 4,
        "max_completion_length": 256,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.25,
        "vllm_enable_sleep_mode": True,
        "vllm_tensor_parallel_size": 1,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_mask",
        "beta": 0.0,
    }
    path.write_text(json.dumps({"output_dir": "out", **keys}), encoding="utf-8")
    doc, result = imported(path)
    s = ("training", "objective_settings")
    assert plain(doc, *s, "vllm_enable_sleep_mode") is True
    assert not [f for f in result.findings if f.kind == "not-modelled"]
    assert [plain(doc, *s, k) for k in ("num_generations", "max_completion_length", "use_vllm", "vllm_mode")] == [
        4,
        256,
        True,
        "colocate",
    ]
    assert plain(doc, *s, "vllm_gpu_memory_utilization") == 0.25
    assert plain(doc, *s, "reference") == "none"
    assert not [f for f in result.findings if f.key in keys and f.kind == "unknown-key"]


def test_a_vllm_setting_the_step_does_not_model_is_a_finding(tmp_path: Path) -> None:
    """Colocated vLLM over several cards (tensor parallel) and the importance-sampling correction off or per token
    change the step, and so does ZeRO-3 without the whole model gathered for ``generate``; they are said, not sized as
    TRL's defaults."""
    path = tmp_path / "grpo.json"
    keys = {
        "num_generations": 4,
        "use_vllm": True,
        "vllm_tensor_parallel_size": 2,
        "vllm_importance_sampling_correction": False,
        "vllm_importance_sampling_mode": "token_mask",
        "ds3_gather_for_generation": False,
    }
    path.write_text(json.dumps({"output_dir": "out", **keys}), encoding="utf-8")
    _, result = imported(path)
    assert sorted(f.key for f in result.findings if f.kind == "not-modelled") == [
        "ds3_gather_for_generation",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_tensor_parallel_size",
    ]


def test_dpo_references_by_tool(tmp_path: Path) -> None:
    """DPO with PEFT and no reference model: the adapters disabled (an ASSUMPTION); precomputed when asked; a
    LLaMA-Factory ``ref_model``: a second model; ``pref_loss: orpo`` runs without one."""
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8")
    (tmp_path / "a.yml").write_text(text + "rl: dpo\n", encoding="utf-8")
    (tmp_path / "b.yml").write_text(text + "rl: dpo\nprecompute_ref_log_probs: true\n", encoding="utf-8")
    s = ("training", "objective_settings", "reference")
    assert plain(imported(tmp_path / "a.yml")[0], *s) == ("ASSUMPTION", "adapter_disabled")
    assert plain(imported(tmp_path / "b.yml")[0], *s) == "precomputed"
    lf = "model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: dpo\nfinetuning_type: lora\n"
    (tmp_path / "c.yaml").write_text(lf + "ref_model: meta-llama/Llama-2-7b-hf\n", encoding="utf-8")
    (tmp_path / "d.yaml").write_text(lf + "pref_loss: orpo\n", encoding="utf-8")
    assert plain(imported(tmp_path / "c.yaml")[0], *s) == "model"
    orpo = imported(tmp_path / "d.yaml")[0]
    assert (plain(orpo, "training", "objective"), plain(orpo, *s)) == ("orpo", "none")


def test_axolotl_dpo_on_a_quantized_base_trains_bfloat16_adapters(tmp_path: Path) -> None:
    """axolotl hands TRL's DPOTrainer a ``peft_config``; TRL 1.16 then casts the adapters of a quantized model to
    bfloat16 (dpo_trainer.py:717-725), where axolotl's own SFT trainer keeps PEFT's float32."""
    text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8")
    (tmp_path / "dpo.yml").write_text(text + "rl: dpo\n", encoding="utf-8")
    assert plain(imported("axolotl/qlora.yml")[0], "adapter", "dtype") == ("ASSUMPTION", "float32")
    assert plain(imported(tmp_path / "dpo.yml")[0], "adapter", "dtype") == ("ASSUMPTION", "bfloat16")


def test_a_trl_dpo_config_dump_is_read_with_its_own_fields() -> None:
    """A real TRL 1.16 ``DPOConfig`` dump (tests/data/imports/hf/make_fixtures.py dpo) beside a QLoRA adapter and model
    config: DPO, its fields known (no "not a setting" finding), the adapters bfloat16 as TRL casts them on a
    quantized base, TRL's dropout switch carried (its default, true), the loss type ignored (per-row floats)."""
    doc, result = imported("hf/dpo/dpo_config.json", "hf/dpo/adapter_config.json", "hf/dpo/config.json")
    assert plain(doc, "training", "objective") == "dpo"
    assert [f.key for f in result.findings if f.kind == "unknown-key"] == []
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "bfloat16")
    assert plain(doc, "training", "objective_settings", "disable_dropout") is True
    assert plain(doc, "training", "objective_settings", "reference") == ("ASSUMPTION", "adapter_disabled")


@pytest.mark.slow
@pytest.mark.parametrize(
    "files", [("axolotl-dpo",), ("hf/dpo/dpo_config.json", "hf/dpo/adapter_config.json", "hf/dpo/config.json")]
)
def test_a_dpo_setup_imports_resolves_estimates_and_reports(tmp_path: Path, files: tuple[str, ...]) -> None:
    """Done-when of issue 24 for DPO: an axolotl ``rl: dpo`` config and TRL's DPOConfig import, resolve, estimate and
    report, with nothing UNKNOWN that the estimate needs."""
    pytest.importorskip("torch")
    from tests.support import run_cli

    if files == ("axolotl-dpo",):
        text = (IMPORTS / "axolotl" / "qlora.yml").read_text(encoding="utf-8") + "rl: dpo\n"
        (tmp_path / "dpo.yml").write_text(text, encoding="utf-8")
        paths = [tmp_path / "dpo.yml"]
    else:
        paths = [IMPORTS / f for f in files]
    intake, ledger = tmp_path / "dpo.intake.yaml", tmp_path / "dpo.ledger.yaml"
    code, _, err = run_cli("import", *paths, "-o", intake)
    assert code == 0, err
    code, _, err = run_cli("resolve", intake, "-o", ledger)
    assert code == 0, err
    code, _, err = run_cli("estimate", ledger, "--device-memory", "24GiB")
    assert code == 0, err
    assert "DPOTrainer step" in (
        from_text(ledger.read_text("utf-8"), str(ledger)).get("ledger", "activations").method or ""
    )
    code, _, err = run_cli("report", ledger)
    assert code == 0, err


def test_the_objective_settings_keep_earlier_stamps() -> None:
    """Stamps written before the DPO step was simulated never hashed ``objective_settings``: TRL's defaults (the
    reference the importers wrote, dropout disabled) and every other objective's settings stay out of the digest; a
    DPO document's precomputed reference is in it (it changes the step). GRPO/RLOO documents have no earlier stamps
    (their step was refused): each setting their step reads is in their digest."""
    from ledgerspec.contract import fingerprint as F

    text = (IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")

    def digest(training: str) -> str:
        doc = from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))
        return F.digests(doc, F.WORKLOAD_INPUTS)["training"]

    assert digest("  objective: dpo\n") == digest(
        "  objective: dpo\n  objective_settings: {reference: adapter_disabled, disable_dropout: true}\n"
    )
    # GRPO and RLOO are simulated since after the first stamps: every setting their step reads is in the digest,
    # TRL's default reference written out or not (none for GRPO at beta 0; adapter_disabled is another step)
    assert digest("  objective: rloo\n") != digest("  objective: rloo\n  objective_settings: {reference: model}\n")
    assert digest("  objective: kto\n") == digest(
        "  objective: kto\n  objective_settings: {reference: adapter_disabled}\n"
    )
    assert digest("  objective: kto\n") != digest("  objective: kto\n  objective_settings: {reference: precomputed}\n")
    for setting in (
        "reference: adapter_disabled",
        "max_completion_length: 256",
        "num_generations: 4",
        "steps_per_generation: 2",
        "generation_batch_size: 16",
        "use_vllm: true",
        "vllm_enable_sleep_mode: true",
        "disable_dropout: true",
    ):
        grpo = "  objective: grpo\n  objective_settings: {" + setting + "}\n"
        assert digest("  objective: grpo\n") != digest(grpo), setting
    # no other objective's digest reads GRPO's settings
    assert digest("  objective: dpo\n") == digest("  objective: dpo\n  objective_settings: {num_generations: 4}\n")
    assert digest("  objective: dpo\n") != digest("  objective: dpo\n  objective_settings: {reference: precomputed}\n")


def test_llamafactory_dpo_runs_an_older_trl_and_is_not_simulated(tmp_path: Path) -> None:
    """LLaMA-Factory's DPO trainer subclasses TRL's at the TRL it pins (trl>=0.8.6,<=0.9.6), whose DPOTrainer computes
    the full logits of the policy and the reference: not TRL 1.16's step, so LS014 names it and the status is held."""
    path = tmp_path / "lf.yaml"
    path.write_text(
        "model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: dpo\nfinetuning_type: lora\n", encoding="utf-8"
    )
    doc, _ = imported(path)
    assert plain(doc, "software", "trl") == ("ASSUMPTION", "0.9.6")
    hits = [f.message for f in validate(doc).findings if f.rule == "LS014"]
    assert len(hits) == 1 and "dpo on TRL 0.9.6" in hits[0]
    sft = tmp_path / "sft.yaml"
    sft.write_text(
        "model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: sft\nfinetuning_type: lora\n", encoding="utf-8"
    )
    assert plain(imported(sft)[0], "software", "trl") == "absent"


def test_an_rloo_config_dump_imports_as_rloo_with_its_reference(tmp_path: Path) -> None:
    """RLOOConfig's own keys (trl 1.16, rloo_config.py:531-541) name it; its default ``beta: 0.05`` means the reference
    log-probs of the policy with its adapters off (an ASSUMPTION: the trainer may be given a reference model)."""
    path = tmp_path / "rloo.json"
    keys = {"num_generations": 2, "max_completion_length": 128, "beta": 0.05, "normalize_advantages": False}
    path.write_text(json.dumps({"output_dir": "out", **keys}), encoding="utf-8")
    doc, result = imported(path)
    assert plain(doc, "training", "objective") == "rloo"
    assert plain(doc, "training", "objective_settings", "reference") == ("ASSUMPTION", "adapter_disabled")
    assert not [f for f in result.findings if f.key in keys and f.kind == "unknown-key"]


def test_a_live_grpo_config_dump_imports_with_grpo_config_keys(tmp_path: Path) -> None:
    """A dump of a live ``GRPOConfig`` (``args.to_dict()``, TRL 1.16: every field, ``generation_batch_size`` derived
    beside ``steps_per_generation``, grpo_config.py:1097-1116): read with GRPOConfig's own key list, no SFTConfig length
    or packing default, the sampling and loss settings at TRL's defaults read."""
    dump = {
        "output_dir": "out",
        "per_device_train_batch_size": 8,
        "num_generations": 8,
        "max_completion_length": 256,
        "generation_batch_size": 8,
        "steps_per_generation": 1,
        "beta": 0.0,
        "loss_type": "dapo",
        "temperature": 1.0,
        "top_k": 0,
        "min_p": None,
        "num_iterations": 1,
        "epsilon": 0.2,
        "scale_rewards": "group",
        "vllm_server_host": "0.0.0.0",
        "log_completions": False,
        "cast_lm_head_to_fp32": False,
        "use_vllm": False,
        "vllm_mode": "colocate",
    }
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(dump), encoding="utf-8")
    doc, result = imported(path)
    assert plain(doc, "training", "objective") == ("ASSUMPTION", "grpo")  # RLOOConfig has these keys too
    kinds = {f.key: f.kind for f in result.findings}
    assert kinds == {"generation_batch_size": "note"}, kinds
    s = ("training", "objective_settings")
    assert plain(doc, *s, "steps_per_generation") == 1
    assert plain(doc, *s, "generation_batch_size") == "absent"
    assert plain(doc, "workload", "max_length") == "UNKNOWN"  # GRPOConfig has no sequence length
    assert plain(doc, "workload", "packing") is False
    assert "TRL 1.16.0 GRPOConfig" in result.text  # x-import.tools
