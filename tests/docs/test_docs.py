"""The documentation cannot rot: its commands run, the site builds strictly, generated pages are complete.

Every fenced shell block in ``docs/*.md`` and ``README.md`` whose lines are ``ledgerspec ...`` commands
runs here, page by page, in a temporary copy of ``examples/`` (commands may write files). A block is
skipped only when the comment line right above it says why:

- ``<!-- needs-gpu -->``: needs a CUDA device;
- ``<!-- not-run: REASON -->``: long-running or sets up an environment;
- ``<!-- exit: N -->``: runs, and every command in the block must exit with N (default 0).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import EXAMPLES, REPO_ROOT, run_cli

DOCS = REPO_ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), REPO_ROOT / "README.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console", "shell-session"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w-]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>needs-gpu|not-run|exit)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    lines: list[str]
    marker: str | None = None
    marker_arg: str | None = None

    @property
    def commands(self) -> list[str]:
        out = []
        for raw in self.lines:
            line = raw.strip()
            if line.startswith("$ "):
                line = line[2:]
            if line.startswith("ledgerspec ") or line.startswith("check-jsonschema "):
                out.append(line)
        return out


def blocks(page: Path) -> list[Block]:
    """Fenced blocks of ``page`` with the marker comment (if any) on the line before the fence."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group("fence"), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mk = MARKER.match(prev)
        found.append(
            Block(
                page,
                start + 1,
                m.group("lang").lower(),
                body,
                mk.group("kind") if mk else None,
                mk.group("arg") if mk else None,
            )
        )
        i += 1
    return found


def shell_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL_LANGS]


def _page_id(p: Path) -> str:
    return p.relative_to(REPO_ROOT).as_posix()


# -- the markers themselves ---------------------------------------------------------------------------
def test_block_parser_reads_markers(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n\n<!-- exit: 1 -->\n```bash\nledgerspec validate x.yaml  # why\n```\n\n"
        "<!-- not-run: slow -->\n```bash\nledgerspec measure x\n```\n```yaml\nledgerspec: ledger/v1\n```\n",
        encoding="utf-8",
    )
    got = blocks(page)
    assert [(b.lang, b.marker, b.marker_arg, b.commands) for b in got] == [
        ("bash", "exit", "1", ["ledgerspec validate x.yaml  # why"]),
        ("bash", "not-run", "slow", ["ledgerspec measure x"]),
        ("yaml", None, None, []),
    ]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_shell_block_is_runnable_or_marked(page: Path) -> None:
    """A shell block with a ledgerspec command holds only commands the test can run, or says why not."""
    for b in shell_blocks(page):
        if not any(c.startswith("ledgerspec ") for c in b.commands):
            continue  # not a ledgerspec block (e.g. the README's set-up scripts, which CI runs itself)
        runnable = [ln for ln in b.lines if ln.strip() and not ln.strip().startswith("#")]
        if b.marker in ("needs-gpu", "not-run"):
            if b.marker == "not-run":
                assert b.marker_arg, f"{_page_id(page)}:{b.line}: `not-run` needs a reason"
            continue
        assert len(runnable) == len(b.commands), (
            f"{_page_id(page)}:{b.line}: shell block with lines the docs test cannot run: {runnable}; "
            "mark it <!-- not-run: reason --> or <!-- needs-gpu -->"
        )


def test_the_docs_have_commands_to_run() -> None:
    """Guard against a parser that silently finds nothing."""
    commands = [
        c for p in PAGES for b in shell_blocks(p) if b.marker not in ("needs-gpu", "not-run") for c in b.commands
    ]
    assert len(commands) >= 20
    for sub in ("validate", "init", "resolve", "report", "schema"):
        assert any(c.startswith(f"ledgerspec {sub}") or f" {sub} " in c for c in commands), sub


# -- running the commands -----------------------------------------------------------------------------
def _run(command: str, cwd: Path) -> tuple[int, str]:
    words = shlex.split(command, comments=True)
    target = None
    if ">" in words:
        at = words.index(">")
        words, target = words[:at], words[at + 1]
    if words[0] == "ledgerspec":
        code, out, err = run_cli(*words[1:])
    else:
        exe = Path(sys.executable).parent / words[0]
        proc = subprocess.run([str(exe), *words[1:]], capture_output=True, text=True, cwd=cwd, timeout=120)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    if target is not None:
        (cwd / target).write_text(out, encoding="utf-8")
    return code, out + err


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if any(b.marker not in ("needs-gpu", "not-run") and b.commands for b in shell_blocks(p))],
    ids=_page_id,
)
def test_documented_commands_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs_estimate_cache: Path
) -> None:
    """Every command of the page, in order, in a fresh copy of the examples; exit codes as documented. The
    estimates go through one estimate cache for the pages, as a user's repeated commands do (docs: "The estimate
    cache").

    The cache's folder is the one ``LEDGERSPEC_CACHE_DIR`` would name, given without changing the environment: a
    launch whose environment differs from the fork server's starts a fresh Python instead of a fork
    (:mod:`ledgerspec.derivations.measure.launch`), and set here the variable made each of measure.md's two
    ``measure`` children import the stack afresh (about 6 s of CPU each). The estimate's own forks (its parallel
    probe, a sweep's workers) are forks of this process and read the same folder."""
    from ledgerspec.derivations.estimate import cache

    shutil.copytree(EXAMPLES, tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cache, "default_dir", lambda: docs_estimate_cache)
    for b in shell_blocks(page):
        if b.marker in ("needs-gpu", "not-run"):
            continue
        want = int(b.marker_arg or 0) if b.marker == "exit" else 0
        for command in b.commands:
            code, output = _run(command, tmp_path)
            assert "Traceback" not in output, f"{_page_id(page)}:{b.line}: `{command}`\n{output}"
            assert code == want, f"{_page_id(page)}:{b.line}: `{command}` exited {code}, not {want}\n{output}"


