"""Safe round-trip loading of ledger YAML.

ruamel.yaml's round-trip mode keeps comments, key order and quoting for later write-back.
On top of it this module refuses what a ledger never needs and an attacker might use:
anchors and aliases (alias bombs), explicit tags (``!!python/object``), duplicate keys,
multiple documents, non-UTF-8 bytes, very deep nesting and very large files. Each refusal is
one :class:`~ledgerspec.errors.LedgerspecError` with FILE:LINE:COL.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.composer import Composer
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent

from ledgerspec.errors import EXIT_USAGE, LedgerspecError

#: files larger than this are refused before parsing (a ledger is a few KiB)
MAX_FILE_BYTES = 1 << 20
#: mappings/sequences nested deeper than this are refused
MAX_DEPTH = 32


class _Refused(YAMLError):
    def __init__(self, message: str, mark: Any, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark
        self.hint = hint


class SafeComposer(Composer):
    """A composer that refuses aliases, anchors, explicit tags and deep nesting."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.parser.peek_event()
        if isinstance(event, AliasEvent):
            raise _Refused("aliases (*name) are not allowed in ledger files", event.start_mark,
                           "write the value out in full")
        if isinstance(event, ScalarEvent | MappingStartEvent | SequenceStartEvent):
            if event.anchor is not None:
                raise _Refused(f"anchors (&{event.anchor}) are not allowed in ledger files", event.start_mark,
                               "write the value out in full")
            tag = event.tag
            if tag is not None and not _implicit(event):
                raise _Refused(f"explicit YAML tags ({tag}) are not allowed in ledger files", event.start_mark,
                               "remove the tag; ledger values are plain YAML")
        if isinstance(event, MappingStartEvent | SequenceStartEvent):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", event.start_mark,
                               "a ledger is at most a few levels deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


def _implicit(event: Any) -> bool:
    implicit = getattr(event, "implicit", None)
    if isinstance(event, ScalarEvent):
        # a scalar whose tag was written out has implicit == (False, False)
        return bool(implicit and (implicit[0] or implicit[1]))
    return bool(implicit)


def make_yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.Composer = SafeComposer
    yaml.preserve_quotes = True
    yaml.allow_duplicate_keys = False
    yaml.width = 4096
    return yaml


def _line_col_of_offset(data: bytes, offset: int) -> tuple[int, int]:
    before = data[:offset]
    line = before.count(b"\n") + 1
    col = offset - (before.rfind(b"\n") + 1) + 1
    return line, col


def read_text(path: str | os.PathLike[str], display: str | None = None) -> str:
    """Read a ledger file as text: size cap, UTF-8 (a BOM is accepted), CRLF kept for write-back."""
    shown = display or str(path)
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise LedgerspecError("no such file", shown, rule="load", hint="check the path") from None
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror}", shown, rule="load") from None
    if not p.is_file():
        raise LedgerspecError("not a regular file", shown, rule="load")
    if st.st_size > MAX_FILE_BYTES:
        raise LedgerspecError(f"file is {st.st_size} bytes, over the {MAX_FILE_BYTES}-byte limit for a ledger",
                              shown, 1, 1, rule="load", hint="a ledger is a few KiB; is this the right file?")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror}", shown, rule="load") from None
    return decode(raw, shown)


def decode(raw: bytes, display: str) -> str:
    if len(raw) > MAX_FILE_BYTES:
        raise LedgerspecError(f"input is {len(raw)} bytes, over the {MAX_FILE_BYTES}-byte limit", display, 1, 1,
                              rule="load")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise LedgerspecError("file is UTF-16; ledger files are UTF-8", display, 1, 1, rule="load",
                              hint="re-save the file as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, col = _line_col_of_offset(raw, exc.start)
        raise LedgerspecError(f"invalid UTF-8 byte 0x{raw[exc.start]:02x}", display, line, col, rule="load",
                              hint="re-save the file as UTF-8") from None
    if "\x00" in text:
        line, col = _line_col_of_offset(raw, raw.index(b"\x00"))
        raise LedgerspecError("NUL character in file (binary data?)", display, line, col, rule="load")
    return text


def parse(text: str, display: str) -> Any:
    """Parse one YAML document from ``text`` with the safe round-trip loader."""
    yaml = make_yaml()
    try:
        data = yaml.load(io.StringIO(text))
    except _Refused as exc:
        raise _error(display, exc.message, exc.mark, exc.hint) from None
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(p) for p in (exc.context, exc.problem) if p) or "invalid YAML"
        hint = None
        if "duplicate key" in message:
            message = "duplicate key " + _dup_key(exc)
            hint = "each key may appear once; remove or rename one"
        elif "\\t" in message or "'\\t'" in str(exc):
            hint = "indent with spaces, not tabs"
        elif "expected a single document" in message:
            hint = "a ledger file holds one YAML document"
        raise _error(display, message, mark, hint) from None
    except YAMLError as exc:
        raise LedgerspecError(f"invalid YAML: {exc}".splitlines()[0], display, rule="load") from None
    except (RecursionError, ValueError, OverflowError) as exc:
        raise LedgerspecError(f"unreadable value: {type(exc).__name__}: {exc}"[:200], display, rule="load") from None
    return data


def _dup_key(exc: MarkedYAMLError) -> str:
    problem = str(exc.problem or "")
    start = problem.find('"')
    end = problem.find('"', start + 1)
    return problem[start:end + 1] if 0 <= start < end else ""


def _error(display: str, message: str, mark: Any, hint: str | None) -> LedgerspecError:
    line = mark.line + 1 if mark is not None else None
    col = mark.column + 1 if mark is not None else None
    return LedgerspecError(message.strip(), display, line, col, rule="load", hint=hint, exit_code=EXIT_USAGE)


def to_plain(node: Any, display: str = "<input>", where: Any = None) -> Any:
    """A JSON-compatible copy of a round-trip tree (dict/list/str/int/float/bool/None).

    Dates become ISO strings, non-string keys are refused with their position.
    """
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            if not isinstance(k, str):
                line, col = _key_pos(node, k)
                raise LedgerspecError(f"key {k!r} is not a string", display, line, col, rule="load",
                                      hint="quote the key")
            out[str(k)] = to_plain(v, display, node)
        return out
    if isinstance(node, list):
        return [to_plain(v, display, node) for v in node]
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    if isinstance(node, _dt.date | _dt.datetime):
        return node.isoformat()
    return str(node)


def _key_pos(mapping: Any, key: Any) -> tuple[int | None, int | None]:
    try:
        line, col = mapping.lc.key(key)
        return line + 1, col + 1
    except Exception:
        return None, None
