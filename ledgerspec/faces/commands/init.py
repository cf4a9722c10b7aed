"""``ledgerspec init [--from FILE]... [-o OUT] [--force]``: a ledger skeleton, every field UNKNOWN (no torch).

``--from`` takes an ``intake/v1`` (its sections are copied in), or the configuration files ``ledgerspec import``
reads (an axolotl or LLaMA-Factory YAML, TrainingArguments/SFTConfig, adapter_config.json, config.json): they are
imported first, with the same findings, and the skeleton is made from that intake.
"""

from __future__ import annotations

import argparse
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, LedgerspecError
from ledgerspec.faces.arguments import add_force


def register(subparsers: Any) -> None:
    i = subparsers.add_parser("init", help="write a ledger skeleton with every field UNKNOWN")
    i.add_argument(
        "--from",
        dest="from_files",
        action="append",
        metavar="FILE",
        help="copy the sections of an intake, or import a tool's configuration (repeat for several files)",
    )
    i.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    add_force(i, "overwrite OUT if it exists (even if it is read-only)")
    i.add_argument("--gpu-count", type=int, metavar="N", help="with imported files: the number of GPUs (ranks)")
    i.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    import os

    from ledgerspec.contract.document import load, require_header
    from ledgerspec.contract.skeleton import skeleton
    from ledgerspec.contract.writer import check_writable

    files: list[str] = args.from_files or []
    intake = None
    imported = False  # from a tool's configuration (not an intake): the summary line says what the ledger supports
    if args.output:
        if os.path.lexists(args.output) and not os.path.isdir(args.output) and not args.force:  # a folder: below
            raise LedgerspecError("file exists", args.output, rule="init", hint="pass --force to overwrite")
        check_writable(args.output, force=args.force)
    if len(files) == 1 and _ledgerspec_document(files[0]):
        intake = require_header(load(files[0]), "init")  # intake/v2: refused
        if intake.kind != "intake":
            raise LedgerspecError(
                f"--from expects an intake/v1 document, got {intake.get('ledgerspec').raw!r}",
                files[0],
                *intake.position("/ledgerspec"),
                rule="init",
                hint="--from takes an intake or a tool's configuration (axolotl, LLaMA-Factory, TrainingArguments); "
                "a ledger needs no skeleton: edit it, or `ledgerspec validate -v` it",
            )
    elif files:
        imported = True
        from ledgerspec.faces.commands.imports import convert

        if args.gpu_count is not None and args.gpu_count < 1:
            raise LedgerspecError(f"--gpu-count must be at least 1, got {args.gpu_count}", rule="init")
        _, intake, findings, _ = convert(files, args, args.output, say_status=False)
    from ledgerspec.faces.commands.imports import write

    text = skeleton(intake, args.output)
    write(text, args.output, args.force)
    if imported:  # decided before the write: `-o` may name the file imported (`--force`)
        from ledgerspec.contract.document import from_text
        from ledgerspec.faces.commands.imports import summary

        # what the ledger written supports, not the intake it was made from; one validate refuses is written for
        # the user to fix, and the exit status says so (as import's does)
        if not summary(len(files), findings, from_text(text, args.output or "<init>"), "ledger"):
            return EXIT_FINDINGS
    return EXIT_OK


def _ledgerspec_document(path: str) -> bool:
    """Whether ``path`` is meant as a ledgerspec document: named ``*.intake.yaml`` / ``*.ledger.yaml``, or with a
    top-level ``ledgerspec:`` line. Such a file is read (and refused) as one; anything else goes to the importer,
    which says what is wrong with it."""
    import re

    if path.endswith((".intake.yaml", ".intake.yml", ".ledger.yaml", ".ledger.yml")):
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return False
    return re.search(rb"(?m)^ledgerspec\s*:", head) is not None
