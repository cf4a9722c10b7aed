"""Ctrl-C is remembered for the rest of a command: a library that swallows the KeyboardInterrupt it raises (a bare
``except``, as around optional imports) cannot make the command write the ledger afterwards or exit 0.

Each case runs in a fresh Python started as a terminal starts a command (SIGINT unblocked, its default action): a
test run started in the background by a non-interactive shell (``.ci/run &``) has SIGINT ignored, every process it
starts inherits that, and Python then installs no handler at all (the Ctrl-C test of ``measure`` failed so in every
full run started that way: the command never saw the signal, ran to the end and wrote the ledger, as it should).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import REPO_ROOT
from tests.support.signals import as_a_terminal_starts_it

SWALLOW = textwrap.dedent(
    """
    import os, signal, sys, time
    from ledgerspec.contract.writer import atomic_write, interrupted
    from ledgerspec.faces import cli

    def swallowed_ctrl_c():
        try:  # what a library's bare except does with the KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException:
            pass
    """
)


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SWALLOW + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        preexec_fn=as_a_terminal_starts_it,
    )


def test_a_swallowed_ctrl_c_still_stops_every_later_write(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.yaml"
    path.write_text("old\n")
    done = _run(
        """
        with cli._sigterm_unwinds():
            swallowed_ctrl_c()
            assert interrupted()
            try:
                atomic_write(sys.argv[1], "new\\n")
            except KeyboardInterrupt:
                print("refused")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was
        """,
        str(path),
    )
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["x.ledger.yaml"]


def test_the_command_exits_130_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.yaml"
    path.write_text("old\n")
    done = _run(
        """
        def run(_args):
            swallowed_ctrl_c()
            try:
                atomic_write(sys.argv[1], "new\\n")
            except BaseException:  # swallowed again: the command still ends as interrupted
                pass
            return 0

        parser = cli.build_parser()
        args = parser.parse_args(["schema"])
        args.run = run
        type(parser).parse_args = lambda self, argv=None: args
        sys.exit(cli.main(["schema"]))
        """,
        str(path),
    )
    assert done.returncode == 130, done.stderr
    assert "interrupted; no file was changed" in done.stderr
    assert path.read_text() == "old\n"


def test_the_next_command_in_the_same_process_writes_again(tmp_path: Path) -> None:
    done = _run(
        """
        with cli._sigterm_unwinds():
            swallowed_ctrl_c()
        with cli._sigterm_unwinds():  # a new command forgets the last one's interrupt
            assert not interrupted()
            atomic_write(sys.argv[1], "new\\n")
        """,
        str(tmp_path / "y.ledger.yaml"),
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "y.ledger.yaml").read_text() == "new\n"
