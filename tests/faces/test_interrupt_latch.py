"""Ctrl-C is remembered for the rest of a command: a library that swallows the KeyboardInterrupt it raises (a bare
``except``, as around optional imports) cannot make the command write the ledger afterwards or exit 0.

Under CI's load, ``tests/derivations/measure/test_measure.py``'s Ctrl-C two seconds into ``measure`` once let it run
to the end and write the ledger; these tests swallow the interrupt on purpose, in this process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ledgerspec.contract.writer import atomic_write, interrupted
from ledgerspec.faces import cli


def _swallowed_ctrl_c() -> None:
    try:  # what a library's bare except does with the KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    except BaseException:
        pass


def test_a_swallowed_ctrl_c_still_stops_every_later_write(tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.yaml"
    path.write_text("old\n")
    with cli._sigterm_unwinds():
        _swallowed_ctrl_c()
        assert interrupted()
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, "new\n")
    assert path.read_text() == "old\n" and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was


def test_the_command_exits_130_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.ledger.yaml"
    path.write_text("old\n")

    def run(_args: object) -> int:
        _swallowed_ctrl_c()
        try:
            atomic_write(path, "new\n")
        except BaseException:  # swallowed again: the command still ends as interrupted
            pass
        return 0

    parser = cli.build_parser()
    args = parser.parse_args(["schema"])
    monkeypatch.setattr(args, "run", run)
    monkeypatch.setattr(cli.build_parser().__class__, "parse_args", lambda self, argv=None: args)
    assert cli.main(["schema"]) == 130
    assert "interrupted; no file was changed" in capsys.readouterr().err
    assert path.read_text() == "old\n"


def test_the_next_command_in_the_same_process_writes_again(tmp_path: Path) -> None:
    with cli._sigterm_unwinds():
        _swallowed_ctrl_c()
    with cli._sigterm_unwinds():  # a new command forgets the last one's interrupt
        assert not interrupted()
        atomic_write(tmp_path / "y.ledger.yaml", "new\n")
    assert (tmp_path / "y.ledger.yaml").read_text() == "new\n"