@pytest.fixture(scope="session")
def docs_estimate_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("estimate-cache")


# -- the site -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def _schemas() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted((REPO_ROOT / "schema").glob("*.json"))}


def _properties(node: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """Every property schema under ``node`` (object properties, recursively, and array items)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not isinstance(node, dict):
        return out
    for key in ("properties", "patternProperties"):
        for name, prop in (node.get(key) or {}).items():
            out.append((f"{where}/{name}", prop))
            out += _properties(prop, f"{where}/{name}")
    if isinstance(node.get("items"), dict):
        out += _properties(node["items"], f"{where}/items")
    return out


def _described(prop: dict[str, Any], schemas: dict[str, dict[str, Any]]) -> bool:
    if str(prop.get("description", "")).strip():
        return True
    ref = prop.get("$ref")
    if isinstance(ref, str):  # a bare reference inherits the referenced definition's description
        file, _, pointer = ref.partition("#")
        target: Any = schemas.get(file or "defs.v1.json", {})
        for part in pointer.strip("/").split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return bool(str(target.get("description", "")).strip())
    return False


def test_every_schema_property_has_a_description() -> None:
    schemas = _schemas()
    assert {"ledger.v1.json", "intake.v1.json", "defs.v1.json"} <= set(schemas)
    missing = []
    checked = 0
    for name, schema in schemas.items():
        roots = [("", schema), *((f"/$defs/{k}", v) for k, v in schema.get("$defs", {}).items())]
        for where, root in roots:
            for path, prop in _properties(root, f"{name}#{where}"):
                checked += 1
                if not _described(prop, schemas):
                    missing.append(path)
    assert checked > 150
    assert not missing, f"schema properties without a description: {missing}"


def test_description_check_catches_a_missing_description() -> None:
    schema = {"properties": {"a": {"description": "x", "type": "object", "properties": {"b": {"type": "string"}}}}}
    props = _properties(schema, "t")
    assert [p for p, s in props if not _described(s, {})] == ["t/a/b"]


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_site_builds_strictly(site: Path) -> None:
    for page in (
        "index",
        "quickstart",
        "concepts",
        "fields",
        "rules",
        "cli",
        "resolver",
        "estimate",
        "measure",
        "multi-gpu",
        "gallery",
        "naive-article-audit",
        "integration",
        "versioning",
        "changelog",
    ):
        assert (site / f"{page}.html").is_file(), page


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_no_external_loads_in_the_site(site: Path) -> None:
    loads = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    for page in site.glob("*.html"):
        assert not loads.search(page.read_text(encoding="utf-8")), page.name
    for page in (site / "reports").glob("*.html"):
        assert not loads.search(page.read_text(encoding="utf-8")), page.name


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_field_reference_lists_every_schema_key(site: Path) -> None:
    page = _text((site / "fields.html").read_text(encoding="utf-8"))
    ledger = _schemas()["ledger.v1.json"]
    for path, prop in _properties(ledger, ""):
        if "/value" in path or "^x-" in path:
            continue
        key = path.strip("/").split("/", 1)[-1].replace("/", ".")
        assert key in page, key
        first_words = " ".join(str(prop.get("description", "")).split()[:4])
        assert _text(first_words.replace("`", "")) in page.replace("`", ""), key


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_rule_catalogue_shows_every_rule_with_its_real_finding(site: Path) -> None:
    from ledgerspec.checks.catalogue import all_rules

    page = _text((site / "rules.html").read_text(encoding="utf-8"))
    assert "does not trigger its rule" not in page
    for r in all_rules():
        assert f"{r.id}" in page and r.hint.split("`")[0][:30] in page, r.id
        assert re.search(rf"example\.yaml:\d+:\d+: {r.id} ", page), r.id


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_gallery_has_every_example_and_its_report(site: Path) -> None:
    page = (site / "gallery.html").read_text(encoding="utf-8")
    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert f'src="reports/{path.stem}.html"' in page, path.name
        report = site / "reports" / f"{path.stem}.html"
        assert report.is_file()
        html = report.read_text(encoding="utf-8")
        assert "<svg" in html or "No component has a known size yet" in html
        _code, out, _ = run_cli("validate", "--format", "json", str(path))
        status = json.loads(out)["files"][0]["supported_status"]
        assert f"status {status}" in _text(page), path.name


@pytest.mark.xdist_group("docs-site")  # the built site, once
def test_cli_page_has_every_command(site: Path) -> None:
    from ledgerspec.faces.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    page = _text((site / "cli.html").read_text(encoding="utf-8"))
    choices: dict[str, Any] = getattr(sub, "choices", {})
    assert {"validate", "schema", "init", "report"} <= set(choices)
    for name in choices:
        assert f"ledgerspec {name}" in page, name
