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


def _inject(config: str, names: list[str] | str, tmp_path: Path, **method: str) -> object:
    targets_yaml = f"[{', '.join(names)}]" if isinstance(names, list) else f"'{names}'"
    extra = "".join(f"  {k}: {v}\n" for k, v in method.items())
    doc = from_text(
        f"""ledgerspec: intake/v1
identity:
  config_path: {CONFIGS / config}
method:
  kind: LoRA
  rank: 4
  target_modules: {targets_yaml}
{extra}base_model:
  loaded_dtype: bfloat16
""",
        str(tmp_path / "t.intake.yaml"),
    )
    model = build_meta_model(doc, load_config(doc, offline=True))
    return inject_adapters(doc, model, on_meta=True)


def _refused(config: str, names: list[str] | str, tmp_path: Path, **method: str) -> str:
    with pytest.raises(LedgerspecError) as err:
        _inject(config, names, tmp_path, **method)
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
    msg = _refused("llama_gqa.json", ["nope_proj"], tmp_path)
    assert "'nope_proj' matches no module" in msg and "smaller than declared" not in msg  # PEFT refused outright
    # PEFT's own message starts with the whole set of targets: long names push its phrase past the one-line cut
    long = [f"model.layers.{i}.self_attn.q_prj" for i in range(8)]
    assert "'model.layers.0.self_attn.q_prj', 'model.layers.1" in _refused("llama_gqa.json", long, tmp_path)


def test_twenty_names_or_more_are_checked_too(tmp_path: Path) -> None:
    """From 20 names PEFT shortens target_modules in place to the shortest endings that tell them apart."""
    parts = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    names = [f"model.layers.{i}.{part}" for i in range(2) for part in parts] + list(parts[:6])
    names.append("model.layers.0.self_attn.v_prj")
    assert len(set(names)) == 21
    assert "'model.layers.0.self_attn.v_prj' matches no module" in _refused("llama_gqa.json", names, tmp_path)


def test_a_name_left_out_on_purpose_is_not_refused_and_a_misspelt_exclusion_is(tmp_path: Path) -> None:
    wrapped = _inject("llama_gqa.json", ["q_proj", "o_proj"], tmp_path, exclude_modules="[o_proj]")
    assert not any(a.endswith("o_proj") for a in wrapped.targeted_module_names)  # type: ignore[attr-defined]
    msg = _refused("llama_gqa.json", ["q_proj", "o_proj"], tmp_path, exclude_modules="[o_prj]")
    assert "method.exclude_modules: 'o_prj' matches no module" in msg and "did you mean 'o_proj'?" in msg


def test_a_misspelt_module_to_save_is_refused(tmp_path: Path) -> None:
    """PEFT skips it in silence: a whole trainable copy of lm_head and its optimizer state would be missing."""
    _inject("llama_gqa.json", ["q_proj"], tmp_path, modules_to_save="[lm_head]")
    msg = _refused("llama_gqa.json", ["q_proj"], tmp_path, modules_to_save="[lm_haed]")
    assert "method.modules_to_save: 'lm_haed' matches no module" in msg and "did you mean 'lm_head'?" in msg


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("q_proj", "a string is one regular expression"),
        ("all_linear", "did you mean 'all-linear'?"),
        (".*\\.(q_prj|v_proj)x", "check module names against the architecture"),  # a pattern: not told to list it
    ],
)
def test_a_string_that_matches_nothing_gets_the_hint_that_fits(tmp_path: Path, value: str, hint: str) -> None:
    assert hint in _refused("llama_gqa.json", value, tmp_path)


def test_the_rule_is_a_name_or_a_dotted_suffix() -> None:
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kq_proj"]
    assert targets.unmatched(["q_proj", "self_attn.q_proj", "proj", "attn.q_proj"], names) == ["proj", "attn.q_proj"]


def test_a_rank_or_alpha_pattern_that_matches_no_adapted_module_is_refused(tmp_path: Path) -> None:
    """PEFT warns and ignores such a key: the module keeps method.rank (or was never adapted)."""
    wrapped = _inject("llama_gqa.json", ["q_proj", "o_proj"], tmp_path, rank_pattern="{o_proj: 2}")
    assert any(a.endswith("o_proj") for a in wrapped.targeted_module_names)  # type: ignore[attr-defined]
    msg = _refused("llama_gqa.json", ["q_proj", "o_proj"], tmp_path, rank_pattern="{o_prj: 2}")
    assert "method.rank_pattern: 'o_prj' matches no adapted module of LlamaForCausalLM" in msg
    assert "did you mean 'o_proj'?" in msg
    not_adapted = _refused("llama_gqa.json", ["q_proj"], tmp_path, alpha_pattern="{v_proj: 4}")
    assert "method.alpha_pattern: 'v_proj' matches no adapted module" in not_adapted
    # a regular expression, as PEFT reads the keys: layer 1's projections only
    _inject("llama_gqa.json", ["q_proj", "o_proj"], tmp_path, rank_pattern="{'layers\\.1\\.self_attn\\.o_proj': 2}")


def test_peft_itself_warns_of_the_keys_the_check_refuses(tmp_path: Path) -> None:
    """The rule is PEFT's own: its warning names exactly the key refused above."""
    import warnings

    from ledgerspec.derivations.stack.build import lora_config

    doc = from_text(
        f"ledgerspec: intake/v1\nidentity:\n  config_path: {CONFIGS / 'llama_gqa.json'}\nmethod:\n  kind: LoRA\n"
        "  rank: 4\n  target_modules: [q_proj, o_proj]\n  rank_pattern: {o_prj: 2, o_proj: 3}\n"
        "base_model:\n  loaded_dtype: bfloat16\n",
        str(tmp_path / "t.intake.yaml"),
    )
    model = build_meta_model(doc, load_config(doc, offline=True))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft.get_peft_model(model, lora_config(doc), low_cpu_mem_usage=True)
    assert any("rank_pattern keys did not match" in str(w.message) and "['o_prj']" in str(w.message) for w in seen)
