"""Independent estimates mapped over forked worker processes, and the workers' signals.

A worker is forked from a command's process, so it inherits the command's handlers: SIGTERM raising
``SystemExit`` (``faces.cli``, so that a write in progress unwinds) and Ctrl-C raising ``KeyboardInterrupt``. A
worker must not keep them: one that unwinds instead of dying can block on the pool's queue locks while the command
waits for it, for good (seen once in the test suite with ``multiprocessing.Pool``: a worker in ``SemLock.acquire``,
the command in ``Pool.terminate()``). So each worker is forked with SIGTERM's default action (the command's handler
set aside meanwhile: a SIGTERM that reached a worker before it reset the handler itself was taken by Python's
C-level handler and then dropped) and keeps it (its initializer), leaves Ctrl-C to the command, and neither signal
is held back.

The workers are a ``concurrent.futures.ProcessPoolExecutor``'s: a worker that dies (the kernel's out-of-memory
killer, a SIGKILL) breaks the pool, and every item it had not answered comes back as None, which the caller runs
again itself (``multiprocessing.Pool`` waits for a lost task for ever). A normal end shuts the pool down (each
worker takes its sentinel and exits, no signal sent); an interrupted map ends the workers with SIGTERM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def _sigterm_set_aside() -> Iterator[None]:
    """SIGTERM's default action in this process while the workers are forked (they are born with it), the command's
    handler back after."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if previous is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
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
    it raised in a worker, or where a worker died before answering it. The caller decides whether forking is safe
    (see :func:`.search.run_estimates`)."""
    global _PENDING
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _PENDING = fn
    pool = ProcessPoolExecutor(
        max_workers=min(processes, count),
        mp_context=multiprocessing.get_context("fork"),
        initializer=_worker_signals,
    )
    try:
        with _sigterm_set_aside():  # a fork pool starts every worker at the first submit
            futures = [pool.submit(_run, i) for i in range(count)]
        got: list[T | None] = []
        for future in futures:
            try:
                got.append(future.result())
            except BrokenProcessPool:  # a worker died: what it had not answered is run again by the caller
                got.append(None)
    except BaseException:  # interrupted: the workers end now, not after their current item
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            if process.is_alive():
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        _PENDING = None
    pool.shutdown(wait=True)  # each worker takes its sentinel and exits
    return got
