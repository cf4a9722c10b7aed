"""The forked workers of a sweep or a search: they return each item's result, and their signals are their own.

Run in a fresh interpreter each (as a command forks them: before anything is traced in its process), with the
handlers a command installs (``faces.cli``: SIGTERM raising ``SystemExit``)."""

from __future__ import annotations

from tests.support import python_json

_COMMAND_HANDLERS = """
import json, multiprocessing, signal
from ledgerspec.derivations.estimate.forked import forked_map

def unwind(signum, frame):
    raise SystemExit(128 + signum)

signal.signal(signal.SIGTERM, unwind)
signal.signal(signal.SIGINT, unwind)
"""


def test_each_item_is_mapped_in_order_and_one_that_raises_is_none() -> None:
    got = python_json(
        _COMMAND_HANDLERS
        + """
def item(i):
    if i == 2:
        raise ValueError("the caller runs it again")
    return i * i

print(json.dumps(forked_map(item, 5, 2)))
"""
    )
    assert got == [0, 1, None, 9, 16]


def test_a_worker_dies_on_sigterm_and_leaves_ctrl_c_to_the_command() -> None:
    # pool.terminate() ends its workers with SIGTERM: one that unwinds instead (the command's handler, inherited by
    # the fork) can block on the pool's queue locks for good
    got = python_json(
        _COMMAND_HANDLERS
        + """
def item(i):
    return [signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))]

print(json.dumps(forked_map(item, 2, 2)))
"""
    )
    assert got == [[True, True, []], [True, True, []]]


def test_a_worker_forked_while_signals_are_held_back_takes_them() -> None:
    # a mask set in the command when it forks (the writer defers SIGTERM while it creates a temp file) is inherited
    got = python_json(
        _COMMAND_HANDLERS
        + """
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

def item(i):
    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))

print(json.dumps(forked_map(item, 2, 2)))
"""
    )
    assert got == [[], []]


def test_the_workers_have_ended_when_the_map_returns() -> None:
    got = python_json(
        _COMMAND_HANDLERS
        + """
forked_map(lambda i: i, 3, 3)
print(json.dumps([p.name for p in multiprocessing.active_children()]))
"""
    )
    assert got == []
