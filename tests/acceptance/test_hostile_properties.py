"""Property test (issue 15): real ledgers and intakes, mutated, through every command that reads a document.

Bases are the example ledgers and intakes, the rule cases and the accepted odd files; each is loaded as the
round-trip tree (comments and quoting kept) and mutated 1-5 times: values of other types, keys added or removed
(unicode, ``x-`` keys, misspellings), numbers at and past every limit (huge and negative integers, NaN, infinities),
sources that are no provenance word, hostile strings (escape sequences, C1 controls, bidirectional marks, rich
markup, lone surrogates), comments added, header versions changed; or the text itself is cut or spliced. The
document then goes through one entry point (:data:`tests.support.entry_points.ENTRY_POINTS`: validate in every
format, --fix, report in every form, init --from, and the input stage of resolve and estimate), always after
validate itself; the run must end in exit 0, 1 or 2 with no internal error and printable, valid output
(:func:`tests.support.entry_points.check_run`).

The default run tries :data:`DEFAULT_EXAMPLES` documents; the test marked slow tries ``LEDGERSPEC_FUZZ_EXAMPLES``
(default 5,000), in :data:`SHARDS` parts of independent random documents.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledgerspec.contract.loader import make_yaml
from tests.support import BAD, CASES, EXAMPLES
from tests.support.entry_points import ENTRY_POINTS, check_run, run_entry, sarif_errors

DEFAULT_EXAMPLES = 40
SLOW_EXAMPLES = int(os.environ.get("LEDGERSPEC_FUZZ_EXAMPLES", "5000"))

FILES = sorted(
    [
        *EXAMPLES.glob("*.yaml"),
        *CASES.rglob("*.yaml"),
        *(BAD / "accepted").glob("*.yaml"),
    ]
)
BASES = [p.read_bytes() for p in FILES]

HOSTILE = [
    "\x1b[2J\x1b[H",
    "\x1b]8;;https://example.com\x07link\x1b]8;;\x07",
    "\x9b31m",
    "\u202eevil\u202c",
    "\u2028line",
    "[/red]",
    "[link=https://example.com]x[/link]",
    ":warning:",
    "<script>alert(1)</script>",
    "&amp; ]]> <!--",
    "\ud800",
    "\udcff",
    "%0A%25",
    "a\nb\r\nc\rd",
    "\t",
    "\x00",
    "\x7f",
    "\ufeff",
    "é ✓ 中文 🙂",
]
WORDS = [
    "UNKNOWN",
    "CONFIGURATION-SPECIFIC",
    "MEASURED",
    "VERIFIED",
    "CALCULATED",
    "ASSUMPTION",
    "CANDIDATE",
    "VALIDATED",
    "INSUFFICIENT DATA",
    "LoRA",
    "QLoRA",
    "nf4",
    "bfloat16",
    "float32",
    "adamw_torch",
    "ON",
    "no",
    "1 GiB",
    "24GiB",
    "-1 GiB",
    "0.5 B",
    "2 EiB",
    "1e400 B",
    "nan",
    "ledger/v1",
    "intake/v1",
    "ledger/v2",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**255, 2**257, -(2**64), 10**400, 0, -1, 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.sampled_from(HOSTILE),
    st.text(max_size=20),
    st.builds(lambda a, b: a + b, st.sampled_from(WORDS), st.sampled_from(HOSTILE)),
)
SOURCES = st.one_of(
    st.sampled_from(["MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION", "CONFIGURATION-SPECIFIC", "UNKNOWN"]),
    st.sampled_from(["CANDIDATE", "DECLARED", "", "measured", "[/red]", "\x1b[31mCALCULATED"]),
    scalars,
)
long_forms = st.fixed_dictionaries(
    {"source": SOURCES}, optional={"value": scalars, "note": scalars, "method": scalars, "x-extra": scalars}
)
keys = st.one_of(
    st.sampled_from(
        [
            "ledgerspec",
            "status",
            "identity",
            "method",
            "ledger",
            "adapter",
            "frozen_base",
            "activations",
            "phases",
            "metrics",
            "workload",
            "rank",
            "kind",
            "value",
            "source",
            "note",
            "x-note",
            "x-estimate",
            "at_peak",
            "per_rank_peak",
            "config_path",
            "model_id",
            "ledgr",
        ]
    ),
    st.text(min_size=1, max_size=12),
    st.sampled_from(HOSTILE),
)
values = st.recursive(
    st.one_of(scalars, long_forms),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=8,
)
comments = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=30), st.sampled_from(["#", "# [/red]", "x: 1"]))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _at(root: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


def _mutate_tree(draw: st.DrawFn, data: Any) -> None:
    op = draw(st.sampled_from(["replace", "replace", "delete", "insert", "comment", "header", "source"]))
    paths = [p for p in _paths(data) if p]
    mappings = [p for p in _paths(data) if isinstance(_at(data, p), dict)]
    if op == "insert" or not paths:
        _at(data, draw(st.sampled_from(mappings)))[draw(keys)] = draw(values)
    elif op == "delete":
        path = draw(st.sampled_from(paths))
        del _at(data, path[:-1])[path[-1]]
    elif op == "replace":
        path = draw(st.sampled_from(paths))
        _at(data, path[:-1])[path[-1]] = draw(values)
    elif op == "header":
        data["ledgerspec"] = draw(
            st.one_of(
                st.sampled_from(["ledger/v1", "intake/v1", "ledger/v2", "intake/v0", "ledger/v01", "LEDGER/v1"]),
                st.builds(lambda k, n: f"{k}/v{n}", st.sampled_from(["ledger", "intake"]), st.integers(0, 10**30)),
                st.just("ledger/v" + "9" * 5000),
                scalars,
            )
        )
    elif op == "source":
        longs = [p for p in mappings if p and "source" in _at(data, p)]
        if longs:
            _at(data, draw(st.sampled_from(longs)))["source"] = draw(SOURCES)
        else:
            _at(data, draw(st.sampled_from(mappings)))[draw(keys)] = draw(long_forms)
    else:  # a comment after a key of some mapping
        path = draw(st.sampled_from(mappings))
        node = _at(data, path)
        if node and hasattr(node, "yaml_add_eol_comment"):
            key = draw(st.sampled_from(list(node)))
            try:
                node.yaml_add_eol_comment("# " + draw(comments), key)
            except Exception:  # ruamel refuses some slots; the document stays as it was
                pass


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """A real ledger or intake, mutated as a tree (comments kept) or as text, as the bytes of a file."""
    raw = draw(st.sampled_from(BASES))
    if draw(st.integers(0, 9)) == 0:  # a cut or a splice of the text itself
        cut = draw(st.integers(0, len(raw)))
        return raw[:cut] + draw(st.sampled_from([b"", b"\n", b": [", b"\xff", b"\x1b", b"#", b"  - x\n"])) + raw[cut:]
    yaml = make_yaml()
    data = yaml.load(raw.decode("utf-8-sig"))
    for _ in range(draw(st.integers(1, 5))):
        _mutate_tree(draw, data)
    buf = io.StringIO()
    try:
        yaml.dump(data, buf)
    except Exception:  # what ruamel cannot write (a key it cannot represent), the user cannot write either
        return raw
    try:
        return buf.getvalue().encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written as the escape a user would write
        return buf.getvalue().encode("utf-8", "backslashreplace")


def _check(document: bytes, entry: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.ledger.yaml"
        path.write_bytes(document)
        check_run(run_entry("validate", path, Path(tmp) / "w0"))
        run = run_entry(entry, path, Path(tmp) / "w1")
        check_run(run, sarif_errors)
        assert not [p.name for p in Path(tmp).rglob("*.tmp")]


_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@settings(max_examples=DEFAULT_EXAMPLES, deadline=None, suppress_health_check=_HEALTH, derandomize=True)
@given(documents(), st.sampled_from(ENTRY_POINTS))
def test_mutated_documents_through_every_entry_point(document: bytes, entry: str) -> None:
    _check(document, entry)


#: the slow run's documents in this many independent parts, so that the test workers share them
SHARDS = 4


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
@settings(max_examples=max(1, SLOW_EXAMPLES // SHARDS), deadline=None, suppress_health_check=_HEALTH)
@given(document=documents(), entry=st.sampled_from(ENTRY_POINTS))
def test_many_mutated_documents_through_every_entry_point(shard: int, document: bytes, entry: str) -> None:
    _check(document, entry)
