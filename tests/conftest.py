"""Shared fixtures: the repository root, an in-process CLI runner, and a fake ``torch.cuda`` with a fake nvidia-ml-py
(helpers live in :mod:`tests.support`)."""

from __future__ import annotations

import logging
import os

# One OpenMP thread per test process and every process it starts, set before torch or bitsandbytes is imported (the
# runtimes read it when they load): two workers on two cores, each with a thread per core, made OpenMP's threads
# spin-wait on each other; bitsandbytes' CPU kernels, on an OpenMP runtime of their own that torch.set_num_threads
# does not reach, ran a tiny QLoRA measurement in 22.6 s instead of 3.0 s beside two busy processes. Tracked bytes do
# not depend on the thread count. A count set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, CliRunner, run_cli
from tests.support.fake_cuda import FakeCuda, FakeNVML


def pytest_configure(config: pytest.Config) -> None:
    """No estimate cache in tests (subprocesses inherit this): every CLI estimate traces, so a test that patches
    what a trace depends on is never answered from an earlier run. The cache's own tests set a folder.

    The measurement's processes (``measure``'s child, the ranks of ``measure --nproc``, the truths' runs and probes)
    are forked from a server that has imported the stack once per test process instead of importing it again in
    every fresh Python (``LEDGERSPEC_LAUNCHER=forkserver``, :mod:`ledgerspec.derivations.measure.launch`: each is
    still a process of its own, with its own environment, and ranks still rendezvous over gloo); the torchrun path
    is run by ``tests/derivations/measure/test_launch.py``."""
    os.environ["LEDGERSPEC_CACHE_DIR"] = "off"
    os.environ.setdefault("LEDGERSPEC_LAUNCHER", "forkserver")
    launches = logging.getLogger("ledgerspec.derivations.measure.launch")
    launches.setLevel(logging.INFO)
    launches.addHandler(_FreshLaunches())


#: ``test id: variables`` of every launch that started a fresh Python although the fork server was asked for
FRESH_LAUNCHES: list[str] = []


class _FreshLaunches(logging.Handler):
    """Records the launcher's "fresh Python" notes with the running test's id: a test that changes the environment
    and then starts a process pays a whole import of the stack (about 6 s of CPU) without anything failing; the
    session's summary lists them (``pytest_terminal_summary``)."""

    def emit(self, record: logging.LogRecord) -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        args = record.args if isinstance(record.args, tuple) else ()
        FRESH_LAUNCHES.append(f"{test}: {args[0] if args else record.getMessage()}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist worker: handed to the controller
    if workeroutput is not None:
        workeroutput["fresh_launches"] = list(FRESH_LAUNCHES)


def pytest_testnodedown(node: object, error: object) -> None:
    FRESH_LAUNCHES.extend(getattr(node, "workeroutput", {}).get("fresh_launches", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FRESH_LAUNCHES:
        terminalreporter.write_sep("-", f"{len(FRESH_LAUNCHES)} launches started a fresh Python, not a fork")
        for line in FRESH_LAUNCHES:
            terminalreporter.write_line(line)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The fork server starts, when first needed, with the session's environment as it is once the tests are
    collected, whatever a test has set by then: collecting imports the stack, and an import may set a variable
    (torch sets ``TORCHINDUCTOR_CACHE_DIR``). Kept before collection, the server's environment differed from every
    test's, and every launch was a fresh Python.

    The session's server also imports ``transformers.trainer`` (with ``datasets``) and ``trl``, which the truths'
    real Trainer and TRL runs and the TRL measurements import in every child otherwise: about 0.55 s and 0.7 s of CPU
    per child. Neither sets an environment variable at import; ``deepspeed`` (which accelerate's ``unwrap_model``
    imports in every Trainer run) is not preloaded: its import sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` and picks its
    accelerator, which a forked child could then not pick again."""
    from ledgerspec.derivations.measure import launch

    launch.PRELOAD = (*launch.PRELOAD, "transformers.trainer", "trl")  # type: ignore[assignment]  # a longer tuple
    launch.remember_environment()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Every test (its fixtures' setup and teardown included) leaves the environment as it found it. What the
    libraries set when a test imports them stays in that test: DeepSpeed's import sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which made every later launch of that worker a fresh Python (the fork
    server's environment no longer matched) and a whole CI run minutes slower."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def cli() -> CliRunner:
    """The in-process CLI runner: ``code, stdout, stderr = cli("validate", path)``."""
    return run_cli


@pytest.fixture
def fake_cuda() -> FakeCuda:
    return FakeCuda()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> FakeNVML:
    nvml = FakeNVML(fake_cuda)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` (``scripts/test``) as pytest-xdist means it: every test marked ``xdist_group(NAME)`` on
    one worker. pytest-xdist 3.8 tags each such test by assigning ``item._nodeid = nodeid + "@NAME"``, which pytest
    9 no longer reads (``Node.nodeid`` is ``str(self._id)``), so the groups were silently ignored and every
    module-scoped fixture of a group (a real multi-rank run, a Trainer run, the built docs site) was set up on
    both workers. The tag is written where pytest 9 reads it; nothing changes where xdist's own assignment works."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if not names:
            continue
        tag = "@" + "_".join(names)
        if not item.nodeid.endswith(tag):
            item._id = coerce_node_id(item.nodeid + tag)
