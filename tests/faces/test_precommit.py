"""The pre-commit hooks, for real: ``pre-commit try-repo`` in a scratch git repo.

try-repo clones the hook repository and builds a virtual environment with pip, so it needs the
package index once; PRE_COMMIT_HOME is shared by the session. It only sees committed files (its
shadow commit takes changes to tracked files, not new files), so the hook repository here is a
snapshot of this working tree (tracked and untracked-but-not-ignored files) committed to a temporary
git repository: the test checks what is on disk, whatever the commit state.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from ledgerspec.contract.document import load
from tests.support import EXAMPLES, REPO_ROOT

PRE_COMMIT = shutil.which("pre-commit", path=str(Path(sys.executable).parent)) or shutil.which("pre-commit")
GOOD = EXAMPLES / "llama-2-7b-lora.ledger.yaml"
BAD = EXAMPLES / "naive-article-audit.ledger.yaml"  # counts gradients for all 7B parameters: LS020
DOWNGRADED = EXAMPLES / "downgraded.ledger.yaml"  # declares VALIDATED, supports CANDIDATE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PRE_COMMIT is None, reason="pre-commit is a [dev] dependency"),
    pytest.mark.xdist_group("pre-commit"),  # one worker: the hook environment (PRE_COMMIT_HOME) is built once
]


def test_hook_manifest() -> None:
    hooks = {h["id"]: h for h in YAML(typ="safe").load((REPO_ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert hooks["ledgerspec-validate"]["entry"] == "ledgerspec validate"
    assert hooks["ledgerspec-fix-status"]["entry"] == "ledgerspec validate --fix"
    for hook in hooks.values():
        assert hook["language"] == "python"
        pattern = re.compile(hook["files"])
        assert pattern.search("a/b.ledger.yaml") and pattern.search("x.intake.yml")
        assert not pattern.search("ledger.yaml.bak") and not pattern.search("config.yaml")


def test_base_install_does_not_pull_torch() -> None:
    """The hook venv installs the package's base dependencies: only jsonschema (with referencing) and ruamel.yaml."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = sorted(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"])
    assert names == ["jsonschema", "referencing", "ruamel.yaml"]


_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture(scope="session")
def pre_commit_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pre-commit-home")


@pytest.fixture(scope="session")
def hook_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This working tree as one commit in a temporary repository."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    snapshot = tmp_path_factory.mktemp("hook-repo")
    for name in filter(None, listing.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, snapshot / name)
    _commit_all(snapshot)
    return snapshot


def _commit_all(repo: Path) -> None:
    env = {**os.environ, **_GIT_ENV}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "snapshot"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env, capture_output=True)


def _scratch_repo(root: Path, files: dict[str, Path]) -> Path:
    repo = root / "project"
    repo.mkdir()
    for name, source in files.items():
        shutil.copyfile(source, repo / name)
        if source.parent == EXAMPLES and not (repo / "configs").exists():  # the config.json it names (LS008)
            shutil.copytree(EXAMPLES / "configs", repo / "configs")
    _commit_all(repo)
    return repo


def _try_repo(repo: Path, home: Path, hooks: Path, hook: str, *files: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    env.pop("VIRTUAL_ENV", None)
    assert PRE_COMMIT is not None
    return subprocess.run(
        [PRE_COMMIT, "try-repo", str(hooks), hook, "--verbose", "--files", *files],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_validate_hook_passes_good_and_fails_bad(tmp_path: Path, pre_commit_home: Path, hook_repo: Path) -> None:
    repo = _scratch_repo(tmp_path, {"good.ledger.yaml": GOOD, "audit.ledger.yaml": BAD})

    good = _try_repo(repo, pre_commit_home, hook_repo, "ledgerspec-validate", "good.ledger.yaml")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Passed" in good.stdout

    bad = _try_repo(repo, pre_commit_home, hook_repo, "ledgerspec-validate", "good.ledger.yaml", "audit.ledger.yaml")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Failed" in bad.stdout
    assert "audit.ledger.yaml:" in bad.stdout and "LS020: error" in bad.stdout
    assert "Traceback" not in bad.stdout + bad.stderr


def _run_installed(repo: Path, home: Path, hooks: Path, hook: str, *files: str) -> subprocess.CompletedProcess[str]:
    """``pre-commit run`` with a config naming the hook repository (its environment stays in PRE_COMMIT_HOME)."""
    rev = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=hooks, capture_output=True, text=True, check=True
    ).stdout.strip()
    config = repo / ".pre-commit-config.yaml"
    if not config.exists():
        config.write_text(
            f"repos:\n- repo: {hooks}\n  rev: {rev}\n  hooks:\n  - id: ledgerspec-validate\n"
            "  - id: ledgerspec-fix-status\n"
        )
        subprocess.run(["git", "add", config.name], cwd=repo, check=True)
        subprocess.run(["git", "commit", "-q", "-m", "config"], cwd=repo, check=True, env={**os.environ, **_GIT_ENV})
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    env.pop("VIRTUAL_ENV", None)
    assert PRE_COMMIT is not None
    return subprocess.run(
        [PRE_COMMIT, "run", hook, "--verbose", "--files", *files],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_fix_hook_lowers_the_status_and_env_has_no_torch(
    tmp_path: Path, pre_commit_home: Path, hook_repo: Path
) -> None:
    repo = _scratch_repo(tmp_path, {"claimed.ledger.yaml": DOWNGRADED})
    assert load(repo / "claimed.ledger.yaml").plain["status"] == "VALIDATED"

    proc = _run_installed(repo, pre_commit_home, hook_repo, "ledgerspec-fix-status", "claimed.ledger.yaml")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a fixer that changed a file fails the run
    assert "files were modified by this hook" in proc.stdout
    assert "status lowered from VALIDATED to CANDIDATE" in proc.stdout
    assert load(repo / "claimed.ledger.yaml").plain["status"] == "CANDIDATE"

    again = _run_installed(repo, pre_commit_home, hook_repo, "ledgerspec-fix-status", "claimed.ledger.yaml")
    assert "files were modified by this hook" not in again.stdout
    assert load(repo / "claimed.ledger.yaml").plain["status"] == "CANDIDATE"

    # the hook's environment holds the light core only
    envs = [p for p in pre_commit_home.rglob("py_env-*") if p.is_dir()]
    assert envs, "pre-commit built no python environment"
    for env in envs:
        (site,) = env.glob("lib/python*/site-packages")
        assert (site / "jsonschema").is_dir() and (site / "ruamel").is_dir() and (site / "ledgerspec").exists()
        for heavy in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
            assert not (site / heavy).exists(), heavy
