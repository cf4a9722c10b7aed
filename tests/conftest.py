"""Shared fixtures: the repository root and an in-process CLI runner."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from ledgerspec.faces.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
CASES = REPO_ROOT / "tests" / "cases"
BAD = REPO_ROOT / "tests" / "bad"

CliRunner = Callable[..., tuple[int, str, str]]


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``ledgerspec ARGS...`` in-process; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def cli() -> CliRunner:
    """The in-process CLI runner: ``code, stdout, stderr = cli("validate", path)``."""
    return run_cli
