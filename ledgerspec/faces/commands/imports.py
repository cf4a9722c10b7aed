"""``ledgerspec import FILE... [-o OUT]``: an ``intake/v1`` from an axolotl or LLaMA-Factory YAML, or from
``TrainingArguments``/``SFTConfig`` + ``adapter_config.json`` + ``config.json`` (no torch, no network)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, LedgerspecError
from ledgerspec.faces.arguments import add_force


def register(subparsers: Any) -> None:
    from ledgerspec.contract.imports.source import FORMATS

    p = subparsers.add_parser(
        "import",
        help="convert an axolotl / LLaMA-Factory / TrainingArguments / PEFT configuration into an intake",
        description="Read existing training configurations and write one intake/v1: each value with a comment "
        "naming the setting it came from, the tools' defaults as ASSUMPTION, findings for what is not carried over.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="configuration files, merged (see docs: From your setup)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the intake here instead of standard output")
    add_force(p, "overwrite OUT if it exists (even if it is read-only)")
    p.add_argument("--format", choices=sorted(FORMATS), help="read every FILE as this format (default: recognised)")
    p.add_argument("--gpu-count", type=_positive, metavar="N", help="the number of GPUs (ranks) the launcher starts")
    p.add_argument(
        "--configs", action="append", metavar="DIR", help="a folder of model configs laid out as examples/configs"
    )
    p.set_defaults(run=run_import)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def run_import(args: argparse.Namespace) -> int:
    if args.output:
        from ledgerspec.contract.writer import check_writable

        _refuse_existing(args.output, args.force)
        check_writable(args.output, force=args.force)
    text, _, _, valid = convert(args.files, args, args.output)
    write(text, args.output, args.force)
    # an intake that validate refuses (micro_batch_size: 0, an unknown optimizer) is written for the user to fix,
    # and the exit status says so, as the command-line contract has it for an invalid document
    return EXIT_OK if valid else EXIT_FINDINGS


def convert(
    files: list[str], args: argparse.Namespace, output: str | None, say_status: bool = True
) -> tuple[str, Any, int, bool]:
    """Import ``files``; print the findings and (``say_status``) the status the intake supports to standard error.
    The intake's text, its document, the number of findings, and whether ``validate`` finds no error in it (True
    when the status is left to the caller: ``init --from`` says what the ledger it writes supports, :func:`summary`)."""
    from pathlib import Path

    from ledgerspec.contract.document import from_text
    from ledgerspec.contract.imports import import_files

    dirs = [Path(d) for d in args.configs] if getattr(args, "configs", None) else None
    result = import_files(
        files,
        fmt=getattr(args, "format", None),
        gpu_count=getattr(args, "gpu_count", None),
        output=output,
        config_dirs=dirs,
    )
    for f in result.findings:
        print(f.format(), file=sys.stderr)
    doc = from_text(result.text, output or "<import>")
    valid = summary(len(files), len(result.findings), doc, "intake") if say_status else True
    return result.text, doc, len(result.findings), valid


def summary(files: int, findings: int, doc: Any, written: str) -> bool:
    """The import's last line: what was imported and the status the document written (the ``intake``, or the
    ``ledger`` ``init --from`` makes of it) supports. Whether ``validate`` finds no error in that document."""
    from ledgerspec.checks.findings import ERROR
    from ledgerspec.checks.validate import validate

    report = validate(doc)
    held = f" ({len(report.reasons)} reason(s): `ledgerspec validate -v`)" if report.reasons else ""
    errors = sum(1 for f in report.findings if f.severity == ERROR)
    invalid = f", INVALID ({errors} error(s): `ledgerspec validate` lists them)" if errors else ""
    print(
        f"ledgerspec: imported {files} file(s): {findings} finding(s), recorded in x-import; "
        f"the {written} supports {report.supported_status}{held}{invalid}",
        file=sys.stderr,
    )
    return report.ok


def _refuse_existing(output: str, force: bool) -> None:
    import os

    if os.path.lexists(output) and not os.path.isdir(output) and not force:  # a folder: the writer refuses it
        raise LedgerspecError("file exists", output, rule="import", hint="pass --force to overwrite")


def write(text: str, output: str | None, force: bool) -> None:
    """A YAML document to ``output`` byte for byte, or to the terminal with every control character a copied
    comment may carry (a tab, an escape sequence) shown as an escape (:class:`ledgerspec.errors.PrintableLines`)."""
    from ledgerspec.contract.writer import atomic_write
    from ledgerspec.errors import PrintableLines

    if output:
        _refuse_existing(output, force)
        atomic_write(output, text, force=force)
    else:
        PrintableLines(sys.stdout).write(text)
