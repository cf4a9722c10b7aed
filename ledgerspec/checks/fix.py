"""``validate --fix``: write the supported status back, with the reasons as a comment beside it.

The edit is made on the text, on the one line that holds ``status:``, so every other byte of the
file (comments, order, quoting, blank lines, line endings) stays as it was. Only when the status is
not a one-line scalar of a block mapping (a flow-style document, say) does it fall back to
re-rendering the round-trip tree.
"""

from __future__ import annotations

import re

from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report
from ledgerspec.contract.document import Document

MAX_REASONS_IN_COMMENT = 3
COMMENT_PREFIX = "ledgerspec: lowered from "

# the scalar after `status:` and what follows it on the line: a quoted or plain token, then an
# optional comment
_VALUE_RE = re.compile(r"""(?P<token>"[^"\n]*"|'[^'\n]*'|[^#\n]*?)(?P<gap>[ \t]*)(?P<comment>\#.*)?$""")


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


def fixed_text(doc: Document, report: Report) -> str | None:
    """The document text with ``status`` lowered to the supported status; None when nothing changes."""
    if not needs_fix(report) or report.supported_status is None:
        return None
    edited = _edit_status_line(doc, report.supported_status, fix_comment(report))
    if edited is not None:
        return edited
    return _rerender(doc, report)


def _edit_status_line(doc: Document, status: str, comment: str) -> str | None:
    try:
        line, col = doc.data.lc.value("status")
    except (AttributeError, KeyError, TypeError):
        return None
    lines = doc.text.splitlines(keepends=True)
    if line >= len(lines):
        return None
    raw = lines[line]
    body = raw.rstrip("\r\n")
    ending = raw[len(body) :]
    m = _VALUE_RE.match(body, col)
    if m is None:
        return None
    token = m.group("token")
    if token.strip("\"' ") != str(doc.plain.get("status")):
        return None  # not a one-line scalar we understand (multi-line, flow style, ...)
    quote = token[0] if token[:1] in ("'", '"') else ""
    old = (m.group("comment") or "")[1:].strip()
    if old and not old.startswith(COMMENT_PREFIX):
        comment += f" | was: {old}"
    lines[line] = f"{body[:col]}{quote}{status}{quote}  # {comment}{ending}"
    return "".join(lines)


def _rerender(doc: Document, report: Report) -> str:
    from ledgerspec.contract.writer import render

    data = doc.data
    data["status"] = report.supported_status
    data.yaml_add_eol_comment(fix_comment(report), "status")
    return render(data, doc.text)
