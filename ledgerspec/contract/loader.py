"""Safe round-trip loading of ledger YAML.

ruamel.yaml's round-trip mode keeps comments, key order and quoting for later write-back.
On top of it this module refuses what a ledger never needs and an attacker might use:
anchors and aliases (alias bombs), explicit tags (``!!python/object``), duplicate keys,
multiple documents, non-UTF-8 bytes, very deep nesting, very large files or node counts (which
bound the parse time), values that cannot be constructed (impossible dates, integers too long to
print) and strings that cannot be written back as UTF-8 (lone surrogates). Each refusal is one
:class:`~ledgerspec.errors.LedgerspecError` with FILE:LINE:COL.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import stat
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.composer import Composer
from ruamel.yaml.constructor import RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.reader import ReaderError
from ruamel.yaml.representer import RoundTripRepresenter

from ledgerspec.errors import EXIT_USAGE, LedgerspecError

#: the UTF-8 byte order mark some editors write (accepted on reading, kept on write-back)
BOM = b"\xef\xbb\xbf"
#: files larger than this are refused before parsing (a ledger is a few KiB)
MAX_FILE_BYTES = 1 << 20
#: mappings/sequences nested deeper than this are refused
MAX_DEPTH = 32
#: documents with more YAML nodes than this are refused (a full ledger has ~2,000; this bounds parse time)
MAX_NODES = 20_000
#: integers longer than this many bits are refused (sizes stop at 2**60; counts at 10**15)
MAX_INT_BITS = 256


class _Refused(YAMLError):
    def __init__(self, message: str, mark: Any, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark
        self.hint = hint


_MERGE_TAG = "tag:yaml.org,2002:merge"


class SafeComposer(Composer):
    """A composer that refuses aliases, anchors, explicit tags, merge keys, non-scalar keys, deep nesting and
    documents with too many nodes."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.parser.peek_event()
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(
                f"more than {MAX_NODES} YAML nodes",
                event.start_mark,
                "a ledger has a few thousand values at most; is this the right file?",
            )
        if isinstance(event, AliasEvent):
            raise _Refused(
                "aliases (*name) are not allowed in ledger files", event.start_mark, "write the value out in full"
            )
        if isinstance(event, ScalarEvent | MappingStartEvent | SequenceStartEvent):
            if event.anchor is not None:
                raise _Refused(
                    f"anchors (&{event.anchor}) are not allowed in ledger files",
                    event.start_mark,
                    "write the value out in full",
                )
            tag = event.tag
            if tag is not None and not _implicit(event):
                raise _Refused(
                    f"explicit YAML tags ({tag}) are not allowed in ledger files",
                    event.start_mark,
                    "remove the tag; ledger values are plain YAML",
                )
        if isinstance(event, MappingStartEvent | SequenceStartEvent):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    f"nesting deeper than {MAX_DEPTH} levels", event.start_mark, "a ledger is at most a few levels deep"
                )
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        for key, _ in node.value:
            if not isinstance(key, ScalarNode):
                raise _Refused("a list or mapping used as a key", key.start_mark, "keys are plain names")
            if key.tag == _MERGE_TAG:
                raise _Refused(
                    "merge keys (<<) are not allowed in ledger files", key.start_mark, "write the keys out in full"
                )
        return node


class SafeConstructor(RoundTripConstructor):
    """A round-trip constructor that turns a value it cannot build into a refusal at the value's position."""

    def construct_non_recursive_object(self, node: Any, tag: str | None = None) -> Any:
        try:
            return super().construct_non_recursive_object(node, tag)
        except (ValueError, OverflowError, TypeError, ArithmeticError) as exc:
            raise _Refused(_unreadable(node, exc), node.start_mark, _UNREADABLE_HINT) from None


class SourceFloat(float):
    """A float that remembers how it was written, so write-back re-emits ``1_000.5`` or ``1.0e+400`` as is."""

    source: str


class SourceInt(int):
    """An int written in a form ruamel would not reproduce (``+5``, ``-0``)."""

    source: str


def _construct_float(constructor: Any, node: Any) -> Any:
    value = SourceFloat(RoundTripConstructor.construct_yaml_float(constructor, node))
    value.source = node.value
    return value


