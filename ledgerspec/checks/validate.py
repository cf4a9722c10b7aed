"""Validate a document: header, schema, the rule catalogue, and the status ladder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ledgerspec.checks.catalogue import all_rules
from ledgerspec.checks.context import Context
from ledgerspec.checks.findings import ERROR, SEVERITY_ORDER, Finding, Hit
from ledgerspec.checks.ladder import StatusResult, supported_status
from ledgerspec.checks.schema_check import schema_hits
from ledgerspec.checks.verdict import Verdict, verdict
from ledgerspec.contract.document import Document, header_problem


@dataclass
class Report:
    """The outcome of validating one document (the JSON report's ``files[]`` entry)."""

    path: str
    kind: str | None
    declared_status: str | None
    supported_status: str | None
    reasons: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    intake_complete: bool | None = None
    best_peak: int | None = None
    best_peak_from: str | None = None
    #: FITS / DOES NOT FIT / UNKNOWN on the target device (:func:`ledgerspec.checks.verdict.verdict`)
    verdict: Verdict | None = None

    @property
    def ok(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "ok": self.ok,
            "declared_status": self.declared_status,
            "supported_status": self.supported_status,
            "reasons": list(self.reasons),
            "findings": [f.to_json() for f in self.findings],
            "intake_complete": self.intake_complete,
            "verdict": self.verdict.to_json() if self.verdict is not None else None,
        }  # intake_complete and verdict: additions to the spec's keys


def _finding(doc: Document, rule: str, severity: str, hit: Hit) -> Finding:
    line, col = doc.position(hit.pointer)
    return Finding(rule, hit.severity or severity, hit.pointer, hit.message, line, col)


def validate(doc: Document) -> Report:
    """Check ``doc`` against the schema and every rule; compute its supported status."""
    declared = doc.get("status").text() if doc.get("status").present else None
    header = header_problem(doc)
    if header:
        line, col = doc.position("/ledgerspec")
        return Report(doc.path, None, declared, None, [], [Finding("header", ERROR, "/ledgerspec", header, line, col)])
    findings = [_finding(doc, "schema", ERROR, h) for h in schema_hits(doc)]
    status: StatusResult = supported_status(doc)
    ctx = Context(doc, status)
    for r in all_rules():
        for hit in r.check(ctx):
            findings.append(_finding(doc, r.id, r.severity, hit))
    findings.sort(key=lambda f: (f.line, f.column, SEVERITY_ORDER[f.severity], f.rule))
    return Report(
        doc.path,
        doc.kind,
        declared,
        status.status,
        status.reasons,
        findings,
        status.intake_complete,
        status.best_peak,
        status.best_peak_from,
        verdict(doc, status),
    )
