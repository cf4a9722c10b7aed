"""Property tests: whatever a mutated or random document holds, validation ends in a Report or a LedgerspecError.

Bases are the example ledgers, the rule cases and a few documents built here; mutations change values
to random types, delete keys, insert keys, put random unit strings into memory fields, and feed random
text. An unchanged document renders back to its exact text.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from ledgerspec.checks.schema_check import schema_hits
from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import Document, from_text, load
from ledgerspec.contract.units import MAX_BYTES, UnitError, parse_size
from ledgerspec.contract.writer import render
from ledgerspec.errors import LedgerspecError
from ledgerspec.faces.reporters import REPORTERS
from tests.support import CASES, EXAMPLES

_BUILT = [
    "ledgerspec: ledger/v1\nstatus: INSUFFICIENT DATA\nidentity:\n  model_id: meta-llama/Llama-2-7b-hf\n",
    "# an intake\nledgerspec: intake/v1\nmethod:\n  kind: QLoRA\n  rank: 16\n  target_modules:\n    - q_proj\n"
    "    - v_proj\nbase_model:\n  loaded_dtype: bfloat16\n  quantization: {type: nf4, double_quant: 'ON', "
    "compute_dtype: bfloat16, storage_dtype: uint8}\n",
    "ledgerspec: ledger/v1\nstatus: INSUFFICIENT DATA  # declared\nledger:\n  frozen_base: {value: 13476839424, "
    "source: CALCULATED, method: params x 2}\n  adapter: {value: 80 MB, source: CALCULATED, method: 2e7 x 4 B}\n"
    "parallelism:\n  gpu_count: 2\n  per_rank_peak:\n"
    "  - {value: 40 GiB, source: CALCULATED, method: estimate}\n  - UNKNOWN\n",
]
FILES = sorted([*EXAMPLES.glob("*.yaml"), *CASES.rglob("*.yaml")])
BASES: list[str] = [p.read_bytes().decode("utf-8-sig") for p in FILES] + _BUILT

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_UNITS = ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "gb", "GiBB", "bytes", "kb", "", " ", "%"]
unit_strings = st.builds(
    lambda sign, num, frac, space, unit: f"{sign}{num}{frac}{space}{unit}",
    st.sampled_from(["", "-", "+"]),
    st.integers(min_value=0, max_value=10**20).map(str),
    st.sampled_from(["", ".5", ".0", ".", ".25e3"]),
    st.sampled_from(["", " ", "  ", "\t"]),
    st.sampled_from(_UNITS),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    # printable text: ruamel itself dumps a raw NEL or LINE SEPARATOR inside quotes, which YAML folds on reading
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=30),
    st.sampled_from(
        [
            "UNKNOWN",
            "CONFIGURATION-SPECIFIC",
            "ON",
            "off",
            "Yes",
            "LoRA",
            "QLoRA",
            "nf4",
            "bfloat16",
            "VALIDATED",
            "CANDIDATE",
            "1:30",
            "2024-01-01",
            "0x10",
            "~",
            "null",
            ".inf",
        ]
    ),
    unit_strings,
)
long_forms = st.fixed_dictionaries(
    {},
    optional={
        "value": scalars,
        "source": st.sampled_from(
            ["MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION", "CONFIGURATION-SPECIFIC", "UNKNOWN", "GUESS", ""]
        ),
        "note": scalars,
        "method": scalars,
        "x-extra": scalars,
        "unit": scalars,
    },
)
keys = st.one_of(
    st.sampled_from(
        [
            "ledgerspec",
            "status",
            "identity",
            "method",
            "ledger",
            "phases",
            "metrics",
            "workload",
            "rank",
            "kind",
            "value",
            "source",
            "x-note",
            "ledgr",
            "per_rank_peak",
            "frozen_base",
            "gpu_count",
            "oom",
            "quantization",
        ]
    ),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", min_size=1, max_size=12),
)
values = st.recursive(
    st.one_of(scalars, long_forms),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)


def _dump(data: Any) -> str:
    yaml = YAML(typ="rt")
    yaml.width = 4096
    buf = io.StringIO()
    yaml.dump(data, buf)
    return buf.getvalue()


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _container(root: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A base document (as its plain tree), mutated 1-4 times, dumped back to YAML."""
    text = draw(st.sampled_from(BASES))
    data = json.loads(json.dumps(from_text(text).plain))
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(data) if p]
        op = draw(st.sampled_from(["replace", "delete", "insert"]))
        if op == "insert" or not paths:
            targets = [p for p in _paths(data) if isinstance(_container(data, p), dict)]
            target = _container(data, draw(st.sampled_from(targets)))
            target[draw(keys)] = draw(values)
            continue
        path = draw(st.sampled_from(paths))
        parent = _container(data, path[:-1])
        if op == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(values)
    return _dump(data)


