"""``ledgerspec schema [ledger|intake|defs]``: print the JSON Schema (no torch, no network)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_OK


def register(subparsers: Any) -> None:
    s = subparsers.add_parser("schema", help="print the JSON Schema")
    s.add_argument("name", nargs="?", choices=("ledger", "intake", "defs"), default="ledger")
    s.set_defaults(run=run_schema)


def run_schema(args: argparse.Namespace) -> int:
    from ledgerspec.contract.schema import schema_text

    sys.stdout.write(schema_text(args.name))
    return EXIT_OK
