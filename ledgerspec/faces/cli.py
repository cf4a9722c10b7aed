"""The ``ledgerspec`` command line: the parser and the error boundary. Each subcommand is a module of
:mod:`ledgerspec.faces.commands` with ``register(subparsers)``; the work is done by the typed core API."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_INTERNAL, EXIT_USAGE, LedgerspecError, described, printable
from ledgerspec.version import __version__

#: command module (``ledgerspec.faces.commands.NAME``) -> the subcommands it registers, in ``--help`` order
COMMANDS: dict[str, tuple[str, ...]] = {
    "validate": ("validate",),
    "schema": ("schema",),
    "init": ("init",),
    "imports": ("import",),
    "resolve": ("resolve",),
    "estimate": ("estimate",),
    "measure": ("measure", "triage"),
    "report": ("report",),
    "shard": ("shard",),
}
#: set to 1 to see the traceback of an internal error instead of its one-line summary
DEBUG_ENV = "LEDGERSPEC_DEBUG"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--device-memory -5GB` is a (bad) value, not an unknown flag: read anything that starts with a
        # minus and a digit as a value, as Python 3.13's argparse does (3.11 takes only plain numbers)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._seen = list(sys.argv[1:] if args is None else args)  # for :meth:`_took_the_file`
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:  # one line, exit 2, no usage dump; a bad argument shown escaped
        took = self._took_the_file(message)
        self.exit(EXIT_USAGE, printable(f"ledgerspec: usage: {message}{took} (see `{self.prog} --help`)") + "\n")

    def _took_the_file(self, message: str) -> str:
        """Where FILE is missing because a flag with an optional value (``--devices [CATALOGUE]``) took it: which
        flag took which word, and how to write it."""
        if not message.endswith("required: FILE"):
            return ""
        seen = [str(a) for a in getattr(self, "_seen", [])]
        for action in self._actions:
            if action.nargs != "?" or not action.option_strings:
                continue
            for i, word in enumerate(seen[:-1]):
                if word in action.option_strings and not seen[i + 1].startswith("-"):
                    flag, value = word, seen[i + 1]
                    meta = action.metavar or "VALUE"
                    return (
                        f" ({flag} took {value!r} as its {meta}; if it is the FILE, write it before {flag}: "
                        f"`{self.prog} {value} {flag} ...`, or {flag}={meta})"
                    )
        return ""


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: every command module's ``register`` (a module that fails to import gets stubs)."""
    p = _Parser(prog="ledgerspec", description="Training Memory Ledger for LoRA/QLoRA fine-tuning.")
    p.add_argument("--version", action="version", version=f"ledgerspec {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for register in _registrars():
        register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    _never_unencodable()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _sigterm_unwinds():
            code: int = args.run(args)
        from ledgerspec.contract.writer import interrupted

        if interrupted():  # interrupted, and a library swallowed it: nothing was written after it (the writer)
            raise KeyboardInterrupt
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
        print(printable(internal_error_line(args.command, exc)), file=sys.stderr)
        return EXIT_INTERNAL


def _never_unencodable() -> None:
    """Output is valid text whatever it holds: where standard output or error would raise on a character its
    encoding lacks (``strict``), or pass a file name's undecodable bytes through raw (``surrogateescape``, the C
    locale), write a backslash escape instead. The reporters escape user strings themselves; this is the net."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) in ("strict", "surrogateescape"):
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream already written to in a way that cannot change
                pass


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C: ``finally`` blocks run, so a write in progress removes its temp file (the file
    itself is old or new, never partial). Only in the main thread (where signal handlers can be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    from ledgerspec.contract.writer import note_interrupt

    def interrupt(_signum: int, _frame: Any) -> None:
        # latched first: a library that catches the KeyboardInterrupt (a bare except, as around optional imports)
        # cannot make the command forget it; the writer refuses every later write and main() reports the interrupt
        note_interrupt()
        raise KeyboardInterrupt

    note_interrupt(False)

    previous = signal.signal(signal.SIGTERM, terminate)
    previous_int = signal.getsignal(signal.SIGINT)
    latch = previous_int not in (signal.SIG_IGN, None)  # not where Ctrl-C is ignored (a background job)
    if latch:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if latch:
            signal.signal(signal.SIGINT, previous_int)


def internal_error_line(command: str, exc: BaseException) -> str:
    """One line for an unexpected exception: says it is ledgerspec's fault, not the input's."""
    what = described(exc, 200)
    return (
        f"ledgerspec: internal-error: `ledgerspec {command}` failed unexpectedly ({what}) (hint: this is a bug "
        f"in ledgerspec, not a problem with your file: please report it; re-run with {DEBUG_ENV}=1 for the "
        "traceback)"
    )


def _registrars() -> list[Callable[[Any], None]]:
    import importlib

    out: list[Callable[[Any], None]] = []
    for name, commands in COMMANDS.items():
        try:
            module = importlib.import_module(f"ledgerspec.faces.commands.{name}")
        except Exception as exc:  # a broken command module must not take validate (the pre-commit hook) down too
            out.append(_broken(commands, exc))
            continue
        out.append(module.register)
    return out


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
