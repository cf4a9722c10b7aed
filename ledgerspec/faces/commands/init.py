"""``ledgerspec init [--from INTAKE] [-o OUT] [--force]``: a ledger skeleton, every field UNKNOWN (no torch)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_OK, LedgerspecError


def register(subparsers: Any) -> None:
    i = subparsers.add_parser("init", help="write a ledger skeleton with every field UNKNOWN")
    i.add_argument("--from", dest="from_intake", metavar="INTAKE", help="copy the sections of an intake")
    i.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    i.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    i.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ledgerspec.contract.document import load
    from ledgerspec.contract.skeleton import skeleton
    from ledgerspec.contract.writer import atomic_write

    intake = load(args.from_intake) if args.from_intake else None
    if intake is not None and intake.kind != "intake":
        raise LedgerspecError(
            f"--from expects an intake/v1 document, got {intake.get('ledgerspec').raw!r}",
            args.from_intake,
            *intake.position("/ledgerspec"),
            rule="init",
        )
    text = skeleton(intake, args.output)
    if args.output:
        if Path(args.output).exists() and not args.force:
            raise LedgerspecError("file exists", args.output, rule="init", hint="pass --force to overwrite")
        atomic_write(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_OK
