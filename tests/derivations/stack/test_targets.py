"""The names of ``method.target_modules`` that adapt nothing: PEFT injects the others and skips them in silence, so
``inject_adapters`` refuses them, after PEFT's own conversion of transformers 4's expert names (real PEFT, real
tiny models built by transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ledgerspec.contract.document import from_text  # noqa: E402
from ledgerspec.derivations.stack import targets  # noqa: E402
from ledgerspec.derivations.stack.build import build_meta_model, inject_adapters, load_config  # noqa: E402
from ledgerspec.errors import LedgerspecError  # noqa: E402
from tests.support import DATA  # noqa: E402

CONFIGS = DATA / "resolve" / "configs"


def _inject(config: str, names: list[str], tmp_path: Path) -> object:
    doc = from_text(
        f"""ledgerspec: intake/v1
identity:
  config_path: {CONFIGS / config}
method:
  kind: LoRA
  rank: 4
  target_modules: [{", ".join(names)}]
base_model:
  loaded_dtype: bfloat16
""",
        str(tmp_path / "t.intake.yaml"),
    )
    model = build_meta_model(doc, load_config(doc, offline=True))
    return inject_adapters(doc, model, on_meta=True)


def _refused(config: str, names: list[str], tmp_path: Path) -> str:
    with pytest.raises(LedgerspecError) as err:
        _inject(config, names, tmp_path)
    return str(err.value)


def test_a_misspelt_name_among_matching_ones_is_refused_with_a_guess(tmp_path: Path) -> None:
    msg = _refused("llama_gqa.json", ["q_proj", "v_prj", "down_proj", "all-linear"], tmp_path)
    assert "'v_prj', 'all-linear' match no module of LlamaForCausalLM" in msg
    assert "did you mean 'v_proj'?" in msg and "only as a string" in msg


def test_names_that_match_by_suffix_or_whole_name_are_kept(tmp_path: Path) -> None:
    wrapped = _inject("llama_gqa.json", ["q_proj", "model.layers.0.mlp.up_proj"], tmp_path)
    adapted = list(wrapped.targeted_module_names)  # type: ignore[attr-defined]
    assert any(a.endswith(".q_proj") for a in adapted) and "model.layers.0.mlp.up_proj" in adapted


def test_the_expert_names_peft_converts_count_as_matched(tmp_path: Path) -> None:
    """transformers 5 fuses Mixtral's w1/w3 into one gate_up_proj parameter; PEFT converts the names and adapts it."""
    wrapped = _inject("mixtral_tiny.json", ["q_proj", "w1", "w3"], tmp_path)
    assert list(wrapped.targeted_parameter_names)  # type: ignore[attr-defined]
    msg = _refused("mixtral_tiny.json", ["q_proj", "w1", "w3", "w4"], tmp_path)
    assert "'w4' matches no module of MixtralForCausalLM" in msg and "'w1'" not in msg


def test_nothing_matched_gets_the_same_message(tmp_path: Path) -> None:
    assert "'nope_proj' matches no module" in _refused("llama_gqa.json", ["nope_proj"], tmp_path)


def test_the_rule_is_a_name_or_a_dotted_suffix() -> None:
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kq_proj"]
    assert targets.unmatched(["q_proj", "self_attn.q_proj", "proj", "attn.q_proj"], names) == ["proj", "attn.q_proj"]
