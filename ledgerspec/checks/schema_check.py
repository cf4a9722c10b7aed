"""Schema errors as findings, with one readable message per problem instead of a wall of anyOf noise."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from typing import Any

from ledgerspec.checks.findings import ERROR, Hit
from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, pointer
from ledgerspec.contract.schema import validator
from ledgerspec.contract.units import SIZE_PATTERN, UnitError, parse_size
from ledgerspec.contract.values import UNKNOWN_WORDS

_LONG_KEYS = ("value", "source", "note", "method")
_SIZE_RE = re.compile(SIZE_PATTERN)


def schema_hits(doc: Document) -> Iterator[Hit]:
    kind = doc.kind or "ledger"
    seen: set[str] = set()
    for err in sorted(validator(kind).iter_errors(doc.plain), key=lambda e: list(e.absolute_path)):
        path = tuple(str(p) for p in err.absolute_path)
        hit = _explain(kind, path, err, doc.as_written(*path))
        key = hit.pointer + hit.message
        if key not in seen:
            seen.add(key)
            yield hit
    yield from _size_hits(doc, kind)


def _size_hits(doc: Document, kind: str) -> Iterator[Hit]:
    """Sizes the schema's pattern admits but no byte count matches: fractions of a byte, over 1 EiB."""
    for path, field in F.walk(F.top_fields(kind)):
        if field.kind not in (F.MEMORY, F.SIZE, F.FIGURES):
            continue
        node: Any = doc.plain
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        items = list(enumerate(node)) if field.kind == F.FIGURES and isinstance(node, list) else [(None, node)]
        for i, item in items:
            value = item.get("value") if isinstance(item, dict) else item
            if isinstance(value, str) and _SIZE_RE.match(value):
                try:
                    parse_size(value)
                except UnitError as exc:
                    where = (*path, str(i)) if i is not None else path
                    yield Hit(pointer(*where), f"{'.'.join(where)}: {exc}", ERROR)


def _explain(kind: str, path: tuple[str, ...], err: Any, written: str | None = None) -> Hit:
    where = pointer(*path)
    dotted = ".".join(path) or "document"
    if err.validator == "additionalProperties":
        return _unknown_keys(kind, path, err)
    field = F.lookup(kind, tuple(p for p in path if not p.isdigit()))
    if err.validator == "anyOf" and field is not None:
        return Hit(where, f"{dotted}: {_expected(field, err.instance, written)}", ERROR)
    if err.validator == "required" and path == ():
        return Hit(where, "missing header `ledgerspec:` (ledger/v1 or intake/v1)", ERROR)
    if err.validator == "type" and err.validator_value == "object" and field is not None:
        return Hit(where, f"{dotted} must be a mapping of keys (got {_show(err.instance)})", ERROR)
    return Hit(where, f"{dotted}: {err.message}", ERROR)


def _unknown_keys(kind: str, path: tuple[str, ...], err: Any) -> Hit:
    field = F.lookup(kind, path) if path else None
    if field is not None and field.kind != F.OBJECT:  # a long form with a stray key
        known: list[str] = list(_LONG_KEYS)
        where_kind = "a long-form value"
    else:
        known = [f.name for f in (field.children if field else F.top_fields(kind))]
        if not path:
            known.append("ledgerspec")
        where_kind = f"section {'.'.join(path)}" if path else "the top level"
    extras = [k for k in err.instance if k not in known and not str(k).startswith("x-")]
    parts = []
    other = "intake" if kind == "ledger" else "ledger"
    elsewhere = {f.name for f in F.top_fields(other)} - set(known) if not path else set()
    for k in extras:
        guess = difflib.get_close_matches(str(k), known, n=1)
        if k in elsewhere:  # a ledger's section in an intake: not a typo
            a, b = ("an", "a") if other == "intake" else ("a", "an")
            parts.append(f"{k!r} (a section of {a} {other}/v1 document, not of {b} {kind}/v1 one)")
            continue
        parts.append(f"{k!r}" + (f" (did you mean {guess[0]!r}?)" if guess else ""))
    first = pointer(*path, extras[0]) if extras else pointer(*path)
    return Hit(
        first,
        f"unknown key {', '.join(parts)} in {where_kind}; known keys: {', '.join(known)} (prefix extensions with x-)",
        ERROR,
    )


