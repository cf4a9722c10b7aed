"""The declared status follows the evidence: after a command changed a ledger, validate it and set ``status`` to
what the checks say it should be, up or down (:func:`ledgerspec.checks.fix.status_fix`), unless the user keeps
their own (``--keep-status``). Every command that writes a ledger calls :func:`settle` right before it saves
(:func:`save_settled`: the save and what it says)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.checks.fix import status_fix
from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import set_status
from ledgerspec.errors import printable

KEEP_STATUS_HELP = (
    "keep the declared status as written (by default it is set to what the evidence supports, up or down, with "
    "the reason in a comment beside it)"
)


def add_keep_status(parser: Any) -> None:
    """The ``--keep-status`` flag of a command that writes a ledger."""
    parser.add_argument("--keep-status", action="store_true", help=KEEP_STATUS_HELP)


def settle(doc: Document, keep: bool = False) -> Report:
    """Validate ``doc`` and (unless ``keep``) set its declared status as :func:`status_fix` says; the report of the
    document as it is afterwards (its ``declared_status`` is the new one)."""
    report = validate(doc)
    fix = None if keep else status_fix(report)
    if fix is None:
        return report
    set_status(doc, *fix)
    return validate(doc)


def change_line(path: str, before: str | None, after: str | None) -> str | None:
    """``FILE: status raised from CALCULATED to CANDIDATE`` (None when the status did not change)."""
    if before == after or after is None:
        return None
    if before in RANK and RANK[str(before)] > RANK[after]:
        return f"{path}: status lowered from {before} to {after}"
    return f"{path}: status raised from {before or 'none declared'} to {after}"


def settle_for(doc: Document, args: argparse.Namespace) -> tuple[Report, str | None]:
    """:func:`settle` as a command's ``--keep-status`` says, with the line that reports the change (or None)."""
    before = doc.get("status").text()
    report = settle(doc, keep=bool(getattr(args, "keep_status", False)))
    return report, change_line(getattr(args, "output", None) or doc.path, before, report.declared_status)


def save_settled(
    doc: Document,
    target: str,
    force: bool,
    status_change: str | None,
    written: str | None = None,
    unchanged: str | None = None,
) -> bool:
    """Save ``doc`` (settled by :func:`settle_for`, whose line is ``status_change``) to ``target`` and say so on
    stderr: ``TARGET: {written}`` when the save changed the file, ``TARGET: {unchanged}`` when the file already held
    it (None: nothing to say), then the status line. Whether the file was written."""
    from ledgerspec.contract.writer import save

    changed = save(doc, target, force=force)
    told = written if changed else unchanged
    if told:
        print(printable(f"{target}: {told}"), file=sys.stderr)
    if status_change:
        print(printable(status_change), file=sys.stderr)
    return changed


__all__ = ["KEEP_STATUS_HELP", "add_keep_status", "change_line", "save_settled", "settle", "settle_for"]
