"""Shared fixtures: the repository root, an in-process CLI runner, and a fake ``torch.cuda`` with a fake nvidia-ml-py
(helpers live in :mod:`tests.support`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, CliRunner, run_cli
from tests.support.fake_cuda import FakeCuda, FakeNVML


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
