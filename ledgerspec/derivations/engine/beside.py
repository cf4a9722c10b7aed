"""Two independent simulations at once: the second in a process forked beside this one, on a machine with a core to
spare (an estimate's two depth probes, :mod:`ledgerspec.derivations.estimate.extrapolate`).

The child is forked only before this process has run any protocol (``protocol.RUNS_STARTED``: a process forked after
a fake-tensor trace has been seen to hang, torch 2.13) and only when at least two CPUs are usable; it inherits the
imported modules and the document, runs its function and sends back the pickled result (or the
:class:`~ledgerspec.errors.LedgerspecError` it raised). Anything else — no fork, one CPU, a child that dies or
cannot send its result — runs the function here instead: the answer never depends on how it was computed.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from typing import Any, TypeVar

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
            try:
                payload = pickle.dumps(("ok", second()))
            except LedgerspecError as exc:
                payload = pickle.dumps(("error", exc.to_json()))
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
    if status == "ok":
        return a, value
    if status == "error":
        raise LedgerspecError(**value)
    return a, second()


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
