"""The one error type for user-facing failures.

Anything a user can cause (a bad file, a bad flag, a missing config) is raised as
:class:`LedgerspecError`. The CLI turns it into one line ``FILE:LINE:COL: rule: message``
and an exit code; nothing else reaches the user as a traceback.
"""

from __future__ import annotations

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
        text = f"{self.location()}: {self.rule}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut at ``limit`` characters (its type's name when empty)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]


def joined_lines(exc: BaseException, limit: int = 300) -> str:
    """Every line of an exception's message on one line (transformers' config validation puts the reason on the
    second line), cut at ``limit`` characters."""
    parts = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (" ".join(parts) or type(exc).__name__)[:limit]


def described(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception (the type alone when the message is empty)."""
    text = first_line(exc, limit) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