def _construct_int(constructor: Any, node: Any) -> Any:
    value = RoundTripConstructor.construct_yaml_int(constructor, node)
    if type(value) is int and str(value) != node.value:
        value = SourceInt(value)
        value.source = node.value
    return value


SafeConstructor.add_constructor("tag:yaml.org,2002:float", _construct_float)
SafeConstructor.add_constructor("tag:yaml.org,2002:int", _construct_int)


class SafeRepresenter(RoundTripRepresenter):
    """Re-emits numbers read from the file exactly as they were written (ruamel rounds some floats), and quotes
    the words a YAML 1.1 reader (PyYAML) would turn into booleans."""


def _represent_source(representer: Any, data: Any) -> Any:
    tag = "tag:yaml.org,2002:float" if isinstance(data, float) else "tag:yaml.org,2002:int"
    return representer.represent_scalar(tag, data.source)


#: plain words that YAML 1.1 resolves to booleans (ruamel, a YAML 1.2 reader, keeps them as strings)
YAML11_BOOL_WORDS = frozenset(
    "y Y yes Yes YES n N no No NO true True TRUE false False FALSE on On ON off Off OFF".split()
)


class PlainWord(str):
    """One of :data:`YAML11_BOOL_WORDS` that the file itself wrote bare: written back bare, as the user wrote it."""


def _construct_str(constructor: Any, node: Any) -> Any:
    value = RoundTripConstructor.construct_yaml_str(constructor, node)
    if type(value) is str and node.style is None and value in YAML11_BOOL_WORDS:
        return PlainWord(value)
    return value


def _represent_str(representer: Any, data: str) -> Any:
    """A string like ``ON`` or ``no`` that a tool writes is quoted: the spec requires it of every tool that writes
    such words, so that a YAML 1.1 reader gets the string and not a boolean. (Words the file already held bare
    are :class:`PlainWord` and keep their style: write-back preserves the user's quoting.)"""
    if data in YAML11_BOOL_WORDS:
        return representer.represent_scalar("tag:yaml.org,2002:str", data, style="'")
    return RoundTripRepresenter.represent_str(representer, data)


def _represent_plain_word(representer: Any, data: PlainWord) -> Any:
    return RoundTripRepresenter.represent_str(representer, data)


SafeConstructor.add_constructor("tag:yaml.org,2002:str", _construct_str)
SafeRepresenter.add_representer(SourceFloat, _represent_source)
SafeRepresenter.add_representer(SourceInt, _represent_source)
SafeRepresenter.add_representer(str, _represent_str)
SafeRepresenter.add_representer(PlainWord, _represent_plain_word)

_UNREADABLE_HINT = "quote the value to keep it as text, or write it as the field expects"


def _unreadable(node: Any, exc: BaseException) -> str:
    text = str(getattr(node, "value", ""))
    shown = text if len(text) <= 40 else f"{text[:37]}... ({len(text)} characters)"
    reason = str(exc).split(";")[0].split("\n")[0]
    return f"cannot read the value {shown!r}: {reason}"


def _implicit(event: Any) -> bool:
    implicit = getattr(event, "implicit", None)
    if isinstance(event, ScalarEvent):
        # a scalar whose tag was written out has implicit == (False, False)
        return bool(implicit and (implicit[0] or implicit[1]))
    return bool(implicit)


def make_yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.Composer = SafeComposer
    yaml.Constructor = SafeConstructor
    yaml.Representer = SafeRepresenter
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
    return read_document_bytes(path, display)[0]


def read_document_text(path: str | os.PathLike[str], display: str | None = None) -> tuple[str, bool]:
    """:func:`read_text`, and whether the file starts with a UTF-8 byte order mark (write-back keeps it)."""
    text, bom, _ = read_document_bytes(path, display)
    return text, bom


