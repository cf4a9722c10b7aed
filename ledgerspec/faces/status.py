"""The declared status follows the evidence: after a command changed a ledger, validate it and set ``status`` to
what the checks say it should be (:func:`ledgerspec.checks.fix.status_fix`), unless the user keeps their own."""

from __future__ import annotations

from ledgerspec.checks.fix import status_fix
from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import set_status


def settle(doc: Document, keep: bool = False) -> Report:
    """Validate ``doc`` and (unless ``keep``) set its declared status as :func:`status_fix` says; the report of the
    document as it is afterwards (its ``declared_status`` is the new one)."""
    report = validate(doc)
    fix = None if keep else status_fix(report)
    if fix is None:
        return report
    set_status(doc, *fix)
    return validate(doc)


__all__ = ["settle"]
