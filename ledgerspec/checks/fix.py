"""``validate --fix``: write the supported status back, with the reasons as a comment beside it."""

from __future__ import annotations

from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report
from ledgerspec.contract.document import Document

MAX_REASONS_IN_COMMENT = 3


def fix_status(doc: Document, report: Report) -> bool:
    """Lower ``status`` in ``doc.data`` to the supported status. True when the tree changed."""
    declared = report.declared_status
    supported = report.supported_status
    if supported is None or declared not in RANK or RANK[declared] <= RANK[supported]:
        return False
    data = doc.data
    data["status"] = supported
    reasons = report.reasons[:MAX_REASONS_IN_COMMENT]
    more = len(report.reasons) - len(reasons)
    comment = f"ledgerspec: lowered from {declared}: " + "; ".join(reasons)
    if more > 0:
        comment += f" (+{more} more)"
    data.yaml_add_eol_comment(comment.replace("\n", " "), "status")
    doc.invalidate()
    doc.plain["status"] = supported
    return True
