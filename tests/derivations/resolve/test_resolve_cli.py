"""``ledgerspec resolve``: write-back (comments, order, quoting, idempotence, precedence), --check, --dry-run,
intake -> ledger, and one clear error per bad input with the file untouched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support import TESTS

pytest.importorskip("torch")
pytest.importorskip("peft")

DATA = TESTS / "data" / "resolve"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A copy of tests/data/resolve (configs, fixtures, bad inputs) that the test may change."""
    dest = tmp_path / "resolve"
    shutil.copytree(DATA, dest)
    return dest


def test_resolve_fills_figures_and_keeps_comments_order_and_quoting(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    before = path.read_text()
    code, _, err = cli("resolve", path)
    assert code == 0, err
    after = path.read_text()
    for line in before.splitlines():  # every original line survives, except the MEASURED one is unchanged too
        assert line in after, f"lost: {line!r}"
    doc = load(str(path))
    assert doc.get("method", "trainable_parameters").source == "VERIFIED"
    # q_proj 64->64 and v_proj 64->32 (GQA: 2 kv heads x 16), 2 layers, rank 8
    assert doc.get("method", "trainable_parameters").value == 2 * 8 * ((64 + 64) + (64 + 32))
    assert doc.get("ledger", "frozen_base").source == "CALCULATED"
    assert "MiB" in after or "KiB" in after  # human-readable size comments beside byte figures
    keys = list(doc.data.keys())
    assert keys[:5] == ["ledgerspec", "status", "title", "identity", "method"]  # the status the figures support
    assert doc.plain["status"] == "CALCULATED"


def test_resolve_never_weakens_a_measured_value(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    code, _, err = cli("resolve", path)
    assert code == 0
    v = load(str(path)).get("ledger", "adapter")
    assert (v.value, v.source) == (123, "MEASURED")
    assert "kept /ledger/adapter" in err


def test_second_resolve_changes_nothing(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    assert cli("resolve", path)[0] == 0
    first = path.read_text()
    code, _, err = cli("resolve", path)
    assert code == 0 and "up to date" in err
    assert path.read_text() == first
    assert cli("resolve", "--check", path)[0] == 0


def test_check_exits_1_and_writes_nothing(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    before = path.read_bytes()
    code, _, err = cli("resolve", "--check", path)
    assert code == 1 and "would change" in err
    assert path.read_bytes() == before


def test_dry_run_prints_a_unified_diff_and_writes_nothing(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    before = path.read_bytes()
    code, out, _ = cli("resolve", "--dry-run", path)
    assert code == 0
    assert out.startswith("---") and "\n+++" in out and "+  trainable_parameters:" in out
    assert path.read_bytes() == before


def test_intake_with_o_becomes_a_valid_ledger(work: Path, cli) -> None:
    intake = work / "intake_tiny.yaml"
    before = intake.read_bytes()
    out = work / "ledger.yaml"
    code, _, err = cli("resolve", intake, "-o", out)
    assert code == 0, err
    assert intake.read_bytes() == before
    doc = load(str(out))
    assert doc.kind == "ledger"
    assert doc.plain["x-pilot"] == {"oom_phase": "forward"}  # intake-only section kept as an extension
    assert out.read_text().startswith("# Sizing intake")
    code, text, _ = cli("validate", out)
    assert code == 0, text
    assert "status CALCULATED" in text


def test_readme_demo_llama2_7b(work: Path, cli) -> None:
    out = work / "ledger7b.yaml"
    intake = DATA / "intake_llama2_7b.yaml"  # config_path points into examples/configs: run it in place
    before = intake.read_bytes()
    code, _, err = cli("resolve", intake, "-o", out)
    assert intake.read_bytes() == before
    assert code == 0, err
    doc = load(str(out))
    assert doc.get("identity", "total_parameters").value == 6_738_415_616  # Llama-2-7b, published count
    assert doc.get("method", "trainable_parameters").value == 32 * 2 * 16 * (4096 + 4096)
    assert doc.get("identity", "architecture").value == "LlamaForCausalLM"
    assert len(doc.get("identity", "config_sha256").value) == 64


BAD = [
    ("missing_config", 3, "no config.json"),
    ("unreadable_config", 3, "not valid JSON"),
    ("unknown_architecture", 3, "transformers cannot read"),
    ("remote_code", 3, "--trust-remote-code"),
    ("target_matches_nothing", 7, "nonexistent_proj"),
    # PEFT injects q_proj and skips v_prj in silence: an adapter smaller than the ledger says
    ("target_misspelt_among_others", 7, "'v_prj' matches no module of LlamaForCausalLM"),
    # PEFT reads a string as one regular expression matched against the whole name
    ("target_a_string", 7, "a string is one regular expression"),
    ("rank_zero", 6, "method.rank"),
    ("unknown_optimizer", 11, "adamw_magic"),
]


@pytest.mark.parametrize(("name", "line", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_error_at_the_field(work: Path, cli, name: str, line: int, words: str) -> None:
    path = work / "bad" / f"{name}.yaml"
    before = path.read_bytes()
    code, _out, err = cli("resolve", path)
    assert code in (1, 2)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{path}:{line}:"), lines[0]
    assert words in lines[0]
    assert "Traceback" not in err
    assert path.read_bytes() == before


def test_a_misspelt_target_names_the_module_it_resembles(work: Path, cli) -> None:
    _, _, err = cli("resolve", work / "bad" / "target_misspelt_among_others.yaml")
    assert "did you mean 'v_proj'?" in err


def test_unknown_optimizer_lists_the_supported_names(work: Path, cli) -> None:
    _, _, err = cli("resolve", work / "bad" / "unknown_optimizer.yaml")
    assert "adamw_torch" in err and "paged_adamw_8bit" in err and "adafactor" in err


def test_intake_without_o_is_a_usage_error(work: Path, cli) -> None:
    path = work / "intake_tiny.yaml"
    before = path.read_bytes()
    code, _, err = cli("resolve", path)
    assert code == 2
    assert err.startswith(f"{path}:2:") and "-o" in err
    assert path.read_bytes() == before


def test_modules_to_save_makes_the_adapter_dtype_mixed_and_the_ledger_valid(work: Path, cli) -> None:
    path = work / "ledger_commented.yaml"
    text = path.read_text().replace(
        "  target_modules: [q_proj, v_proj]\n", "  target_modules: [q_proj, v_proj]\n  modules_to_save: [lm_head]\n"
    )
    text = text.replace("  adapter: {value: 123, source: MEASURED}\n", "  adapter: UNKNOWN\n")
    path.write_text(text)
    assert cli("resolve", path)[0] == 0
    doc = load(str(path))
    assert doc.get("adapter", "dtype").value == "mixed"  # fp32 LoRA + the bf16 lm_head copy
    assert doc.get("adapter", "x-lora-dtype").value == "float32"
    assert doc.get("gradients", "dtype").value == "mixed"
    lora = 2 * 8 * ((64 + 64) + (64 + 32))
    assert doc.get("ledger", "adapter").value == lora * 4 + 128 * 64 * 2
    code, out, _ = cli("validate", path)
    assert code == 0, out
    assert cli("resolve", "--check", path)[0] == 0  # idempotent with the mixed dtype too
