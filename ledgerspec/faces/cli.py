"""The ``ledgerspec`` command line: argument parsing only; each command calls the typed core API."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ledgerspec import __version__
from ledgerspec.errors import EXIT_FINDINGS, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, LedgerspecError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--device-memory -5GB` is a (bad) value, not an unknown flag: read anything that starts with a
        # minus and a digit as a value, as Python 3.13's argparse does (3.11 takes only plain numbers)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> Any:  # one line, exit 2, no usage dump
        self.exit(EXIT_USAGE, f"ledgerspec: usage: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ledgerspec", description="Training Memory Ledger for LoRA/QLoRA fine-tuning.")
    p.add_argument("--version", action="version", version=f"ledgerspec {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    v = sub.add_parser("validate", help="check ledger/intake files: schema, rules, status ladder")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--format", choices=("text", "json", "sarif", "github"), default="text")
    v.add_argument("--fix", action="store_true", help="lower a declared status to the supported one, in place")
    v.add_argument("-v", "--verbose", action="store_true", help="show info findings and every status reason")
    v.set_defaults(run=_validate)

    s = sub.add_parser("schema", help="print the JSON Schema")
    s.add_argument("name", nargs="?", choices=("ledger", "intake", "defs"), default="ledger")
    s.set_defaults(run=_schema)

    i = sub.add_parser("init", help="write a ledger skeleton with every field UNKNOWN")
    i.add_argument("--from", dest="from_intake", metavar="INTAKE", help="copy the sections of an intake")
    i.add_argument("-o", "--output", metavar="OUT", help="write here instead of standard output")
    i.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    i.set_defaults(run=_init)

    for register in _EXTENSIONS:
        register(sub)
    return p


# Heavier commands (resolve, estimate, measure, report) add their parsers here; their modules import
# torch & co. only when run.
_EXTENSIONS: list[Callable[[Any], None]] = []


def _validate(args: argparse.Namespace) -> int:
    from ledgerspec.faces.validate_cmd import run_validate

    return run_validate(args.files, fmt=args.format, fix=args.fix, verbose=args.verbose, out=sys.stdout)


def _schema(args: argparse.Namespace) -> int:
    from ledgerspec.contract.schema import schema_text

    sys.stdout.write(schema_text(args.name))
    return EXIT_OK


def _init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ledgerspec.contract.document import load
    from ledgerspec.contract.skeleton import skeleton
    from ledgerspec.contract.writer import atomic_write

    intake = load(args.from_intake) if args.from_intake else None
    if intake is not None and intake.kind != "intake":
        raise LedgerspecError(
            f"--from expects an intake/v1 document, got {intake.plain.get('ledgerspec')!r}",
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


def main(argv: Sequence[str] | None = None) -> int:
    _load_extensions()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except LedgerspecError as exc:
        print(exc.format(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ledgerspec: interrupted; no file was changed", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_FINDINGS
    except Exception as exc:  # a bug in ledgerspec (or a library), not in the user's file
        if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
            raise
        print(internal_error_line(args.command, exc), file=sys.stderr)
        return EXIT_INTERNAL


#: set to 1 to see the traceback of an internal error instead of its one-line summary
DEBUG_ENV = "LEDGERSPEC_DEBUG"


def internal_error_line(command: str, exc: BaseException) -> str:
    """One line for an unexpected exception: says it is ledgerspec's fault, not the input's."""
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return (
        f"ledgerspec: internal-error: `ledgerspec {command}` failed unexpectedly ({what}) (hint: this is a bug "
        f"in ledgerspec, not a problem with your file: please report it; re-run with {DEBUG_ENV}=1 for the "
        "traceback)"
    )


#: command module -> the commands it registers (a module that fails to load answers for these)
_EXTENSION_COMMANDS = {
    "resolve_cmd": ("resolve",),
    "estimate_cmd": ("estimate",),
    "measure_cmd": ("measure", "triage"),
    "report_cmd": ("report",),
    "shard_cmd": ("shard",),
}


def _load_extensions() -> None:
    if _EXTENSIONS:
        return
    import importlib

    for name, commands in _EXTENSION_COMMANDS.items():
        try:
            module = importlib.import_module(f"ledgerspec.faces.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"ledgerspec.faces.{name}":
                _EXTENSIONS.append(_broken(commands, exc))
            continue
        except Exception as exc:  # a broken command module must not take validate (the pre-commit hook) down too
            _EXTENSIONS.append(_broken(commands, exc))
            continue
        _EXTENSIONS.append(module.register)


def _broken(commands: tuple[str, ...], exc: BaseException) -> Callable[[Any], None]:
    """Parsers for commands whose module failed to import: running one reports the failure as an internal error."""

    def fail(args: argparse.Namespace) -> int:
        if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
            raise exc
        print(internal_error_line(args.command, exc), file=sys.stderr)
        return EXIT_INTERNAL

    def register(sub: Any) -> None:
        for command in commands:
            p = sub.add_parser(command, help=f"(unavailable: {type(exc).__name__})", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(run=fail)

    return register


if __name__ == "__main__":
    sys.exit(main())
