"""How the measurement's processes start: a fresh Python for each (the default), or forked from a server that has
already imported the stack (``LEDGERSPEC_LAUNCHER=forkserver``).

A measurement runs in processes of its own: ``measure`` in one child (:mod:`.measurer`), ``measure --nproc N`` in N
ranks (:mod:`.dist`, under ``torchrun`` by default). Each fresh Python imports torch, transformers, peft and
accelerate before it measures anything: about 6 s of CPU per process on a 2-core machine, most of a small
measurement's time. A test suite or a benchmark that starts hundreds of them can ask for
``LEDGERSPEC_LAUNCHER=forkserver``: the processes are then forked from Python's ``multiprocessing`` fork server,
which imports :data:`PRELOAD` once (per process that launches) and forks a child per launch, before any tensor
exists. Each child is a new process as the program sees it: its own environment, working directory, ``sys.argv``,
``__main__`` (the module or script run as ``python -m`` / ``python SCRIPT`` would), standard output and error, exit
code and, with ``new_session``, its own process group. The ranks of ``--nproc`` get the variables torchrun gives a
rank (:func:`rank_environment`) and are started directly instead of by torchrun's agent.

What a fork cannot give is an import-time reading of the environment different from the server's: a launch whose
environment differs from the one the fork server was started with in anything but the per-launch variables
(:data:`PER_LAUNCH`: rank, world size, rendezvous) starts a fresh Python instead, so every child sees its environment
as a fresh process would. The thread count (``OMP_NUM_THREADS``, read by OpenMP when torch is imported) is applied
with ``torch.set_num_threads`` in the child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "LEDGERSPEC_LAUNCHER"
MODES = ("subprocess", "forkserver")
#: what the fork server imports once (a module that fails to import is skipped, as ``multiprocessing`` does)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "accelerate",
    "ledgerspec.derivations.measure.launch",
)
#: environment variables that may differ from launch to launch without a fresh Python: read at run time
PER_LAUNCH = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "GLOO_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "PYTEST_CURRENT_TEST",  # pytest's name of the running test, changed for every test
    }
)
#: read at start-up or when huggingface_hub is imported, applied in the child: the offline switch (as
#: :func:`ledgerspec.derivations.stack.build.go_offline` does; only towards offline) and ``PYTHONPATH`` (its entries put
#: on ``sys.path`` as a fresh Python puts them)
APPLIED = frozenset({"HF_HUB_OFFLINE", "PYTHONPATH"})


def mode() -> str:
    chosen = os.environ.get(ENV, "").strip().lower() or "subprocess"
    return chosen if chosen in MODES else "subprocess"


@dataclass
class Finished:
    """A process that ended: its exit code (negative: the signal that ended it) and what it printed."""

    returncode: int
    stdout: str
    stderr: str


class Launched:
    """A started process (``python ARGS``): :meth:`wait` for it, or :meth:`kill` it (its process group with
    ``new_session``)."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], new_session: bool, cwd: str | None) -> None:
        self.args = list(args)
        self._new_session = new_session
        self._files = tempfile.TemporaryDirectory(prefix="ledgerspec-launch-")
        self._out = os.path.join(self._files.name, "stdout")
        self._err = os.path.join(self._files.name, "stderr")
        self._popen: subprocess.Popen[bytes] | None = None
        self._process: Any = None
        kept_from_fork = keeps_from_forking(env) if mode() == "forkserver" else None
        self.forked = kept_from_fork == []
        if kept_from_fork:  # a fresh Python where a fork was asked for: said, for tests
            logging.getLogger(__name__).info("fresh Python: the environment differs in %s", kept_from_fork)
        if self.forked:
            ctx = _context()
            self._process = ctx.Process(
                target=_child, args=(self.args, dict(env), cwd or os.getcwd(), self._out, self._err, new_session)
            )
            try:
                with _bare_main():
                    self._process.start()
            except BaseException:  # interrupted while the server forks it: the child must not outlive us
                if getattr(self._process, "pid", None):
                    self.pid = int(self._process.pid)
                    self.kill()
                self._files.cleanup()
                raise
            self.pid = int(self._process.pid)
        else:
            with open(self._out, "wb") as out, open(self._err, "wb") as err:
                self._popen = subprocess.Popen(
                    [sys.executable, *self.args],
                    stdout=out,
                    stderr=err,
                    env=dict(env),
                    cwd=cwd,
                    start_new_session=new_session,
                )
            self.pid = self._popen.pid

    def poll(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        return None if self._process.is_alive() else int(self._process.exitcode)

    def wait(self, timeout: float | None = None) -> Finished:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds: the process still runs)."""
        if self._popen is not None:
            code = self._popen.wait(timeout)
        else:
            self._process.join(timeout)
            if self._process.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            code = int(self._process.exitcode)
        return self._finished(code)

    def kill(self) -> None:
        """SIGKILL to the process (its whole session with ``new_session``), then reap it."""
        try:
            if self._new_session:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._popen is not None:
            self._popen.wait()
        else:
            self._process.join()

    def _finished(self, code: int) -> Finished:
        def read(path: str) -> str:
            try:
                return Path(path).read_text(encoding="utf-8", errors="replace")
            except OSError:
                return ""

        done = Finished(code, read(self._out), read(self._err))
        self._files.cleanup()
        return done


def start(
    args: Sequence[str], env: Mapping[str, str] | None = None, new_session: bool = False, cwd: str | None = None
) -> Launched:
    """Start ``python ARGS`` (``["-m", "module", ...]`` or ``["script.py", ...]``) with ``env`` (default: this
    process's environment)."""
    return Launched(args, os.environ if env is None else env, new_session, cwd)


def run(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    new_session: bool = False,
    cwd: str | None = None,
) -> Finished:
    """:func:`start`, then wait; on a timeout or an interrupt the process (group) is killed and the error raised."""
    launched = start(args, env, new_session, cwd)
    try:
        return launched.wait(timeout)
    except BaseException:
        launched.kill()
        raise


def rank_environment(base: Mapping[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun (``--nnodes 1 --nproc_per_node WORLD``) puts in a rank's environment, for a rank started
    directly: the rendezvous is ``env://`` on 127.0.0.1:PORT, rank 0 hosting the store."""
    return {
        **base,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def run_ranks(
    args: Sequence[str], world: int, env: Mapping[str, str], port: int, timeout: float | None = None
) -> tuple[int, str]:
    """``python ARGS`` as ``world`` ranks started directly (:func:`rank_environment`): when one fails, the others are
    stopped (they may wait in a collective), as torchrun stops them. The first non-zero exit code (0 when every rank
    succeeded) and the ranks' standard error, rank by rank."""
    ranks = [start(args, rank_environment(env, r, world, port), new_session=True) for r in range(world)]
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        pending = set(range(world))
        while pending:
            for r in sorted(pending):
                rc = ranks[r].poll()
                if rc is None:
                    continue
                pending.discard(r)
                if rc != 0 and code == 0:
                    code = rc
            if code != 0 or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(0.05)
        if pending and code == 0:
            raise subprocess.TimeoutExpired(list(args), timeout or 0)
    except BaseException:
        for launched in ranks:
            launched.kill()
        raise
    for r in sorted(pending):  # a rank failed: the others may wait in a collective
        ranks[r].kill()
    errors = []
    for r, launched in enumerate(ranks):
        finished = launched.wait(0)
        errors.append(finished.stderr)
        if r in pending and code == 0:
            code = finished.returncode
    return code, "".join(errors)


# -- the fork server ------------------------------------------------------------------------------------------------

_SERVER_ENV: dict[str, str] | None = None
_BASE_ENV: dict[str, str] | None = None


def remember_environment() -> None:
    """Start the fork server, when it is first needed, with this process's environment as it is NOW (not as it is
    at that later moment): for a test session, whose tests change the environment for a while (a later launch
    with the session's environment is then forked, not started afresh)."""
    global _BASE_ENV
    _BASE_ENV = dict(os.environ)


def _context() -> Any:
    """The ``forkserver`` context, its server started (once) with this process's environment (or the one
    :func:`remember_environment` kept) and :data:`PRELOAD`."""
    import multiprocessing

    global _SERVER_ENV
    ctx = multiprocessing.get_context("forkserver")
    if _SERVER_ENV is None:
        ctx.set_forkserver_preload([m for m in PRELOAD if _importable(m)])
        from multiprocessing import forkserver

        env = dict(os.environ) if _BASE_ENV is None else _BASE_ENV
        now = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            forkserver.ensure_running()  # the server inherits this environment
        finally:
            os.environ.clear()
            os.environ.update(now)
        _SERVER_ENV = env
    return ctx


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """Start a child without importing this process's ``__main__`` in it (``multiprocessing`` re-runs the main
    script of a spawn or fork-server child as ``__mp_main__``; a script without a ``__name__`` guard would run
    again). The child runs :func:`_child` and the program it is asked to run, nothing of this one."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def keeps_from_forking(env: Mapping[str, str]) -> list[str]:
    """The variables of ``env`` that keep a launch from being forked from the server (sorted; empty: a child forked
    from the server sees ``env`` as a fresh Python would, see the module docstring)."""
    server = _SERVER_ENV or _BASE_ENV or dict(os.environ)
    keys = (set(server) | set(env)) - PER_LAUNCH - APPLIED
    differ = sorted(k for k in keys if server.get(k) != env.get(k))
    if _offline(server) and not _offline(env):  # the child can be made offline, not online again
        differ.append("HF_HUB_OFFLINE")
    return differ


def _offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _child(args: list[str], env: dict[str, str], cwd: str, out: str, err: str, new_session: bool) -> None:
    """In the forked child: become ``python ARGS`` (environment, directory, streams, argv, ``__main__``)."""
    import runpy

    if new_session:
        os.setsid()
    for fd, path in ((1, out), (2, err)):
        try:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the launcher was interrupted and has gone (its files with it): nobody to run for
            os._exit(1)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if _offline(env) and "huggingface_hub" in sys.modules:
        from ledgerspec.derivations.stack.build import go_offline

        go_offline()
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:0] = [os.path.abspath(p) for p in extra]
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")
