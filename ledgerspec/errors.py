"""The one error type for user-facing failures.

Anything a user can cause (a bad file, a bad flag, a missing config) is raised as
:class:`LedgerspecError`. The CLI turns it into one line ``FILE:LINE:COL: rule: message``
and an exit code; nothing else reaches the user as a traceback.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
#: an unexpected exception: a bug in ledgerspec, never the user's input (sysexits EX_SOFTWARE)
EXIT_INTERNAL = 70


@dataclass
class LedgerspecError(Exception):
    """A failure the user can fix. ``line``/``column`` are 1-based when known."""

    message: str
    path: str | None = None
    line: int | None = None
    column: int | None = None
    rule: str = "error"
    hint: str | None = None
    exit_code: int = EXIT_USAGE

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.format()

    def to_json(self) -> dict[str, Any]:
        """The error as JSON, for a child process to hand back (``LedgerspecError(**data)`` rebuilds it)."""
        return asdict(self)

    def location(self) -> str:
        if self.path is None:
            return "ledgerspec"
        loc = self.path
        if self.line is not None:
            loc += f":{self.line}"
            if self.column is not None:
                loc += f":{self.column}"
        return loc

    def format(self) -> str:
        """The one line a terminal shows: user strings in it (a path, a value) are :func:`printable`."""
        text = f"{self.location()}: {self.rule}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return printable(text)


#: what a terminal must never receive raw from a user's string: C0 and C1 controls (ESC starts an escape
#: sequence, U+009B is a one-byte CSI), DEL, the line and paragraph separators, the bidirectional overrides and
#: isolates ("Trojan Source", CVE-2021-42574), and lone surrogates (Python's surrogateescape of a file name's
#: non-UTF-8 bytes, which no UTF-8 stream can carry)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match[str]) -> str:
    char = m.group()
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (os.fsdecode's surrogateescape): shown as that byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` safe for a terminal, on one line: every control character, escape sequence introducer,
    bidirectional control and undecodable byte shown as a Python-style escape (``\\x1b``, ``\\n``, ``\\u202e``,
    ``\\xff``); everything else (any printable Unicode) kept."""
    return _UNPRINTABLE.sub(_escaped, text)


class PrintableLines:
    """A text stream that passes everything written to it through :func:`printable`, line by line (the line
    breaks kept): for a command's messages that quote paths and values."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return int(self.stream.write("\n".join(printable(part) for part in text.split("\n"))) or 0)

    def flush(self) -> None:
        self.stream.flush()


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """``text`` with the lone surrogates of an undecodable file name shown as ``\\xNN`` (as :func:`printable`
    does), so that it encodes as UTF-8: for JSON, SARIF and HTML, which escape the rest themselves."""
    return _SURROGATE.sub(_escaped, text)


#: what JSON leaves raw (``ensure_ascii=False``) that a terminal must not get raw: C1 controls, DEL, the line and
#: paragraph separators, the bidirectional controls (JSON escapes C0 controls itself)
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def json_text(text: str) -> str:
    """A JSON text (``json.dumps(..., ensure_ascii=False)`` of :func:`encodable` strings) with the characters of
    :data:`_JSON_UNSAFE` written as ``\\uXXXX`` escapes: the same JSON value, safe to print on a terminal. They
    can only occur inside JSON strings, where such an escape is the character itself."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, an ellipsis where it was cut (so a cut message does not read whole)."""
    return text if len(text) <= limit else text[: max(limit - 3, 0)].rstrip() + "..."


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut at ``limit`` characters (its type's name when empty)."""
    lines = str(exc).strip().splitlines()
    return _cut(lines[0] if lines else type(exc).__name__, limit)


def joined_lines(exc: BaseException, limit: int = 300) -> str:
    """Every line of an exception's message on one line (transformers' config validation puts the reason on the
    second line), cut at ``limit`` characters."""
    parts = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return _cut(" ".join(parts) or type(exc).__name__, limit)


def described(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception (the type alone when the message is empty)."""
    text = first_line(exc, limit) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
