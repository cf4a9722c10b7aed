"""``ledgerspec resolve FILE [-o OUT] [--check] [--dry-run] [--offline] [--trust-remote-code] [-v]``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, printable
from ledgerspec.faces.arguments import add_force
from ledgerspec.faces.status import add_keep_status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("resolve", help="fill exact figures by instantiating the model on the meta device")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-o", "--output", metavar="OUT", help="write the result here (required for an intake)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file would change")
    p.add_argument("--dry-run", action="store_true", help="write nothing; print the change as a unified diff")
    p.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code (auto_map)")
    p.add_argument("-v", "--verbose", action="store_true", help="report each figure and where time went")
    add_force(p)
    add_keep_status(p)
    p.set_defaults(run=run_resolve)


class _Progress:
    """One overwritten status line on a terminal; plain lines with -v; silence otherwise."""

    def __init__(self, verbose: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.verbose = verbose
        self.width = 0

    def __call__(self, message: str) -> None:
        if self.tty:
            text = f"ledgerspec: {message}..."
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)
        elif self.verbose:
            print(f"ledgerspec: {message}...", file=sys.stderr)

    def done(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def _one_shot_process() -> bool:
    """True when this process is the ``ledgerspec`` program itself (not a test runner or a notebook): the
    ``ledgerspec`` script, or ``python -m ledgerspec``, whose ``argv[0]`` is ``.../ledgerspec/__main__.py``. Any other
    package's ``__main__.py`` (``python -m pytest``: ``.../pytest/__main__.py``) is not: a later estimate of a QLoRA
    ledger in the same process needs the bitsandbytes that a one-shot resolve hides."""
    import os

    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return os.path.basename(argv0) == "ledgerspec" or argv0.endswith(os.path.join("ledgerspec", "__main__.py"))


def run_resolve(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load_for

    started = time.perf_counter()
    doc = load_for(args.file, "resolve")  # ledger/v2 is refused as validate refuses it
    intake = doc.kind == "intake"
    if intake and not args.output and not (args.check or args.dry_run):
        line, col = doc.position("/ledgerspec")
        raise LedgerspecError(
            "an intake is resolved into a new ledger: give -o OUT",
            doc.path,
            line,
            col,
            rule="resolve",
            hint=f"ledgerspec resolve {args.file} -o ledger.yaml",
            exit_code=EXIT_USAGE,
        )
    from ledgerspec.faces.preflight import import_stack_quietly, preflight

    preflight(doc, "resolve")  # validate's input checks, before torch is imported
    import_stack_quietly()
    from ledgerspec.contract.writer import check_writable
    from ledgerspec.derivations.resolve.resolver import resolve

    if not (args.check or args.dry_run):
        check_writable(args.output or args.file, force=args.force)  # before the model is built
    progress = _Progress(args.verbose)
    try:
        result = resolve(
            doc,
            offline=args.offline,
            trust_remote_code=args.trust_remote_code,
            progress=progress,
            one_shot_process=_one_shot_process(),
        )
    finally:
        progress.done()
    from ledgerspec.contract.writer import render_to, save
    from ledgerspec.faces.status import settle_for

    target = args.output or args.file
    _, status_change = settle_for(result.doc, args)  # the status the resolved figures support
    text = render_to(result.doc, target)  # -o elsewhere: a relative identity.config_path still names the config
    if args.verbose:
        _report(result, started)
    for ch in result.skipped:
        print(printable(f"{args.file}: kept {ch.pointer}: {ch.skipped}"), file=sys.stderr)
    for note in result.notes:
        print(printable(f"{args.file}: note: {note}"), file=sys.stderr)
    if args.dry_run:
        import difflib

        diff = difflib.unified_diff(
            result.original.splitlines(keepends=True), text.splitlines(keepends=True), fromfile=args.file, tofile=target
        )
        sys.stdout.writelines(printable(line.rstrip("\r\n")) + "\n" for line in diff)
        return EXIT_OK
    if args.check:
        if result.changed or status_change:
            how = (
                f"`ledgerspec resolve {args.file} -o LEDGER` writes the ledger"
                if intake
                else f"run `ledgerspec resolve {args.file}` to update"
            )
            print(printable(f"{args.file}: would change ({len(result.applied)} fields); {how}"), file=sys.stderr)
            return EXIT_FINDINGS
        return EXIT_OK
    if result.changed or args.output or status_change:
        save(result.doc, target, force=args.force)
        print(printable(f"{target}: {len(result.applied)} fields resolved"), file=sys.stderr)
        if status_change:
            print(printable(status_change), file=sys.stderr)
    else:
        print(printable(f"{target}: up to date"), file=sys.stderr)
    return EXIT_OK


def _report(result: Any, started: float) -> None:
    from ledgerspec.contract.units import format_size

    f = result.figures
    out = sys.stderr
    print(f"  architecture          {result.census.architecture}", file=out)
    print(f"  total parameters      {f.total_parameters:,}", file=out)
    print(f"  trainable parameters  {f.trainable_parameters:,}", file=out)
    for label, n in (
        ("frozen base", f.frozen_base_bytes),
        ("adapter", f.adapter_bytes),
        ("gradients", f.gradient_bytes),
    ):
        print(f"  {label:<22}{n:,} B ({format_size(n)})", file=out)
    if f.optimizer is not None:
        print(f"  {'optimizer':<22}{f.optimizer.device:,} B ({format_size(f.optimizer.device)})", file=out)
    total = time.perf_counter() - started
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    print(f"  time: {total:.2f}s in resolve ({parts})", file=out)
