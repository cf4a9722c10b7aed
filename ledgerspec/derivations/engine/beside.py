"""Two independent simulations at once: the second in a process forked beside this one, on a machine with a core to
spare (an estimate's two depth probes, :mod:`ledgerspec.derivations.estimate.extrapolate`); :class:`Helper` keeps
such a process for a whole question (``estimate --fit microbatch``: every microbatch's deepest probe, and the probe
that checks the microbatch line, while this process traces the others).

The child is forked only before this process has run any protocol (``protocol.RUNS_STARTED``: a process forked after
a fake-tensor trace has been seen to hang, torch 2.13) and only when at least two CPUs are usable; it inherits the
imported modules and the document, runs its function and sends back the pickled result (or the
:class:`~ledgerspec.errors.LedgerspecError` it raised). Anything else — no fork, one CPU, a child that dies or
cannot send its result — runs the function here instead: the answer never depends on how it was computed.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import weakref
from collections.abc import Callable
from typing import IO, Any, TypeVar

from ledgerspec.errors import LedgerspecError

T = TypeVar("T")
U = TypeVar("U")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def can_fork() -> bool:
    """Whether a child may be forked now (see the module docstring)."""
    from ledgerspec.derivations.engine import protocol

    return hasattr(os, "fork") and not protocol.RUNS_STARTED and usable_cpus() >= 2


def both(first: Callable[[], T], second: Callable[[], U], parallel: bool = True) -> tuple[T, U]:
    """``(first(), second())``, ``second`` in a forked child while ``first`` runs here when it may (else in turn)."""
    if not parallel or not can_fork():
        return first(), second()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, leave without running the parent's exit handlers
        os.close(read_end)
        code = 0
        try:
            payload = _answer(second)
            with os.fdopen(write_end, "wb") as out:
                out.write(payload)
        except BaseException:  # anything else: the parent computes it again and reports it
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        a = first()
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # its answer is not needed
        _reap(pid, read_end)
        raise
    status, value = _reap(pid, read_end)
    return a, _answered(status, value, second)


def _answer(fn: Callable[[], Any]) -> bytes:
    """``fn()``'s answer as a child sends it: ``("ok", value)``, or ``("error", the LedgerspecError as JSON)``,
    pickled; anything else it raises is raised (the child then sends none, or ``("lost", None)``)."""
    try:
        return pickle.dumps(("ok", fn()))
    except LedgerspecError as exc:
        return pickle.dumps(("error", exc.to_json()))


def _answered(status: str, value: Any, fn: Callable[[], T]) -> T:
    """What a child's answer means here: its value, its error raised, or (``lost``) ``fn()`` computed here."""
    if status == "ok":
        return value
    if status == "error":
        raise LedgerspecError(**value)
    return fn()


def _reap(pid: int, read_end: int) -> tuple[str, Any]:
    """The child's result (``("lost", None)`` when it sent none), after it has exited."""
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    try:
        status, value = pickle.loads(data) if data else ("lost", None)
    except Exception:
        return "lost", None
    return str(status), value


#: seconds :class:`Helper` waits for an answer before it stops the child and computes the task here (a child that
#: hangs, as a process forked after a trace has been seen to: never expected of a helper, forked before any trace)
WAIT_LIMIT = 1800.0


class _Slot:
    """Where the answer of one submitted task is kept until its waiter asks for it."""

    answer: tuple[str, Any] | None = None


