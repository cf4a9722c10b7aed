"""The rule catalogue LS001-LS080: every rule fires on its positive cases and stays quiet on its negatives.

Cases are small files under ``tests/cases/rules/`` named ``RULE.pos[-variant].KIND.yaml`` and
``RULE.neg[-variant].KIND.yaml``. A positive case marks each finding it expects on the line the
finding must point at, with a trailing comment ``# expect: RULE SEVERITY POINTER`` (several on
one line are separated by ``;``). For the file's own rule the expected findings are the exact
multiset of that rule's findings; other rules' markers must be present.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from ledgerspec.checks.catalogue import all_rules
from ledgerspec.checks.findings import ERROR, INFO, WARNING, Finding
from ledgerspec.checks.registry import Rule
from ledgerspec.checks.validate import validate
from ledgerspec.contract.document import from_text, load
from tests.support import TESTS

CASES = TESTS / "cases" / "rules"
NAME_RE = re.compile(r"^(?P<rule>LS\d{3})\.(?P<polarity>pos|neg)(?:-[a-z0-9-]+)?\.(?:ledger|intake)\.yaml$")
EXPECT_RE = re.compile(r"expect:\s*(?P<rule>LS\d{3})\s+(?P<severity>error|warning|info)\s+(?P<pointer>/[^\s;]*)")


@dataclass(frozen=True)
class Expected:
    rule: str
    severity: str
    pointer: str
    line: int


def case_files() -> list[Path]:
    return sorted(p for p in CASES.iterdir() if p.name.endswith(".yaml"))


def cases(polarity: str) -> list[Path]:
    return [p for p in case_files() if (m := NAME_RE.match(p.name)) and m.group("polarity") == polarity]


def rule_of(path: Path) -> str:
    m = NAME_RE.match(path.name)
    assert m, path.name
    return m.group("rule")


def expectations(path: Path) -> list[Expected]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if "#" not in line:
            continue
        comment = line[line.index("#") :] if "expect:" in line else ""
        for m in EXPECT_RE.finditer(comment):
            out.append(Expected(m.group("rule"), m.group("severity"), m.group("pointer"), n))
    return out


def key_column(line: str, pointer: str) -> int | None:
    """1-based column where the last key of ``pointer`` is written on ``line`` (None for list items)."""
    last = pointer.rsplit("/", 1)[-1]
    if last.isdigit():
        return None
    m = re.search(rf"(?:^|[\s{{,]){re.escape(last)}:", line)
    assert m, f"key {last!r} not on the marked line {line!r}"
    return m.start() + (0 if m.group(0).startswith(last) else 1) + 1


def test_every_case_file_is_named_for_a_rule() -> None:
    bad = [p.name for p in case_files() if not NAME_RE.match(p.name)]
    assert not bad, f"case files must be named RULE.pos|neg[-variant].ledger|intake.yaml: {bad}"
    known = {r.id for r in all_rules()}
    unknown = sorted({rule_of(p) for p in case_files()} - known)
    assert not unknown, f"cases for rules that are not registered: {unknown}"


@pytest.mark.parametrize("rule_id", [r.id for r in all_rules()])
def test_every_rule_has_a_positive_and_a_negative_case(rule_id: str) -> None:
    pos = [p.name for p in cases("pos") if rule_of(p) == rule_id]
    neg = [p.name for p in cases("neg") if rule_of(p) == rule_id]
    assert pos, f"{rule_id} has no positive case under tests/cases/rules/"
    assert neg, f"{rule_id} has no negative case under tests/cases/rules/"


@pytest.mark.parametrize("rule_id", [r.id for r in all_rules()])
def test_every_severity_of_a_rule_is_exercised(rule_id: str) -> None:
    """A rule documented as 'error / warning' (or 'error when measured, else info') has a case for each."""
    rule = next(r for r in all_rules() if r.id == rule_id)
    declared = {s for s in (ERROR, WARNING, INFO) if s in rule.severity}
    seen = {e.severity for p in cases("pos") if rule_of(p) == rule_id for e in expectations(p) if e.rule == rule_id}
    assert declared <= seen, f"{rule_id} ({rule.severity}): no positive case with severity {declared - seen}"


def _findings(path: Path) -> list[Finding]:
    report = validate(load(path))
    schema = [f for f in report.findings if f.rule in ("schema", "header")]
    assert not schema, f"{path.name} must be a schema-valid document so it tests the rule: {schema}"
    return report.findings


@pytest.mark.parametrize("path", cases("pos"), ids=lambda p: p.name)
def test_positive_case_fires(path: Path) -> None:
    rule_id = rule_of(path)
    expected = expectations(path)
    assert any(e.rule == rule_id for e in expected), f"{path.name} marks no `# expect: {rule_id} ...` line"
    findings = _findings(path)
    got = Counter((f.rule, f.severity, f.pointer, f.line) for f in findings if f.rule == rule_id)
    want = Counter((e.rule, e.severity, e.pointer, e.line) for e in expected if e.rule == rule_id)
    assert got == want, f"{path.name}: findings of {rule_id} differ from the marked lines"
    others = Counter((f.rule, f.severity, f.pointer, f.line) for f in findings)
    for e in expected:
        if e.rule != rule_id:
            assert others[(e.rule, e.severity, e.pointer, e.line)], f"{path.name}: missing {e}"
    lines = path.read_text(encoding="utf-8").splitlines()
    for f in findings:
        if f.rule != rule_id:
            continue
        assert f.message.strip(), "a finding says what is wrong"
        col = key_column(lines[f.line - 1], f.pointer)
        if col is not None:
            assert f.column == col, f"{path.name}:{f.line}: column {f.column}, the key is at {col}"


@pytest.mark.parametrize("path", cases("neg"), ids=lambda p: p.name)
def test_negative_case_is_quiet(path: Path) -> None:
    rule_id = rule_of(path)
    fired = [f for f in _findings(path) if f.rule == rule_id]
    assert not fired, f"{path.name}: {rule_id} fired: {fired}"


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.id)
def test_registry_example_triggers_its_rule(rule: Rule) -> None:
    """Each rule's ``example`` (shown in the docs) is a top-level fragment that triggers the rule."""
    assert rule.example, f"{rule.id} has no example"
    doc = from_text(f"ledgerspec: ledger/v1\n{rule.example}\n", f"<{rule.id} example>")
    report = validate(doc)
    assert not [f for f in report.findings if f.rule in ("schema", "header")], report.findings
    assert rule.id in {f.rule for f in report.findings}, f"the example of {rule.id} does not trigger it"


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.id)
def test_registry_entry_is_complete(rule: Rule) -> None:
    assert re.fullmatch(r"LS\d{3}", rule.id)
    assert rule.title and rule.hint
    assert rule.severity.split()[0] in (ERROR, WARNING, INFO)


