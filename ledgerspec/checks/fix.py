"""The status a document should declare, and the comment that says why (``validate --fix``, and every command
that writes a ledger). The declared status follows the evidence, up or down (spec, "The status ladder"). Pure:
:func:`ledgerspec.contract.edit.set_status` makes the edit.
"""

from __future__ import annotations

from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report

MAX_REASONS_IN_COMMENT = 3
COMMENT_PREFIX = "ledgerspec: lowered from "
RAISED_PREFIX = "ledgerspec: raised from "
#: why the evidence supports each status (the comment beside a raised status)
SUPPORTED_BECAUSE = {
    "INSUFFICIENT DATA": "nothing more is supported yet",
    "CALCULATED": "the minimum intake is complete and the frozen base, adapter, gradients and optimizer are exact",
    "CANDIDATE": "exact figures, an activation figure and a peak that fits the target device",
    "VALIDATED": "a full measurement per the protocol on the GPU",
}


def _none(status: str | None) -> str:
    return status if status is not None else "none"


def fix_comment(report: Report) -> str:
    """The comment written beside a changed status: where it came from and why (one line). Lowered: the reasons
    that hold it down; raised: what the evidence now holds."""
    if raises(report):
        supported = report.supported_status or ""
        comment = f"{RAISED_PREFIX}{_none(report.declared_status)}: {SUPPORTED_BECAUSE.get(supported, supported)}"
        if report.best_peak_from and supported == "CANDIDATE":
            comment += f" ({report.best_peak_from})"
        return " ".join(comment.split())
    reasons = report.reasons[:MAX_REASONS_IN_COMMENT]
    more = len(report.reasons) - len(reasons)
    comment = f"{COMMENT_PREFIX}{report.declared_status}: " + "; ".join(reasons)
    if more > 0:
        comment += f" (+{more} more)"
    return " ".join(comment.split())


def needs_fix(report: Report) -> bool:
    """The declared status claims more than the evidence supports (LS001)."""
    declared, supported = report.declared_status, report.supported_status
    return supported is not None and declared in RANK and RANK[declared] > RANK[supported]


def raises(report: Report) -> bool:
    """The evidence supports more than the declared status (or no status is declared): it can be raised (LS007)."""
    declared, supported = report.declared_status, report.supported_status
    if supported is None:
        return False
    return declared not in RANK or RANK[supported] > RANK[str(declared)]


def status_fix(report: Report) -> tuple[str, str] | None:
    """``(status, comment)`` to declare instead (the supported status, up or down), or None when the declared
    status is the supported one. An unreadable declared status (not a ladder word) is left to the schema check."""
    if report.supported_status is None or report.declared_status == report.supported_status:
        return None
    if report.declared_status is not None and report.declared_status not in RANK:
        return None
    if not (needs_fix(report) or raises(report)):
        return None
    return report.supported_status, fix_comment(report)


__all__ = ["COMMENT_PREFIX", "RAISED_PREFIX", "fix_comment", "needs_fix", "raises", "status_fix"]