class Helper:
    """One process forked now (only where :func:`can_fork`: before this process runs any protocol) that runs the
    functions :meth:`submit` sends it, one at a time, while this process goes on.

    A function and its arguments travel pickled (a module-level function and plain data: a document pickles); the
    child inherits the modules imported so far (warm them first). Whatever cannot be sent, a child that is busy,
    dies, hangs (no answer within :data:`WAIT_LIMIT`) or cannot send its answer back: the function runs here when its
    answer is asked for, so the answer never depends on where it was computed; a
    :class:`~ledgerspec.errors.LedgerspecError` the child raised is raised here. The child is free again as soon as
    its answer has arrived (it is kept for its waiter). :meth:`close` (or the end of a ``with`` block, or the object
    being collected) stops the child; a child whose parent is gone reads the end of its pipe and leaves."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._from: IO[bytes] | None = None
        self._to: IO[bytes] | None = None
        self._pending: _Slot | None = None  # the task the child is computing (or whose answer is on its way)
        self._finalizer: Any = None
        if not can_fork():
            return
        down_read, down_write = os.pipe()  # tasks, to the child
        up_read, up_write = os.pipe()  # answers, from it
        pid = os.fork()
        if pid == 0:
            try:
                os.close(down_write)
                os.close(up_read)
                _serve(down_read, up_write)
            finally:
                os._exit(1)
        os.close(down_read)
        os.close(up_write)
        self.pid = pid
        self._from, self._to = os.fdopen(up_read, "rb"), os.fdopen(down_write, "wb")
        self._finalizer = weakref.finalize(self, _stop_child, pid, self._from, self._to)

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def busy(self) -> bool:
        """Whether the child is computing a task (its answer not arrived yet)."""
        if self._pending is not None:
            self._collect(0.0)
        return self._pending is not None

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        """Start ``fn(*args)`` in the child; returns the function that waits for its answer (call it once). When
        the child cannot take it (none, busy, or the task does not pickle), that function computes it here."""
        here: Callable[[], T] = lambda: fn(*args)  # noqa: E731
        if self.pid is None or self.busy or self._to is None:
            return here
        try:
            payload = pickle.dumps((fn, args))
        except Exception:  # not picklable (a closure, an open file): computed here
            return here
        try:
            self._to.write(payload)
            self._to.flush()
        except OSError:  # the child is gone
            self.close()
            return here
        slot = self._pending = _Slot()
        waited = False

        def wait() -> T:
            nonlocal waited
            if waited:
                raise RuntimeError("a helper's answer is waited for once")
            waited = True
            if slot.answer is None and self._pending is slot:
                self._collect(WAIT_LIMIT)
            answer: tuple[str, Any] = slot.answer or ("lost", None)  # none: stopped before it answered
            return _answered(*answer, here)

        return wait

    def _collect(self, timeout: float) -> None:
        """The pending task's answer into its slot, if it arrives within ``timeout`` seconds; a child that sends
        something unreadable, or nothing within a blocking wait, is stopped (its task is then computed here)."""
        import select

        slot = self._pending
        if slot is None or self._from is None:
            return
        ready, _, _ = select.select([self._from], [], [], timeout)
        if not ready:
            if timeout > 0:  # no answer within the limit: stop it
                self._pending = None
                self.close()
            return
        self._pending = None
        try:
            status, value = pickle.load(self._from)
        except Exception:  # died, or sent something unreadable: no more tasks for it
            self.close()
            return
        slot.answer = (str(status), value)

    def close(self) -> None:
        """Stop the child (at once, whether it is computing or not)."""
        if self.pid is None:
            return
        self.pid = None
        self._pending = None
        self._to = self._from = None
        self._finalizer()


def _stop_child(pid: int, *pipes: IO[bytes]) -> None:
    """Close the helper's pipes, kill it and reap it (a child that was about to leave only leaves sooner)."""
    for f in pipes:
        try:
            f.close()
        except OSError:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _serve(tasks_fd: int, answers_fd: int) -> None:
    """The helper child: run each task it is sent and send back ``("ok", value)``, ``("error", LedgerspecError as
    JSON)`` or ``("lost", None)`` (anything else: the parent computes it again and reports it); leave at the end of
    its tasks, without running the parent's exit handlers."""
    code = 0
    try:
        with os.fdopen(tasks_fd, "rb") as tasks, os.fdopen(answers_fd, "wb") as answers:
            while True:
                try:
                    fn, args = pickle.load(tasks)
                except EOFError:
                    break
                try:
                    payload = _answer(functools.partial(fn, *args))
                except Exception:
                    payload = pickle.dumps(("lost", None))
                answers.write(payload)
                answers.flush()
    except BaseException:
        code = 1
    finally:
        os._exit(code)
