"""A DPO and a GRPO configuration from axolotl and from TRL's configs (issue 24's "Done when"): the shipped files under
``examples/from-your-setup/`` import, resolve, estimate and report with no UNKNOWN left that the files determine.

The files are realistic: axolotl 0.18.0's format as its ``docs/rlhf.qmd`` DPO and GRPO examples (``rl:``, ``rl_beta``,
the ``trl:`` block), and TRL 1.16's ``DPOConfig``/``GRPOConfig`` keys as YAML, the form ``trl dpo|grpo --config``
reads, with the PEFT ``adapter_config.json`` beside them; Llama-3.1-8B (its shipped config). What stays UNKNOWN is
what no file says, each with its reason:

- ``identity.revision``: none of the files pins a Hub commit (the shipped config's sha256 pins the architecture);
- GRPO's ``workload.max_length``: ``GRPOConfig`` has no sequence length (a row is the data's prompt and
  ``max_completion_length`` tokens); the user gives the longest prompt (``LedgerCallback`` fills it from a run).
  axolotl 0.18's ``sequence_len`` bounds no GRPO row (it filters no GRPO sample, ``utils/data/rl.py:177-178``, and
  keeps ``max_length`` out of ``GRPOConfig``, ``core/trainers/grpo/__init__.py:239-245``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import Document, from_text, load
from ledgerspec.contract.imports import import_files
from tests.support import REPO_ROOT as ROOT
from tests.support import run_cli

SETUP = ROOT / "examples" / "from-your-setup"
CONFIGS = ROOT / "examples" / "configs"
ADAPTER = "hf/adapter_config_llama31.json"
#: name -> (files, objective, UNKNOWN fields the files cannot tell)
SETUPS: dict[str, tuple[tuple[str, ...], str, set[str]]] = {
    "axolotl-dpo": (("axolotl-dpo.yml",), "dpo", {"identity.revision"}),
    "axolotl-grpo": (("axolotl-grpo.yml",), "grpo", {"identity.revision", "workload.max_length"}),
    "trl-dpo": (("hf/dpo_config.yaml", ADAPTER), "dpo", {"identity.revision"}),
    "trl-grpo": (("hf/grpo_config.yaml", ADAPTER), "grpo", {"identity.revision", "workload.max_length"}),
}
#: the longest prompt + completion given for TRL's GRPO file (the one field its files cannot tell)
GRPO_ROW = 1024


def unknowns(doc: Document) -> set[str]:
    """The dotted paths of every UNKNOWN value in a document."""
    found: set[str] = set()

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            if node.get("source") == "UNKNOWN":
                found.add(".".join(path))
            for k, v in node.items():
                if not str(k).startswith("x-"):
                    walk(v, (*path, str(k)))
        elif node == "UNKNOWN":
            found.add(".".join(path))

    walk(doc.plain, ())
    return found


def _import(name: str, output: Path | None = None) -> tuple[Document, Any]:
    files, _, _ = SETUPS[name]
    result = import_files(
        [str(SETUP / f) for f in files], config_dirs=[CONFIGS], output=str(output) if output else None
    )
    return from_text(result.text, str(output or "<import>")), result


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_setup_imports_with_no_unknown_the_files_determine(name: str) -> None:
    doc, result = _import(name)
    _, objective, expected = SETUPS[name]
    assert doc.get("training", "objective").value == objective
    assert unknowns(doc) == expected
    kinds = {f.kind for f in result.findings}
    assert not kinds & {"unknown-key", "not-modelled", "conflict"}, [f.format() for f in result.findings]
    settings = ("training", "objective_settings")
    if objective == "grpo":  # the generation settings read from the files (TRL 1.16's names)
        got = [doc.get(*settings, k).value for k in ("num_generations", "max_completion_length", "use_vllm")]
        assert got == [8, 512, False]
        assert doc.get(*settings, "reference").value == "none"  # beta 0.0
    else:
        assert doc.get(*settings, "reference").value == "adapter_disabled"  # TRL's default for a peft_config


def test_a_sampling_setting_trl_does_not_default_to_is_a_finding(tmp_path: Path) -> None:
    """The simulated generation samples at GRPOConfig's defaults: another ``top_k`` or ``num_iterations`` is said, not
    silently sized as the default."""
    text = (SETUP / "hf" / "grpo_config.yaml").read_text(encoding="utf-8") + "top_k: 50\nnum_iterations: 2\n"
    (tmp_path / "grpo.yaml").write_text(text, encoding="utf-8")
    result = import_files([str(tmp_path / "grpo.yaml"), str(SETUP / ADAPTER)], config_dirs=[CONFIGS])
    assert sorted(f.key for f in result.findings if f.kind == "not-modelled") == ["num_iterations", "top_k"]
    axolotl = (SETUP / "axolotl-grpo.yml").read_text(encoding="utf-8").replace("trl:\n", "trl:\n  loss_type: bnpo\n")
    (tmp_path / "axolotl.yml").write_text(axolotl, encoding="utf-8")
    result = import_files([str(tmp_path / "axolotl.yml")], config_dirs=[CONFIGS])
    assert [f.key for f in result.findings if f.kind == "not-modelled"] == ["trl.loss_type"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["axolotl-dpo", "trl-grpo"])
def test_the_setup_resolves_estimates_and_reports(name: str, tmp_path: Path) -> None:
    """import -> resolve (the 8B on the meta device) -> estimate --target cpu -> report, each a CLI run: no UNKNOWN
    left but what the files cannot tell, the objective's step estimated. GRPO's estimate traces every one of the 512
    completion tokens' decode steps (minutes on 2 cores: docs/objectives.md gives its figures and time): in CI the GRPO
    setup is imported, resolved and reported; the DPO setup runs the whole chain. (The other two setups import to the
    same ledger fields: the fast test above.)"""
    files, objective, expected = SETUPS[name]
    intake, ledger = tmp_path / "setup.intake.yaml", tmp_path / "setup.ledger.yaml"
    code, _, err = run_cli("import", *[SETUP / f for f in files], "--configs", CONFIGS, "-o", intake)
    assert code == 0, err
    if "workload.max_length" in expected:  # the one field GRPO's files cannot tell: the user gives it
        text = intake.read_text(encoding="utf-8")
        line = next(x for x in text.splitlines() if x.startswith("  max_length: UNKNOWN"))
        intake.write_text(text.replace(line, f"  max_length: {GRPO_ROW}"), encoding="utf-8")
        expected = expected - {"workload.max_length"}
    code, _, err = run_cli("resolve", intake, "-o", ledger, "--offline")
    assert code == 0, err
    assert unknowns(load(ledger)) == expected
    if objective == "dpo":
        code, _, err = run_cli("estimate", ledger, "--target", "cpu")
        assert code == 0, err
        doc = load(ledger)
        assert unknowns(doc) == expected
        assert "DPOTrainer step" in (doc.get("ledger", "activations").method or "")
        assert doc.get("x-estimate", "phases", "forward_peak").value > 0
    code, out, err = run_cli("report", ledger)
    assert code == 0, err
    assert "meta-llama/Llama-3.1-8B" in out
    if objective == "dpo":  # the estimated step, in the report (its UNKNOWNs: the target device, which no file says)
        assert "DPOTrainer step" in out


def test_axolotls_trl_block_gives_the_vllm_settings(tmp_path: Path) -> None:
    """axolotl's ``trl:`` block hands TRL's GRPOConfig its vLLM settings under TRL's names (axolotl's TRLConfig,
    utils/schemas/trl.py): use_vllm, vllm_mode, vllm_gpu_memory_utilization, vllm_enable_sleep_mode are read as the
    objective's settings; no finding."""
    text = (SETUP / "axolotl-grpo.yml").read_text(encoding="utf-8").replace("  use_vllm: false\n", "")
    vllm = (
        "  use_vllm: true\n  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.4\n  vllm_enable_sleep_mode: true\n"
    )
    (tmp_path / "axolotl.yml").write_text(text.replace("trl:\n", "trl:\n" + vllm), encoding="utf-8")
    result = import_files([str(tmp_path / "axolotl.yml")], config_dirs=[CONFIGS])
    doc = from_text(result.text, "<import>")
    s = ("training", "objective_settings")
    got = [doc.get(*s, k).value for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")]
    assert got == [True, "colocate", 0.4]
    assert doc.get(*s, "vllm_enable_sleep_mode").value is True
    assert not [f.format() for f in result.findings if f.kind in ("unknown-key", "not-modelled")]