def read_document_bytes(path: str | os.PathLike[str], display: str | None = None) -> tuple[str, bool, str]:
    """:func:`read_document_text` and the sha256 of the bytes read (a later save checks the file is unchanged).

    The file is opened first (non-blocking: a FIFO put in its place never hangs the read) and what was opened is
    checked: a regular file of at most :data:`MAX_FILE_BYTES`, read with that bound even if it grows meanwhile.
    """
    import hashlib

    shown = display or os.fsdecode(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise LedgerspecError("no such file", shown, rule="load", hint="check the path") from None
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror or exc}", shown, rule="load") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LedgerspecError(f"not a regular file ({file_type(st.st_mode)})", shown, rule="load")
        if st.st_size > MAX_FILE_BYTES:
            raise LedgerspecError(
                f"file is {st.st_size} bytes, over the {MAX_FILE_BYTES}-byte limit for a ledger",
                shown,
                1,
                1,
                rule="load",
                hint="a ledger is a few KiB; is this the right file?",
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror or exc}", shown, rule="load") from None
    finally:
        os.close(fd)
    return decode(raw, shown), raw.startswith(BOM), hashlib.sha256(raw).hexdigest()


def read_stream(stream: Any, display: str = "<stdin>") -> str:
    """A document from a binary stream (``validate -``), read with the same bound as a file: at most
    :data:`MAX_FILE_BYTES` + 1 bytes are ever held, so a gigabyte piped in is refused without being read whole."""
    try:
        raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise LedgerspecError(f"cannot read: {exc.strerror or exc}", display, rule="load") from None
    if len(raw) > MAX_FILE_BYTES:
        raise LedgerspecError(
            f"input is over the {MAX_FILE_BYTES}-byte limit for a ledger",
            display,
            1,
            1,
            rule="load",
            hint="a ledger is a few KiB; is this the right input?",
        )
    return decode(raw, display)


