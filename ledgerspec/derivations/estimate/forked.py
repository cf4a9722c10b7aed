"""Independent estimates mapped over forked worker processes, and the workers' signals.

A worker is forked from a command's process, so it inherits the command's handlers: SIGTERM raising
``SystemExit`` (``faces.cli``, so that a write in progress unwinds) and Ctrl-C raising ``KeyboardInterrupt``. A
worker must not: ``multiprocessing.Pool.terminate()`` ends the workers it cannot stop otherwise with SIGTERM, and a
worker that unwinds instead of dying can block on the pool's queue locks (held by the parent while it drains the
task queue). Seen once in the test suite: a worker waiting in ``SemLock.acquire`` and the parent in ``terminate()``,
for good. So each worker is forked with SIGTERM's default action (the command's handler set aside meanwhile) and
keeps it (its initializer), leaves Ctrl-C to the parent (which then terminates the pool), and neither signal is held
back; and the pool is closed and joined when its work is done, so that a normal end sends no signal at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_PENDING: Callable[[int], Any] | None = None


def _worker_signals() -> None:
    """A worker's signals: SIGTERM ends it (the default action), SIGINT is the parent's to act on, none held back."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock = getattr(signal, "pthread_sigmask", None)
    if unblock is not None:
        unblock(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _pool(processes: int) -> Any:
    """A fork pool whose workers are born with SIGTERM's default action: the command's handler is set aside while
    they are forked. The initializer alone leaves a race: a SIGTERM that reaches a worker before its initializer
    runs is taken by Python's C-level handler, and by the time Python looks for a handler it finds the default one,
    which it does not call: the signal is dropped, the worker lives on and blocks on the pool's queue lock while
    the parent waits for it (seen: ``Pool.terminate()`` right after the pool started, the parent in ``waitpid``)."""
    import multiprocessing
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if previous is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return multiprocessing.get_context("fork").Pool(processes, initializer=_worker_signals)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(index: int) -> Any:
    """One item, in a worker (None when it failed there: the caller runs it again to report its error)."""
    assert _PENDING is not None
    try:
        return _PENDING(index)
    except BaseException:
        return None


def forked_map(fn: Callable[[int], T], count: int, processes: int) -> list[T | None]:
    """``fn(i)`` for each ``i`` below ``count`` in ``processes`` workers forked from this process (they inherit its
    modules and ``fn``'s closure: nothing is pickled on the way in, only the results on the way back); None where
    it raised in a worker. The caller decides whether forking is safe (see :func:`.search.run_estimates`)."""
    global _PENDING

    _PENDING = fn
    try:
        pool = _pool(min(processes, count))
        with pool:
            got = pool.map(_run, range(count), chunksize=1)
            pool.close()  # a normal end: the workers take their sentinels and exit, and are joined
            pool.join()
    finally:
        _PENDING = None
    return got
