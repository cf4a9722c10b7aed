"""``ledgerspec report FILE [--html OUT | --beside OTHER]``: the ledger as a table and a stacked bar, in the terminal or
as HTML, or two ledgers' components side by side.

Exit codes: 0 when the report was produced (the validation result is part of the report; ``validate``
is the gate), 2 when the file cannot be read or OUT cannot be written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_OK, LedgerspecError, printable
from ledgerspec.faces.arguments import add_force


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="show a ledger as a colour-coded table and a stacked bar chart")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--html", metavar="OUT", help="write one self-contained HTML page (inline CSS and SVG) to OUT")
    p.add_argument("--plain", action="store_true", help="plain text even when rich is installed")
    add_force(p, "with --html: write OUT even if it is read-only")
    p.add_argument("-v", "--verbose", action="store_true", help="list every reason that holds the status down")
    p.add_argument(
        "--beside",
        metavar="OTHER",
        help="show OTHER's components beside FILE's (plain text): a LoRA and a full fine-tuning ledger of one model",
    )
    p.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import gather

    data = gather(load(args.file))
    if getattr(args, "beside", None):
        if args.html:
            raise LedgerspecError(
                "--beside shows two ledgers as text; --html draws one",
                args.file,
                rule="report",
                hint="drop --html, or report each ledger to its own page",
            )
        from ledgerspec.faces.report.beside import render_beside

        render_beside(data, gather(load(args.beside)), sys.stdout)
        return EXIT_OK
    if args.html:
        import os

        from ledgerspec.contract.writer import atomic_write, check_writable

        if os.path.realpath(args.html) == os.path.realpath(args.file):
            raise LedgerspecError(
                "--html OUT is the ledger itself; refusing to overwrite it",
                args.html,
                rule="report",
                hint="write the HTML page to another file",
            )
        from ledgerspec.faces.report.html import render_html

        check_writable(args.html, force=args.force)
        atomic_write(args.html, render_html(data), force=args.force)
        verdict = data.verdict.sentence() if data.verdict is not None else "UNKNOWN"
        print(printable(f"{args.file}: {verdict}"), file=sys.stderr)
        print(
            printable(f"{args.file}: status {data.supported_status}; HTML report written to {args.html}"),
            file=sys.stderr,
        )
        return EXIT_OK
    from ledgerspec.faces.report.terminal import render_terminal

    render_terminal(data, sys.stdout, plain=args.plain, verbose=args.verbose)
    return EXIT_OK
