"""Processes a test starts as a terminal starts a command."""

from __future__ import annotations

import signal


def as_a_terminal_starts_it() -> None:
    """``preexec_fn`` of a process a Ctrl-C test interrupts: SIGINT unblocked and at its default action in the child,
    whatever the test process holds (a test run started in the background by a non-interactive shell ignores
    SIGINT, and a child inherits that: Python then installs no handler and Ctrl-C never reaches the command)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
