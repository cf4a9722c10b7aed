"""The forked workers of a sweep or a search: they return each item's result, and their signals are their own.

Run in a fresh interpreter each (as a command forks them: before anything is traced in its process), with the
handlers a command installs (``faces.cli``: SIGTERM raising ``SystemExit``)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_normal_end_sends_the_workers_no_signal(tmp_path: Path) -> None:
    # each worker marks a file if SIGTERM reaches it (its own handler, set after the pool's initializer): the pool is
    # closed and joined after its work, so none is terminated; Pool's own exit (terminate()) would signal them
    marks = tmp_path / "marks"
    marks.mkdir()
    got = python_json(
        _COMMAND_HANDLERS
        + f"""
import os
MARKS = {str(marks)!r}

def marked(signum, frame):
    open(os.path.join(MARKS, str(os.getpid())), "w").close()
    os._exit(0)

def item(i):
    signal.signal(signal.SIGTERM, marked)
    return os.getpid()

pids = forked_map(item, 4, 2)
print(json.dumps([len(set(pids)), [p.name for p in multiprocessing.active_children()]]))
"""
    )
    assert got[1] == [] and 1 <= got[0] <= 2
    assert sorted(marks.iterdir()) == [], "a worker was sent SIGTERM"


def test_the_workers_are_born_with_sigterms_default_action(tmp_path: Path) -> None:
    # the initializer alone leaves a race: a SIGTERM (Pool.terminate()) that reaches a worker before its initializer
    # runs is taken by Python's C-level handler, and once the initializer has set the default action Python finds no
    # handler to call and drops it: the worker lives on, blocked on the pool's queue lock, the command waiting for it
    # (a hang seen under load). So the command's handler is set aside while the workers are forked: each child sees
    # the default action from its first instruction (recorded at fork, before any Python code of the worker's runs)
    seen = tmp_path / "seen"
    seen.mkdir()
    got = python_json(
        _COMMAND_HANDLERS
        + f"""
import os

def at_fork():
    default = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    open(os.path.join({str(seen)!r}, f"{{os.getpid()}}-{{default}}"), "w").close()

os.register_at_fork(after_in_child=at_fork)
forked_map(abs, 4, 2)
print(json.dumps(signal.getsignal(signal.SIGTERM) is unwind))
""",
        timeout=120,
    )
    assert got is True  # the command's handler is back
    born = [p.name.split("-")[1] for p in seen.iterdir()]
    assert born and set(born) == {"True"}, born


def test_a_worker_that_dies_leaves_its_items_to_the_caller() -> None:
    # the kernel's out-of-memory killer or a SIGKILL: multiprocessing.Pool waited for the lost item for ever; the
    # broken pool now answers None for every item not answered, and the caller runs those itself
    got = python_json(
        _COMMAND_HANDLERS
        + """
import os

def item(i):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return i * 10

print(json.dumps([forked_map(item, 6, 2), [p.name for p in multiprocessing.active_children()]]))
""",
        timeout=120,
    )
    answers, children = got
    assert len(answers) == 6 and answers[1] is None and children == []
    assert all(a is None or a == 10 * i for i, a in enumerate(answers))
