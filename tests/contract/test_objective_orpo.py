"""``training.objective: orpo`` and ``cpo`` (issue 24): their steps are simulated as TRL 1.16's ``trl.experimental``
``ORPOTrainer`` and ``CPOTrainer`` run them (their truths: test_orpo_truth.py and test_cpo_truth.py in
tests/derivations/engine), on a 16/32-bit base and on a bitsandbytes 4-bit one (TRL prepares it, casts modules with
bf16 and autocasts its loss, orpo_trainer.py:219-265, 880-892: the ledger declares the preparation and the casts,
LS015 names a declaration that differs); on a GPTQ/AWQ base and on a declared older TRL (LLaMA-Factory's) they are
not: LS014 names it and the step refuses it in one line."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract import config
from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support.imports import IMPORTS

EXAMPLE = IMPORTS.parent.parent.parent / "examples" / "llama-2-7b-lora.ledger.yaml"


TRL_CASTS = "{norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}"
AXOLOTL_CASTS = "{norm: bfloat16, lm_head: bfloat16, embed_tokens: bfloat16}"


def _doc(training: str, software: str = "", quantized: bool = False, casts: str = "") -> Any:
    text = EXAMPLE.read_text(encoding="utf-8")
    if quantized:
        assert "  quantized: false" in text
        text = text.replace(
            "  quantized: false",
            "  quantized: true\n  quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16}"
            + (f"\n  module_dtypes: {casts}" if casts else ""),
            1,
        )
    text += f"software:\n{software}" if software else ""
    return from_text(text + "training:\n" + training, str(IMPORTS / "x.ledger.yaml"))


def _ls014(doc: Any) -> list[str]:
    return [f.message for f in validate(doc).findings if f.rule == "LS014"]


@pytest.mark.parametrize("objective", ["orpo", "cpo"])
def test_it_is_simulated_on_a_16_bit_base_and_trl_1_16(objective: str) -> None:
    assert config.Training(objective=objective).simulated
    assert not config.Training(objective=objective, trl="0.9.6").simulated
    assert _ls014(_doc(f"  objective: {objective}\n")) == []
    hits = _ls014(_doc(f"  objective: {objective}\n", "  trl: 0.9.6\n"))
    assert len(hits) == 1 and f"{objective} on TRL 0.9.6" in hits[0]


@pytest.mark.parametrize("objective", ["orpo", "cpo"])
def test_on_a_4_bit_base_it_is_simulated_with_trls_preparation(objective: str) -> None:
    """nf4: no LS014; the step runs TRL's autocast of ``compute_loss`` with bf16 and TRL's casts declared only
    (``_peft_has_been_casted_to_bf16`` is set by those casts, orpo_trainer.py:262-265); LS015 names what the ledger
    leaves out or declares otherwise than TRL does (here: no preparation, no casts)."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    doc = _doc(f"  objective: {objective}\n  mixed_precision: bf16\n", quantized=True)
    assert _ls014(doc) == []
    ls015 = {f.pointer for f in validate(doc).findings if f.rule == "LS015"}
    assert ls015 == {"/base_model/prepare_for_kbit_training", "/base_model/module_dtypes"}
    assert not WorkloadSpec.from_document(doc).loss_autocast  # no casts declared: TRL's flag is not set
    trl = _doc(f"  objective: {objective}\n  mixed_precision: bf16\n", quantized=True, casts=TRL_CASTS)
    assert WorkloadSpec.from_document(trl).loss_autocast
    assert {f.pointer for f in validate(trl).findings if f.rule == "LS015"} == {"/base_model/prepare_for_kbit_training"}
    # axolotl's rl: orpo hands TRL a PEFT model: its own casts, no TRL casts, no region
    axolotl = _doc(f"  objective: {objective}\n  mixed_precision: bf16\n", quantized=True, casts=AXOLOTL_CASTS)
    assert not WorkloadSpec.from_document(axolotl).loss_autocast
    plain = _doc(f"  objective: {objective}\n  mixed_precision: 'no'\n", quantized=True, casts=TRL_CASTS)
    assert not WorkloadSpec.from_document(plain).loss_autocast
    spec = WorkloadSpec.from_document(_doc(f"  objective: {objective}\n"))
    assert (spec.objective, spec.reference, spec.padded, spec.disable_dropout) == (objective, None, True, True)
    assert not spec.loss_autocast


