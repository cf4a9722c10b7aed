"""What every test may import: the repository's paths, the in-process CLI runner, a loader for the scripts."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledgerspec.faces.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
TESTS = REPO_ROOT / "tests"
EXAMPLES = REPO_ROOT / "examples"
CASES = TESTS / "cases"
BAD = TESTS / "bad"
DATA = TESTS / "data"

CliRunner = Callable[..., tuple[int, str, str]]


def outside_ci_sample(what: str) -> Any:
    """Skip a committed benchmark row's re-estimate in CI (``.ci/run`` sets ``LEDGERSPEC_REESTIMATES=sample``):
    ``what`` says which path CI's sample already re-derives. ``scripts/test`` runs every re-estimate."""
    import pytest

    return pytest.mark.skipif(
        os.environ.get("LEDGERSPEC_REESTIMATES", "all") == "sample",
        reason=f"LEDGERSPEC_REESTIMATES=sample (CI's 15 minutes): {what}; `scripts/test` re-estimates this row",
    )


def run_cli(*args: str | os.PathLike[str]) -> tuple[int, str, str]:
    """Run ``ledgerspec ARGS...`` in-process; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, out.getvalue(), err.getvalue()


def fresh_python(
    args: list[str | os.PathLike[str]], env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> Any:
    """``python ARGS`` in a process of its own, as the measurement starts its processes
    (:func:`ledgerspec.derivations.measure.launch.run`: in the test session forked from a server that has imported the
    stack once, ``LEDGERSPEC_LAUNCHER=forkserver``); its exit code and output (``.returncode``, ``.stdout``,
    ``.stderr``)."""
    from ledgerspec.derivations.measure import launch

    return launch.run([str(a) for a in args], env, timeout, cwd=str(cwd) if cwd is not None else None)


def python_json(code: str, timeout: float = 300) -> Any:
    """The JSON value the last line of ``python -c CODE`` prints, in a fresh interpreter (nothing imported or traced
    yet, as a command starts) with the repository on its path; its exit code must be 0. After ``timeout`` seconds
    its whole process group is killed (a hang fails the test, it does not hold the suite: children it forked would
    keep the output pipes open)."""
    import json
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"python -c ... did not end in {timeout} s: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def load_script(path: Path, name: str) -> Any:
    """A script (a ``benchmarks/`` file, or one without a .py suffix), imported as the module ``name``, registered in
    ``sys.modules`` (a script's dataclasses look their module up there)."""
    import sys

    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def modules_in_place(modules: dict[str, Any]) -> Any:
    """``sys.modules`` holds ``modules`` (stand-ins for packages this machine lacks, while an upstream source file is
    imported) and, on leaving, what it held before: an entry that was absent is removed again."""
    import sys

    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def one_worker_each(prefix: str, params: list[Any], ids: list[str] | None = None) -> list[Any]:
    """``params`` of a module-scoped fixture, each marked with its own ``xdist_group``: under ``--dist loadgroup``
    (``scripts/test``) every test of one parameter runs on one worker, so the fixture is set up once, not once per
    worker that happens to get one of its tests (a real multi-rank run or a simulation each time)."""
    import pytest

    names = ids if ids is not None else [str(p) for p in params]
    return [
        pytest.param(p, id=name, marks=pytest.mark.xdist_group(f"{prefix}-{name}"))
        for p, name in zip(params, names, strict=True)
    ]
