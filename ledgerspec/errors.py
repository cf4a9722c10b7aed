"""The one error type for user-facing failures.

Anything a user can cause (a bad file, a bad flag, a missing config) is raised as
:class:`LedgerspecError`. The CLI turns it into one line ``FILE:LINE:COL: rule: message``
and an exit code; nothing else reaches the user as a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

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