@pytest.mark.parametrize("objective", ["orpo", "cpo"])
def test_on_a_gptq_base_it_is_not_simulated(objective: str) -> None:
    """TRL prepares and casts a bitsandbytes base only (``is_loaded_in_4bit``); a GPTQ base's step has no truth."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    doc = _gptq(objective)
    hits = _ls014(doc)
    assert len(hits) == 1 and f"{objective} on a base quantized as gptq" in hits[0]
    with pytest.raises(LedgerspecError, match=rf"{objective} on a GPTQ base") as err:
        WorkloadSpec.from_document(doc)
    assert "\n" not in str(err.value) and err.value.hint and "LedgerCallback" in err.value.hint


def _gptq(objective: str) -> Any:
    text = EXAMPLE.read_text(encoding="utf-8").replace(
        "  quantized: false",
        "  quantized: true\n  quantization: {type: gptq, bits: 4, group_size: 128, kernel: triton_v2}",
        1,
    )
    return from_text(text + f"training:\n  objective: {objective}\n", str(IMPORTS / "x.ledger.yaml"))


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


@pytest.mark.slow  # imports TRL (seconds)
def test_a_trl_cpo_config_dump_is_read_with_its_own_fields(tmp_path: Any) -> None:
    """TRL 1.16's ``CPOConfig`` as it dumps itself: CPO (its ``cpo_alpha``), no reference, its fields known."""
    pytest.importorskip("trl")
    import json
    import warnings

    from tests.support.imports import imported, plain

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig

        dump = json.loads(CPOConfig(output_dir="out", use_cpu=True).to_json_string())
    path = tmp_path / "cpo_config.json"
    path.write_text(json.dumps(dump), encoding="utf-8")
    doc, result = imported(path)
    assert plain(doc, "training", "objective") == "cpo"
    assert plain(doc, "training", "objective_settings", "reference") == "none"
    assert [f.key for f in result.findings if f.kind == "unknown-key"] == []


def test_a_trl_orpo_config_dump_on_a_4_bit_base_declares_trls_preparation(tmp_path: Any) -> None:
    """The ORPOConfig dump (bf16) beside a model config with a bitsandbytes nf4 ``quantization_config``: the import
    declares what TRL 1.16's ORPOTrainer does to that base (orpo_trainer.py:220-265): prepared for k-bit training,
    PEFT's float32 adapters (not the bfloat16 TRL's other trainers cast them to), TRL's bf16 casts; nothing for LS014
    or LS015."""
    import json
    import shutil

    from tests.support.imports import imported, plain

    for name in ("orpo_config.json", "adapter_config.json"):
        shutil.copy(IMPORTS / "hf" / "orpo" / name, tmp_path / name)
    config = json.loads((IMPORTS / "hf" / "orpo" / "config.json").read_text(encoding="utf-8"))
    dpo = json.loads((IMPORTS / "hf" / "dpo" / "config.json").read_text(encoding="utf-8"))
    assert dpo["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    config["quantization_config"] = dpo["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    doc, _ = imported(tmp_path / "orpo_config.json", tmp_path / "adapter_config.json", tmp_path / "config.json")
    assert plain(doc, "method", "kind") == "QLoRA"
    assert plain(doc, "base_model", "prepare_for_kbit_training") is True
    assert plain(doc, "base_model", "module_dtypes") == {
        "norm": "float32",
        "lm_head": "bfloat16",
        "embed_tokens": "bfloat16",
    }
    assert plain(doc, "adapter", "dtype") == ("ASSUMPTION", "float32")
    assert [f.rule for f in validate(doc).findings if f.rule in ("LS014", "LS015")] == []