def _outcome(text: str) -> Report | LedgerspecError:
    try:
        doc = from_text(text, "prop.ledger.yaml")
    except LedgerspecError as exc:
        assert exc.line is not None and exc.line >= 1, exc.format()
        return exc
    report = validate(doc)
    _render_all(report)
    return report


def _render_all(report: Report) -> None:
    for name, reporter in REPORTERS.items():
        buf = io.StringIO()
        reporter([report], buf, True)
        if name in ("json", "sarif"):
            json.loads(buf.getvalue())
    for f in report.findings:
        assert f.line >= 1 and f.column >= 1 and f.message


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_committed_file_renders_back_byte_for_byte(path: Path) -> None:
    doc = load(path)
    raw = path.read_bytes().decode("utf-8-sig")
    assert doc.text == raw
    assert render(doc.data, doc.text) == raw


@pytest.mark.parametrize("text", _BUILT)
def test_built_base_renders_back_and_is_valid(text: str) -> None:
    doc = from_text(text)
    assert render(doc.data, doc.text) == text
    report = validate(doc)
    assert report.ok, [f.message for f in report.findings]


@_SETTINGS
@given(mutated())
@example(  # found by CI: a list field holding a boolean crashed the one reading of the configuration
    "ledgerspec: ledger/v1\nsoftware:\n  accepted_differences: true\nx-resolve:\n  differences:\n"
    "    transformers-moe-fused-experts: {computed_as: newer}\n"
)
def test_mutated_documents_never_crash_the_validator(text: str) -> None:
    assert isinstance(_outcome(text), Report | LedgerspecError)


@_SETTINGS
@given(mutated())
def test_generated_documents_render_back_unchanged(text: str) -> None:
    try:
        doc = from_text(text)
    except LedgerspecError:
        return
    assert render(doc.data, doc.text) == text


@_SETTINGS
@given(st.text(max_size=300))
def test_random_text_never_crashes(text: str) -> None:
    assert isinstance(_outcome(text), Report | LedgerspecError)


_TOKENS = [
    "ledgerspec: ledger/v1\n",
    "ledgerspec: intake/v1\n",
    "method:\n",
    "  rank: ",
    "  - ",
    "{",
    "}",
    "[",
    "]",
    ", ",
    ": ",
    "&a ",
    "*a",
    "!!str ",
    "!x ",
    "? ",
    "'",
    '"',
    "\\u00e9",
    "\\ud800",
    "#c",
    "\n",
    "\t",
    "  ",
    "---\n",
    "...\n",
    "%YAML 1.2\n",
    "|\n",
    ">-\n",
    "16",
    "1e999",
    "0x1F",
    "-3",
    "16 GiB",
    "UNKNOWN",
    "source: MEASURED",
    "value: ",
    "x-a: ",
    "\x07",
    "\ufeff",
    "\r\n",
    "2024-02-30",
    "<<: ",
]


@_SETTINGS
@given(st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join))
def test_random_yaml_like_text_never_crashes(text: str) -> None:
    assert isinstance(_outcome(text), Report | LedgerspecError)


