"""The status a document should declare, and the comment that says why (``validate --fix``, and every command
that writes a ledger). Pure: :func:`ledgerspec.contract.edit.set_status` makes the edit."""

from __future__ import annotations

from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report

MAX_REASONS_IN_COMMENT = 3
COMMENT_PREFIX = "ledgerspec: lowered from "


def fix_comment(report: Report) -> str:
    """The comment written beside a lowered status: where it came from and why (one line)."""
    reasons = report.reasons[:MAX_REASONS_IN_COMMENT]
    more = len(report.reasons) - len(reasons)
    comment = f"{COMMENT_PREFIX}{report.declared_status}: " + "; ".join(reasons)
    if more > 0:
        comment += f" (+{more} more)"
    return " ".join(comment.split())


def needs_fix(report: Report) -> bool:
    declared, supported = report.declared_status, report.supported_status
    return supported is not None and declared in RANK and RANK[declared] > RANK[supported]


def status_fix(report: Report) -> tuple[str, str] | None:
    """``(status, comment)`` to declare instead, or None when the declared status stands."""
    if not needs_fix(report) or report.supported_status is None:
        return None
    return report.supported_status, fix_comment(report)


__all__ = ["COMMENT_PREFIX", "fix_comment", "needs_fix", "status_fix"]
