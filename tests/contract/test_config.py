"""One typed reading of the configuration (``ledgerspec.contract.config``): every part of ledgerspec agrees."""

from __future__ import annotations

import ast

import pytest

from ledgerspec.checks.validate import validate
from ledgerspec.contract import config
from ledgerspec.contract.document import from_text
from ledgerspec.contract.intake import minimum_intake_gaps
from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "ledgerspec"

DISAGREE = """\
ledgerspec: ledger/v1
identity: {model_id: x/y, config_path: tiny, revision: main}
method: {kind: QLoRA, rank: 4, target_modules: [q_proj]}
base_model: {loaded_dtype: bfloat16, quantized: false}
adapter: {dtype: float32}
workload: {microbatch: 1, max_length: 64}
optimizer: {name: adamw_torch}
memory_options: {gradient_checkpointing: false}
"""


def test_the_switch_decides_and_a_disagreement_is_one_finding() -> None:
    doc = from_text(DISAGREE)
    cfg = config.read(doc)
    assert cfg.kind == "QLoRA" and cfg.quantized is False
    assert [c.path for c in cfg.conflicts] == [("base_model", "quantized")]
    assert not any("quantization" in g for g in minimum_intake_gaps(doc))  # no QLoRA fields asked for
    findings = [f for f in validate(doc).findings if f.rule in ("LS030", "LS032")]
    assert [(f.rule, f.pointer) for f in findings] == [("LS032", "/base_model/quantized")]


@pytest.mark.parametrize(
    ("method", "base", "quantized", "scheme"),
    [
        ("QLoRA", "{loaded_dtype: bf16}", True, None),
        ("QLoRA", "{loaded_dtype: bf16, quantization: {type: NF4}}", True, "bnb4"),
        ("LoRA", "{loaded_dtype: bf16, quantized: ON, quantization: {type: int8}}", True, "int8"),
        ("LoRA", "{loaded_dtype: bf16, quantized: true, quantization: {bits: 8}}", True, "int8"),
        ("LoRA", "{loaded_dtype: bf16, quantization: {type: nf4}}", False, None),
        ("UNKNOWN", "{loaded_dtype: bf16}", False, None),
    ],
)
def test_quantized_follows_the_switch_else_the_kind(method: str, base: str, quantized: bool, scheme: str) -> None:
    doc = from_text(f"ledgerspec: ledger/v1\nmethod: {{kind: {method}}}\nbase_model: {base}\n")
    q = config.read(doc).quantization
    assert (q.quantized, q.scheme) == (quantized, scheme)


def test_derived_readings_are_dropped_on_edit() -> None:
    from ledgerspec.contract.edit import set_plain

    doc = from_text(DISAGREE)
    assert config.read(doc).quantized is False
    set_plain(doc, ("base_model", "quantized"), True, force=True)
    assert config.read(doc).quantized is True


def test_nothing_outside_the_contract_reads_the_quantization_switch_itself() -> None:
    """The four readers that disagreed are gone: only ``contract/config.py`` reads ``base_model.quantized``."""
    readers = []
    for file in PACKAGE.rglob("*.py"):
        if file.name == "config.py" and file.parent.name == "contract":
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "quantized":
                readers.append(f"{file.relative_to(PACKAGE.parent)}:{node.lineno}")
    # the catalogue, the fingerprint of the inputs (a list of field names), and the path the importers write
    allowed = {
        "ledgerspec/contract/fields.py",
        "ledgerspec/contract/fingerprint.py",
        "ledgerspec/contract/imports/common.py",
    }
    assert [r for r in readers if r.split(":")[0] not in allowed] == []


@pytest.mark.parametrize(
    ("written", "read"), [("lm_head", ("lm_head",)), ("[lm_head, score]", ("lm_head", "score")), ("1", ())]
)
def test_skip_modules_of_a_wrong_type_reads_as_none_and_validate_reports_it(
    written: str, read: tuple[str, ...]
) -> None:
    """The hostile-input property test found ``skip_modules: 1`` making ``validate`` fail with an internal error
    (the minimum-intake check reads the configuration before the schema's finding is shown)."""
    text = (
        "ledgerspec: intake/v1\nbase_model:\n  quantized: true\n  quantization:\n    type: nf4\n"
        f"    skip_modules: {written}\n"
    )
    doc = from_text(text, "x.intake.yaml")
    assert config.read(doc).quantization.skip_modules == read
    minimum_intake_gaps(doc)  # no exception