def file_type(mode: int) -> str:
    """What a non-regular file is, in words (for messages)."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def decode(raw: bytes, display: str) -> str:
    if len(raw) > MAX_FILE_BYTES:
        raise LedgerspecError(
            f"input is {len(raw)} bytes, over the {MAX_FILE_BYTES}-byte limit", display, 1, 1, rule="load"
        )
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise LedgerspecError(
            "file is UTF-16; ledger files are UTF-8", display, 1, 1, rule="load", hint="re-save the file as UTF-8"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, col = _line_col_of_offset(raw, exc.start)
        raise LedgerspecError(
            f"invalid UTF-8 byte 0x{raw[exc.start]:02x}",
            display,
            line,
            col,
            rule="load",
            hint="re-save the file as UTF-8",
        ) from None
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
        if exc.context_mark is not None and ("end of stream" in str(exc.problem) or "<stream end>" in str(exc.problem)):
            mark = exc.context_mark  # an unclosed quote or bracket: point at where it was opened
        message = " ".join(str(p) for p in (exc.context, exc.problem) if p) or "invalid YAML"
        hint = None
        unclosed = _unclosed_flow(exc)
        if unclosed is not None:
            mark, message, hint = unclosed
        elif "duplicate key" in message:
            message = "duplicate key " + _dup_key(exc)
            hint = "each key may appear once; remove or rename one"
        elif "\\t" in message or "'\\t'" in str(exc):
            hint = "indent with spaces, not tabs"
        elif "expected a single document" in message:
            hint = "a ledger file holds one YAML document"
        raise _error(display, message, mark, hint) from None
    except ReaderError as exc:
        line, col = _line_col_of_text(text, exc.position)
        raise LedgerspecError(
            _reader_message(exc),
            display,
            line,
            col,
            rule="load",
            hint="remove the control character, or write it as an escape in a double-quoted string",
        ) from None
    except YAMLError as exc:
        raise LedgerspecError(f"invalid YAML: {exc}".splitlines()[0], display, 1, 1, rule="load") from None
    except (RecursionError, ValueError, OverflowError, TypeError) as exc:
        raise LedgerspecError(
            f"unreadable value: {type(exc).__name__}: {exc}".splitlines()[0][:200], display, 1, 1, rule="load"
        ) from None
    return data


def _reader_message(exc: ReaderError) -> str:
    char = exc.character
    code = ord(char) if isinstance(char, str | bytes) and len(char) == 1 else char
    shown = f"U+{code:04X}" if isinstance(code, int) else repr(code)
    return f"control character {shown} is not allowed in YAML ({exc.reason})"


def _line_col_of_text(text: str, position: Any) -> tuple[int, int]:
    if not isinstance(position, int) or position < 0:
        return 1, 1
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _unclosed_flow(exc: Any) -> tuple[Any, str, str] | None:
    """A ``[`` or ``{`` left open: the parser stops at the first line that cannot continue it (the next key), one
    line or more after the real mistake; point at the bracket instead, and say where the parser stopped."""
    context, problem = str(exc.context or ""), exc.problem_mark
    if not context.startswith("while parsing a flow") or exc.context_mark is None or problem is None:
        return None
    if problem.line <= exc.context_mark.line:
        return None
    kind = "sequence" if "sequence" in context else "mapping"
    bracket, closing = ("[", "]") if kind == "sequence" else ("{", "}")
    return (
        exc.context_mark,
        f"unclosed '{bracket}' (a flow {kind}): the parser reached line {problem.line + 1} without its "
        f"'{closing}' ({exc.problem})",
        f"close the {bracket}...{closing} on the line it opens, or write one item per line",
    )


def _dup_key(exc: MarkedYAMLError) -> str:
    problem = str(exc.problem or "")
    start = problem.find('"')
    end = problem.find('"', start + 1)
    return problem[start : end + 1] if 0 <= start < end else ""


def _error(display: str, message: str, mark: Any, hint: str | None) -> LedgerspecError:
    line = mark.line + 1 if mark is not None else None
    col = mark.column + 1 if mark is not None else None
    return LedgerspecError(message.strip(), display, line, col, rule="load", hint=hint, exit_code=EXIT_USAGE)


def to_plain(node: Any, display: str = "<input>", where: tuple[int, int] = (1, 1)) -> Any:
    """A JSON-compatible copy of a round-trip tree (dict/list/str/int/float/bool/None).

    Dates become ISO strings. Non-string keys, integers over :data:`MAX_INT_BITS` bits and strings
    that UTF-8 cannot encode (lone surrogates from ``\\ud800`` escapes) are refused with their position.
    """
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            if not isinstance(k, str):
                line, col = _key_pos(node, k)
                raise LedgerspecError(
                    f"key {_short(k)} is not a string", display, line, col, rule="load", hint="quote the key"
                )
            _check_text(k, display, _key_pos(node, k))
            out[str(k)] = to_plain(v, display, _value_pos(node, k, where))
        return out
    if isinstance(node, list):
        return [to_plain(v, display, _item_pos(node, i, where)) for i, v in enumerate(node)]
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        if node.bit_length() > MAX_INT_BITS:
            raise LedgerspecError(
                f"integer of about {int(node.bit_length() * 0.30103) + 1} digits is too large",
                display,
                *where,
                rule="load",
                hint="sizes are at most 2**60 bytes; check the value",
            )
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        _check_text(node, display, where)
        return str(node)
    if isinstance(node, _dt.date | _dt.datetime):
        return node.isoformat()
    return str(node)


def _check_text(text: str, display: str, where: tuple[int | None, int | None]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LedgerspecError(
            f"string holds a lone surrogate U+{ord(text[exc.start]):04X}, which UTF-8 cannot encode",
            display,
            *where,
            rule="load",
            hint="write the character itself, or a full \\U escape",
        ) from None


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = "<a very large number>"
    text = text.replace("ordereddict(", "mapping(").replace("CommentedSeq(", "list(")
    return text if len(text) <= 40 else text[:37] + "..."


def _key_pos(mapping: Any, key: Any) -> tuple[int | None, int | None]:
    try:
        line, col = mapping.lc.key(key)
        return line + 1, col + 1
    except Exception:
        return None, None


def _value_pos(mapping: Any, key: Any, fallback: tuple[int, int]) -> tuple[int, int]:
    try:
        line, col = mapping.lc.value(key)
        return line + 1, col + 1
    except Exception:
        return fallback


def _item_pos(seq: Any, index: int, fallback: tuple[int, int]) -> tuple[int, int]:
    try:
        line, col = seq.lc.item(index)
        return line + 1, col + 1
    except Exception:
        return fallback