def test_catalogue_holds_the_spec_minimum_set() -> None:
    spec = {
        "LS001",
        "LS002",
        "LS003",
        "LS004",
        "LS010",
        "LS011",
        "LS020",
        "LS021",
        "LS022",
        "LS030",
        "LS031",
        "LS040",
        "LS041",
        "LS042",
        "LS050",
        "LS060",
        "LS070",
        "LS080",
    }
    assert spec <= {r.id for r in all_rules()}


def test_findings_are_sorted_by_position() -> None:
    findings = _findings(CASES / "LS002.pos.ledger.yaml")
    assert [(f.line, f.column) for f in findings] == sorted((f.line, f.column) for f in findings)


def test_naive_article_gradients_message_says_the_frozen_base_was_counted() -> None:
    findings = [f for f in _findings(CASES / "LS020.pos.ledger.yaml") if f.rule == "LS020"]
    assert "6,738,415,616" in findings[0].message and "4,194,304" in findings[0].message
    assert "frozen base was counted" in findings[0].message


# -- LS090: the article's shortcuts in English and in the audited article's Russian ----------------------------------


@pytest.mark.parametrize(
    ("note", "shortcut"),
    [
        ("subtotal x 1.10", "overhead"),
        ("1.1x subtotal", "overhead"),
        ("subtotal + 10% overhead", "overhead"),
        ("сумма компонентов + 10% запаса", "overhead"),
        ("14B params x 0.5 byte", "0.5 byte"),
        ("0,5 байта на параметр", "0.5 byte"),
        ("params / 2", "0.5 byte"),
        ("half a byte per parameter", "0.5 byte"),
        ("rank x alpha", "rank x alpha"),
        ("80 GB / 2 GPUs", "VRAM / N"),
        ("80GB/4", "VRAM / N"),
        ("Adam8bit is 25% of Adam", "8-bit Adam"),
        ("8-bit Adam is a quarter of Adam", "8-bit Adam"),
        ("checkpointing -30%", "checkpointing"),
        ("checkpointing saves 30%", "checkpointing"),
        ("градиентный чекпоинтинг экономит 30%", "checkpointing"),
        ("accumulation = activation batch", "accumulation"),
    ],
)
def test_ls090_recognises_the_shortcut(note: str, shortcut: str) -> None:
    from ledgerspec.checks.rules import SHORTCUTS

    hits = [what for pattern, what, _ in SHORTCUTS if pattern.search(note)]
    assert hits and shortcut in hits[0], (note, hits)