def _expected(field: F.Field, value: Any, written: str | None = None) -> str:
    if isinstance(value, dict):
        src = value.get("source")
        if "source" not in value:
            return (
                "a long-form value needs `source` (one of "
                + ", ".join(F.SOURCES)
                + "); got keys "
                + ", ".join(map(str, value))
            )
        if src not in F.SOURCES:
            guess = difflib.get_close_matches(str(src), F.SOURCES, n=1)
            return (
                f"unknown source {src!r}"
                + (f" (did you mean {guess[0]}?)" if guess else "")
                + "; use one of "
                + ", ".join(F.SOURCES)
            )
        stray = [k for k in value if k not in _LONG_KEYS and not str(k).startswith("x-")]
        if stray:
            return f"unknown key(s) {', '.join(map(repr, stray))} in a long-form value; use value, source, note, method"
        if "value" not in value:
            return f"source {src} needs a `value`"
        return _expected_plain(field, value.get("value"), long_form=True, written=written)
    return _expected_plain(field, value, written=written)


def _expected_plain(field: F.Field, value: Any, long_form: bool = False, written: str | None = None) -> str:
    message = _expected_plain_of(field, value, written)
    lower = isinstance(value, str) and value.strip() not in UNKNOWN_WORDS and value.strip().upper() in UNKNOWN_WORDS
    if lower and not long_form:  # a long form's value is never UNKNOWN, in any case
        message += f" ({value.strip().upper()} is written in capitals)"
    return message


def _expected_plain_of(field: F.Field, value: Any, written: str | None) -> str:
    k = field.kind
    got = _show(value)
    if k in (F.MEMORY, F.SIZE) or (k == F.FIGURES and not isinstance(value, list)):
        try:
            parse_size(value)
        except UnitError as exc:
            return str(exc)
        if k == F.FIGURES:
            return (
                f"{got} is a single figure; write a list with one figure per rank (a total summed across "
                "GPUs is not a per-rank peak)"
            )
        return f"{got} is not a size; write integer bytes or a number with a unit"
    if k == F.FIGURES:
        return "expected a list of sizes, one per rank (each plain, UNKNOWN, or long form)"
    if k == F.COUNT:
        return f"expected a non-negative integer count, got {got}"
    if k == F.INT:
        lo = f" >= {int(field.minimum)}" if field.minimum is not None else ""
        return f"expected an integer{lo}, got {got}"
    if k in (F.NUMBER, F.SECONDS):
        lo = f" >= {field.minimum}" if field.minimum is not None else ""
        return f"expected a number{lo}, got {got}"
    if k == F.SWITCH:
        return f"expected a switch (true/false, ON/OFF, YES/NO), got {got}"
    if k == F.ENUM:
        by_case = {str(e).lower(): e for e in field.enum}
        lower = str(value).strip().lower()
        guess = [by_case[lower]] if lower in by_case else difflib.get_close_matches(str(value), field.enum, n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        return f"{got} is not one of {', '.join(field.enum)}{hint}"
    if k == F.STRINGS:
        return f"expected a string or a list of strings, got {got}"
    if k in (F.INTMAP, F.NUMMAP):
        return f"expected a mapping of module pattern -> {'integer' if k == F.INTMAP else 'number'}, got {got}"
    if k == F.STRING:
        if isinstance(value, int | float) and not isinstance(value, bool):
            # YAML reads a bare 4.50 as the number 4.5: a version or a name written as a number loses its text
            written = written or str(value)
            return f"expected a string, got the number {written}; quote it to keep it as written: '{written}'"
        return f"expected a string, got {got}"
    words = " or ".join(UNKNOWN_WORDS)
    return f"invalid value {got}; write a plain value, {words}, or the long form"


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
