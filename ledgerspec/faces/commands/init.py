"""``ledgerspec init [--from INTAKE] [-o OUT] [--force]``: a ledger skeleton, every field UNKNOWN (no torch)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_OK, LedgerspecError
from ledgerspec.faces.arguments import add_force


def register(subparsers: Any) -> None:
    i = subparsers.add_parser("init", help="write a ledger skeleton with every field UNKNOWN")
    i.add_argument("--from", dest="from_intake", metavar="INTAKE", help="copy the sections of an intake")
    i.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    add_force(i, "overwrite OUT if it exists (even if it is read-only)")
    i.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    import os

    from ledgerspec.contract.document import load, require_header
    from ledgerspec.contract.skeleton import skeleton
    from ledgerspec.contract.writer import atomic_write, check_writable

    intake = require_header(load(args.from_intake), "init") if args.from_intake else None  # intake/v2: refused
    if intake is not None and intake.kind != "intake":
        raise LedgerspecError(
            f"--from expects an intake/v1 document, got {intake.get('ledgerspec').raw!r}",
            args.from_intake,
            *intake.position("/ledgerspec"),
            rule="init",
        )
    if args.output:
        if os.path.lexists(args.output) and not args.force:
            raise LedgerspecError("file exists", args.output, rule="init", hint="pass --force to overwrite")
        check_writable(args.output, force=args.force)
    text = skeleton(intake, args.output)
    if args.output:
        atomic_write(args.output, text, force=args.force)
    else:
        sys.stdout.write(text)
    return EXIT_OK