@pytest.mark.parametrize(
    "note",
    [
        "measured at batch x 1.5",  # a factor with no subtotal/overhead in sight
        "bitsandbytes nf4: packed uint8 (numel / 2) + fp32 absmax per 64-element block",
        "2 x zeros_like(param), 8,388,608 fp32 values",
        "32 layers x 2 targets x 16 x (4096 + 4096) x 4 B",
        "peak of 1.5 GiB at step 3",
        "rank 16, alpha 32",
        "8-bit AdamW: 2 x uint8 blockwise + fp32 absmax per 256 values",
    ],
)
def test_ls090_leaves_derivations_alone(note: str) -> None:
    from ledgerspec.checks.rules import SHORTCUTS

    assert not [what for pattern, what, _ in SHORTCUTS if pattern.search(note)], note


@pytest.mark.parametrize(
    ("quantization", "missing"),
    [
        ("{bits: 4}", ["type", "double_quant", "compute_dtype", "storage_dtype"]),
        ("{type: nf4}", ["double_quant", "compute_dtype", "storage_dtype"]),
        ("{type: fp4, double_quant: false}", ["compute_dtype", "storage_dtype"]),
        ("{bits: 8}", ["type"]),
        ("{type: int8}", []),
        ("{type: gptq}", []),
        ("{type: awq, bits: 4}", []),
        ("{type: mxfp4}", []),
        ("{type: hqq}", []),
        ("{type: torchao_nf4}", []),
    ],
)
def test_ls030_asks_what_the_minimum_intake_asks(quantization: str, missing: list[str]) -> None:
    """LS030 blocks resolve (an input rule): it asks a quantized base for the quantization fields the minimum intake
    asks, no more. bitsandbytes 4-bit (nf4, fp4) needs double_quant, compute_dtype and storage_dtype; a GPTQ/AWQ/...
    base or LLM.int8 only its type (issue 26: the GPTQ coverage cell was refused for bnb_4bit fields)."""
    from ledgerspec.contract.intake import minimum_intake_gaps

    doc = from_text(f"ledgerspec: ledger/v1\nmethod: {{kind: QLoRA}}\nbase_model: {{quantization: {quantization}}}\n")
    findings = [f for f in validate(doc).findings if f.rule == "LS030"]
    gaps = [g for g in minimum_intake_gaps(doc) if g.startswith("base_model.quantization.")]
    assert [g.split()[0].rsplit(".", 1)[1] for g in gaps] == missing
    if not missing:
        assert not findings, findings
        return
    assert len(findings) == 1 and findings[0].pointer == "/base_model/quantization"
    assert ", ".join(f"quantization.{k}" for k in missing) + ":" in findings[0].message


def test_an_optimizer_named_in_another_word_order_gets_the_known_name() -> None:
    """A newcomer trial: ``adamw_8bit_paged`` was told "did you mean 'adamw_8bit'?" (the closest spelling)."""
    findings = [f for f in _findings(CASES / "LS023.pos-word-order.ledger.yaml") if f.rule == "LS023"]
    assert len(findings) == 1 and "did you mean 'paged_adamw_8bit'?" in findings[0].message


def test_no_committed_document_names_a_strategy_ledgerspec_does_not_know() -> None:
    """LS017 stops commands: every strategy a committed ledger, intake or rule case declares (device_map beside
    LS063's, ddp with sharding none as the importers write it) must be one the commands read, unless the file is a
    case of LS017 itself or of the bad-input corpus."""
    from tests.support import REPO_ROOT

    files = [
        p
        for p in REPO_ROOT.glob("**/*.yaml")
        if p.name.endswith((".ledger.yaml", ".intake.yaml"))
        and ".venv" not in p.parts
        and "bad" not in p.parts
        and not p.name.startswith("LS017.pos")
    ]
    assert len(files) > 200
    flagged = [(p.name, f.message) for p in files for f in validate(load(p)).findings if f.rule == "LS017"]
    assert flagged == []


@pytest.mark.parametrize(
    ("name", "guess"),
    [
        ("zero-3", "zero3"),
        ("ZeRO_2", "zero2"),
        ("zero0", "ddp"),  # DeepSpeed stage 0 shards nothing: never zero3
        ("stage-0", "ddp"),
        ("single_gpu", "none"),
        ("data_parallel", "ddp"),  # not FullyShardedDataParallel
        ("zero3_offload", "zero3"),
        ("fsdp_2", "fsdp2"),
        ("zero5", None),
        ("deepspeed", None),
    ],
)
def test_a_strategy_guess_never_points_at_another_sharding(name: str, guess: str | None) -> None:
    from ledgerspec.contract.config import strategy_guess

    assert strategy_guess(name) == guess
