"""The docs speak of the product as it is (issue 13's docs drift): how to install it while it is not published, a
pre-commit pin that exists, the schema commands, what a user runs on their own GPU, the product's words only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import EXAMPLES, REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), REPO_ROOT / "README.md", REPO_ROOT / "benchmarks" / "README.md"]
USER_FACING = [
    *PAGES,
    *sorted(EXAMPLES.glob("*.yaml")),
    *sorted((REPO_ROOT / "ledgerspec").rglob("*.py")),
    *sorted((REPO_ROOT / "ledgerspec").rglob("*.yaml")),
]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_no_install_from_an_index_it_is_not_on_and_no_tag_that_does_not_exist(page: Path) -> None:
    text = _text(page)
    bare = re.search(r"pip install ['\"]?ledgerspec(\[[a-z,]+\])?['\"]?(\s|$)(?!@)", text)
    assert not (bare and " @ " not in text[bare.start() : bare.end() + 3]), "ledgerspec is not on PyPI"
    assert not re.search(r"rev:\s*v\d", text), "no release is tagged: pin a commit SHA"


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_only_the_products_words(path: Path) -> None:
    """Articles by title, never by the project's internal names for them."""
    assert not re.search(r"project seed|shared/seeds|seeds/0\d\d|seed `?0\d\d", _text(path))


def test_the_readme_lists_every_schema_and_how_to_install() -> None:
    readme = _text(REPO_ROOT / "README.md")
    assert "ledgerspec schema [ledger\\|intake\\|defs]" in readme
    assert "pip install ." in readme and "pip wheel" in readme


def test_one_schema_file_validates_alone() -> None:
    """`ledger.v1.json` embeds its definitions: no base URI, no file beside it (integration.md says so)."""
    import json

    from ledgerspec.contract.schema import schema_text

    schema = json.loads(schema_text("ledger"))
    refs = set(re.findall(r'"\$ref": "([^"#]*)#', schema_text("ledger")))
    embedded = {v.get("$id", "").rsplit("/", 1)[-1] for v in schema.get("$defs", {}).values()}
    assert refs <= embedded | {""}
    text = _text(DOCS / "integration.md")
    assert "--base-uri" not in text and "validates alone, offline" in text


def test_benchmarks_readme_says_how_to_run_the_gpu_check_on_your_own_gpu() -> None:
    text = _text(REPO_ROOT / "benchmarks" / "README.md")
    assert "## The GPU check on your own GPU" in text and "scripts/gpu-check --dry-run" in text
    assert "files_at" not in text and "`run` tool" not in text and "device time" not in text


def test_mixed_precision_and_the_audit_in_the_clis_units() -> None:
    assert "## Mixed precision" in _text(DOCS / "concepts.md")
    audit = _text(DOCS / "naive-article-audit.md")
    assert "Sizes in GiB" in audit and "ledgerspec estimate tests/data/estimate/article/llama-7b.ledger.yaml" in audit
