"""``ledgerspec validate FILE...``: load each file, validate, optionally fix the status, report.

Imports neither torch nor anything heavy: it is the pre-commit hook's command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from ledgerspec.checks.findings import ERROR, Finding
from ledgerspec.checks.validate import Report, validate
from ledgerspec.contract.document import Document, from_text, load
from ledgerspec.contract.loader import read_stream
from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError
from ledgerspec.faces.arguments import add_force
from ledgerspec.faces.reporters import REPORTERS


def register(subparsers: Any) -> None:
    v = subparsers.add_parser("validate", help="check ledger/intake files: schema, rules, status ladder")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--format", choices=("text", "json", "sarif", "github"), default="text")
    v.add_argument(
        "--fix",
        action="store_true",
        help="set the declared status to the one the evidence supports (up or down), in place, with the reason in "
        "a comment",
    )
    add_force(v, "with --fix: write FILE even if it is read-only")
    v.add_argument("-v", "--verbose", action="store_true", help="show info findings and every status reason")
    v.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    return run_validate(
        args.files, fmt=args.format, fix=args.fix, verbose=args.verbose, out=sys.stdout, force=args.force
    )


def _load(path: str) -> Document:
    if path == "-":
        return from_text(read_stream(sys.stdin.buffer, "<stdin>"), "<stdin>")
    return load(path)


def _finding(exc: LedgerspecError) -> Finding:
    message = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    return Finding(exc.rule, ERROR, "", message, exc.line or 1, exc.column or 1)


def run_validate(
    paths: list[str],
    fmt: str = "text",
    fix: bool = False,
    verbose: bool = False,
    out: TextIO = sys.stdout,
    force: bool = False,
) -> int:
    """Validate every file (one that cannot be read or written never stops the others) and report them all."""
    reports: list[Report] = []
    code = EXIT_OK
    for path in paths:
        try:
            doc = _load(path)
        except LedgerspecError as exc:
            code = max(code, exc.exit_code)
            reports.append(Report(exc.path or path, None, None, None, [], [_finding(exc)]))
            continue
        report = validate(doc)
        if fix and path != "-":
            try:
                report = _fix(doc, report, path, force)
            except LedgerspecError as exc:  # this file could not be written: its findings still count, and the
                code = max(code, exc.exit_code)  # files after it are still checked and fixed
                report.findings.append(_finding(exc))
        reports.append(report)
        if not report.ok:
            code = max(code, EXIT_FINDINGS)
    REPORTERS[fmt](reports, out, verbose)
    return code


def _fix(doc: Document, report: Report, path: str, force: bool = False) -> Report:
    """Set the declared status the evidence supports, in place (the one save path: atomic, BOM kept); the report
    of the new file."""
    from ledgerspec.contract.writer import save
    from ledgerspec.errors import printable
    from ledgerspec.faces.status import change_line, settle

    fixed = settle(doc)
    line = change_line(path, report.declared_status, fixed.declared_status)
    if line is None:
        return report
    save(doc, path, force=force)
    fixed = validate(load(path))
    print(printable(line), file=sys.stderr)
    return fixed


__all__ = ["EXIT_USAGE", "run_validate"]
