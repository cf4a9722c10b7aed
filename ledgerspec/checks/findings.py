"""Findings: what a rule reports about a document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    pointer: str
    message: str
    line: int = 1
    column: int = 1

    def located(self, path: str) -> str:
        """The finding as one line of ``validate``'s text: ``PATH:LINE:COL: RULE: SEVERITY: MESSAGE`` (the caller
        makes it printable)."""
        return f"{path}:{self.line}:{self.column}: {self.rule}: {self.severity}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        """The JSON report's finding, keys in the spec's order."""
        return {
            "rule": self.rule,
            "severity": self.severity,
            "pointer": self.pointer,
            "line": self.line,
            "column": self.column,
            "message": self.message,
        }


@dataclass(frozen=True)
class Hit:
    """A rule's raw report: where and what; the validator adds the position."""

    pointer: str
    message: str
    severity: str | None = None  # overrides the rule's default severity