@_SETTINGS
@given(st.sampled_from(BASES), st.binary(max_size=8), st.integers(min_value=0))
def test_random_bytes_spliced_into_a_document(text: str, junk: bytes, where: int) -> None:
    from ledgerspec.contract.loader import decode

    raw = text.encode()
    at = where % (len(raw) + 1)
    try:
        decoded = decode(raw[:at] + junk + raw[at:], "prop.ledger.yaml")
    except LedgerspecError as exc:
        assert exc.line is not None
        return
    assert isinstance(_outcome(decoded), Report | LedgerspecError)


def _memory_doc(value: Any) -> Document:
    text = _dump(
        {
            "ledgerspec": "ledger/v1",
            "ledger": {"frozen_base": {"value": value, "source": "CALCULATED", "method": "test"}},
        }
    )
    return from_text(text)


def _sign_or_no_unit(value: Any) -> bool:
    """The spec writes sizes as integers or strings WITH a unit and no sign; ``parse_size`` is laxer
    (``"0"``, ``"-0 B"``, ``"+1 GiB"``), and the schema is what refuses those."""
    if not isinstance(value, str):
        return False
    return value.lstrip()[:1] in ("+", "-") or not any(c.isalpha() for c in value)


@_SETTINGS
@given(st.one_of(unit_strings, st.integers(min_value=-(2**64), max_value=2**64), st.floats()))
def test_schema_and_parse_size_agree_on_sizes(value: Any) -> None:
    """A size the schema accepts is one ``parse_size`` reads (and vice versa), within 0..MAX_BYTES."""
    try:
        doc = _memory_doc(value)
    except LedgerspecError:
        return
    plain = doc.plain["ledger"]["frozen_base"]["value"]
    try:
        n = parse_size(plain)
        readable = 0 <= n <= MAX_BYTES and not _sign_or_no_unit(plain)
    except UnitError:
        readable = False
    rejected = any(h.pointer.startswith("/ledger/frozen_base") for h in schema_hits(doc))
    assert rejected != readable, (plain, readable)


@given(st.text(min_size=1, max_size=400))
def test_a_library_message_is_cut_with_an_ellipsis_never_mid_word_silently(message: str) -> None:
    from ledgerspec.errors import first_line, joined_lines

    exc = ValueError(message)
    text, whole = first_line(exc, 120), (message.strip().splitlines() or ["ValueError"])[0]
    assert len(text) <= 120
    assert text == whole or (len(whole) > 120 and text.endswith("..."))
    assert len(joined_lines(exc, 120)) <= 120


@pytest.mark.parametrize(
    ("value", "note"),
    [("unknown", True), ("Unknown", True), ("{value: unknown, source: ASSUMPTION}", False), ("maybe", False)],
)
def test_a_lower_case_unknown_is_told_to_be_written_in_capitals(value: str, note: bool) -> None:
    """Only where UNKNOWN would be valid: a long form's value is never UNKNOWN, so the note would mislead there."""
    doc = from_text(f"ledgerspec: ledger/v1\nbase_model:\n  quantized: {value}\n")
    (hit,) = [h for h in schema_hits(doc) if h.pointer.startswith("/base_model/quantized")]
    assert ("(UNKNOWN is written in capitals)" in hit.message) is note


@pytest.mark.parametrize(
    ("path", "value", "guess"), [("method.kind", "lora", "LoRA"), ("training.objective", "DPO", "dpo")]
)
def test_an_enum_in_the_wrong_case_gets_its_spelling(path: str, value: str, guess: str) -> None:
    section, key = path.split(".")
    doc = from_text(f"ledgerspec: ledger/v1\n{section}:\n  {key}: {value}\n")
    (hit,) = [h for h in schema_hits(doc) if h.pointer == f"/{section}/{key}"]
    assert hit.message.endswith(f"(did you mean {guess!r}?)")
