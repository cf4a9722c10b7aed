"""Two simulations at once (:mod:`ledgerspec.derivations.engine.beside`): the same answers as in turn, errors
reported as they would be in turn, and in turn whenever a fork is not safe."""

from __future__ import annotations

import os

import pytest

from ledgerspec.derivations.engine import beside, protocol
from ledgerspec.errors import LedgerspecError


@pytest.fixture
def forkable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "RUNS_STARTED", 0)
    monkeypatch.setattr(beside, "usable_cpus", lambda: 2)


def test_the_second_runs_in_another_process(forkable: None) -> None:
    here = os.getpid()
    a, b = beside.both(lambda: ("first", os.getpid()), lambda: ("second", os.getpid()))
    assert a == ("first", here)
    assert b[0] == "second" and b[1] != here


def test_an_error_of_the_second_is_raised_here(forkable: None) -> None:
    def fails() -> None:
        raise LedgerspecError("cannot model this", "x.yaml", 3, 1, rule="estimate", hint="measure instead")

    with pytest.raises(LedgerspecError) as info:
        beside.both(lambda: 1, fails)
    assert info.value.format() == "x.yaml:3:1: estimate: cannot model this (hint: measure instead)"


def test_a_child_that_sends_nothing_is_run_again_here(forkable: None) -> None:
    calls: list[int] = []

    def second() -> int:
        calls.append(os.getpid())
        if os.getpid() != here:
            os._exit(3)  # dies without an answer
        return 42

    here = os.getpid()
    assert beside.both(lambda: 1, second) == (1, 42)
    assert calls == [here]  # the child's append stayed in the child


def test_an_error_of_the_first_stops_the_child(forkable: None) -> None:
    def first() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        beside.both(first, lambda: __import__("time").sleep(60))


@pytest.mark.parametrize("why", ["traced", "one-cpu", "off"])
def test_in_turn_when_a_fork_is_not_safe(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(protocol, "RUNS_STARTED", 1 if why == "traced" else 0)
    monkeypatch.setattr(beside, "usable_cpus", lambda: 1 if why == "one-cpu" else 2)
    here = os.getpid()
    assert beside.both(os.getpid, os.getpid, parallel=why != "off") == (here, here)


@pytest.mark.slow
def test_an_estimate_with_its_probes_at_once_equals_one_in_turn() -> None:
    """A fresh process (nothing traced yet, as the CLI) traces the two depth probes at once: every figure equals the
    probes traced one after the other (in this test's process)."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.estimate.estimator import estimate
    from tests.support import python_json
    from tests.support.estimate_docs import ledger

    code = (
        "import json, os\n"
        "from ledgerspec.derivations.engine import beside\n"
        "from ledgerspec.derivations.estimate.estimator import estimate\n"
        "from tests.support.estimate_docs import ledger\n"
        "assert beside.can_fork()\n"
        "print(json.dumps(estimate(ledger(checkpointing=True), parallel=True).figures))\n"
    )
    there = python_json(code)
    serial = estimate(ledger(checkpointing=True))
    assert serial.plan.probes == (2, 3)
    assert there == serial.figures


# -- the helper process: one child for a whole question --------------------------------------------------------------
def _pid_and(x: int) -> tuple[int, int]:
    return os.getpid(), x * 2


def _refuses(x: int) -> None:
    raise LedgerspecError(f"cannot model {x}", "x.yaml", 3, 1, rule="estimate", hint="measure instead")


def _dies(x: int) -> int:
    if os.getpid() != int(os.environ.get("LEDGERSPEC_TEST_PARENT", "0")):
        os._exit(3)  # the helper dies without an answer
    return x + 1


def _slowly(x: int) -> tuple[int, int]:
    import time

    time.sleep(1.0)
    return _pid_and(x)


def _hangs(x: int) -> tuple[int, int]:
    import time

    if os.getpid() != int(os.environ.get("LEDGERSPEC_TEST_PARENT", "0")):
        time.sleep(600)  # the helper never answers
    return _pid_and(x)


def test_a_helper_runs_each_task_in_its_own_process_in_turn(forkable: None) -> None:
    here = os.getpid()
    with beside.Helper() as helper:
        assert helper.running and helper.pid != here
        first = helper.submit(_slowly, 3)
        assert helper.busy
        assert helper.submit(_pid_and, 4)() == (here, 8)  # busy: computed here
        pid, value = first()
        assert value == 6 and pid == helper.pid
        assert helper.submit(_pid_and, 5)() == (helper.pid, 10)  # free again: the same child
        child = helper.pid
    assert not helper.running
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)  # reaped


def test_a_helper_is_free_once_its_answer_has_arrived(forkable: None) -> None:
    """The answer is kept for its waiter: the child takes the next task before the first answer is asked for."""
    import time

    with beside.Helper() as helper:
        first = helper.submit(_pid_and, 1)
        deadline = time.monotonic() + 30
        while helper.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        second = helper.submit(_pid_and, 2)
        assert second() == (helper.pid, 4) and first() == (helper.pid, 2)


def test_a_helper_that_hangs_is_stopped_and_its_task_computed_here(
    forkable: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = os.getpid()
    monkeypatch.setenv("LEDGERSPEC_TEST_PARENT", str(here))
    monkeypatch.setattr(beside, "WAIT_LIMIT", 0.5)
    with beside.Helper() as helper:
        child = helper.pid
        assert child is not None
        assert helper.submit(_hangs, 3)() == (here, 6)
        assert not helper.running
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)  # killed and reaped


def test_an_answer_asked_for_after_close_is_computed_here(forkable: None) -> None:
    helper = beside.Helper()
    waiting = helper.submit(_slowly, 2)
    helper.close()
    assert waiting() == (os.getpid(), 4)


def test_a_helpers_error_is_raised_here(forkable: None) -> None:
    with beside.Helper() as helper:
        with pytest.raises(LedgerspecError) as info:
            helper.submit(_refuses, 7)()
        assert info.value.format() == "x.yaml:3:1: estimate: cannot model 7 (hint: measure instead)"
        assert helper.submit(_pid_and, 1)()[1] == 2  # still serving


def test_what_a_helper_cannot_take_or_answer_is_computed_here(forkable: None, monkeypatch: pytest.MonkeyPatch) -> None:
    here = os.getpid()
    monkeypatch.setenv("LEDGERSPEC_TEST_PARENT", str(here))
    with beside.Helper() as helper:
        assert helper.submit(lambda: os.getpid())() == here  # a lambda does not pickle
        assert helper.submit(_dies, 1)() == 2  # the child died: computed here
        assert not helper.running
        assert helper.submit(_pid_and, 2)() == (here, 4)  # and everything after it


def test_closing_a_busy_helper_stops_it(forkable: None) -> None:
    import time

    helper = beside.Helper()
    pid = helper.pid
    assert pid is not None
    helper.submit(time.sleep, 60)
    started = time.perf_counter()
    helper.close()
    assert time.perf_counter() - started < 10 and not helper.running
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("why", ["traced", "one-cpu"])
def test_no_helper_when_a_fork_is_not_safe(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(protocol, "RUNS_STARTED", 1 if why == "traced" else 0)
    monkeypatch.setattr(beside, "usable_cpus", lambda: 1 if why == "one-cpu" else 2)
    helper = beside.Helper()
    assert not helper.running
    assert helper.submit(_pid_and, 1)() == (os.getpid(), 2)
    helper.close()
