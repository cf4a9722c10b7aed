"""The committed JSON Schema: generated from the field catalogue, valid draft 2020-12, documented, usable by a
third-party validator offline, printed by the CLI and shipped inside the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from ledgerspec.contract import schema_gen
from ledgerspec.contract.schema import SCHEMA_FILES, load_schema
from tests.support import BAD, CASES, EXAMPLES, REPO_ROOT, CliRunner

SCHEMA_DIR = REPO_ROOT / "schema"
NAMES = sorted(SCHEMA_FILES)
CHECK_JSONSCHEMA = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or shutil.which(
    "check-jsonschema"
)


def _committed(name: str) -> str:
    return (SCHEMA_DIR / SCHEMA_FILES[name]).read_text(encoding="utf-8")


def test_committed_schema_equals_generated(tmp_path: Path) -> None:
    """Regenerating from ``fields.py`` gives the committed bytes (run ``python -m ...schema_gen`` if not)."""
    assert schema_gen.main([str(tmp_path)]) == 0
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == sorted(SCHEMA_FILES.values())
    for name in generated:
        assert (tmp_path / name).read_bytes() == (SCHEMA_DIR / name).read_bytes(), name


@pytest.mark.parametrize("name", NAMES)
def test_schema_passes_the_2020_12_metaschema(name: str) -> None:
    schema = json.loads(_committed(name))
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(SCHEMA_FILES[name])
    Draft202012Validator.check_schema(schema)
    # the metaschema's own validator, with format checks on, finds nothing either
    meta = Draft202012Validator(Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER)
    assert [e.message for e in meta.iter_errors(schema)] == []


def _properties(node: Any, where: str = "#") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, sub in (node.get("properties") or {}).items():
            yield f"{where}/properties/{key}", sub
        for key, value in node.items():
            if key != "if":  # an `if` condition restates a property to test it; it defines nothing
                yield from _properties(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _properties(value, f"{where}/{i}")


@pytest.mark.parametrize("name", NAMES)
def test_every_property_has_a_description(name: str) -> None:
    props = list(_properties(json.loads(_committed(name))))
    assert len(props) >= (4 if name == "defs" else 50)
    missing = [where for where, sub in props if not (isinstance(sub, dict) and str(sub.get("description", "")).strip())]
    assert missing == []


def test_memory_descriptions_name_units_and_sources() -> None:
    ledger = json.loads(_committed("ledger"))
    frozen = ledger["properties"]["ledger"]["properties"]["frozen_base"]["description"]
    for word in ("GiB", "MEASURED", "CALCULATED", "ASSUMPTION"):
        assert word in frozen


def _documents(kind: str) -> list[Path]:
    files = sorted(EXAMPLES.glob(f"*.{kind}.yaml")) + sorted(CASES.rglob(f"*.{kind}.yaml"))
    files += sorted((BAD / "accepted").glob(f"*.{kind}.yaml"))
    return files


def _check_jsonschema(schema: str, *files: Path) -> subprocess.CompletedProcess[str]:
    assert CHECK_JSONSCHEMA, "check-jsonschema is a [dev] dependency"
    # a dead proxy: the schema's relative $ref must resolve from the file itself, never over the network
    env = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    return subprocess.run(
        [CHECK_JSONSCHEMA, "--no-cache", "--schemafile", str(SCHEMA_DIR / schema), *map(str, files)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow  # starts check-jsonschema processes: the full suite, not the edit loop
@pytest.mark.parametrize(("kind", "schema"), [("ledger", "ledger.v1.json"), ("intake", "intake.v1.json")])
def test_check_jsonschema_accepts_the_examples(kind: str, schema: str) -> None:
    files = [p for p in _documents(kind) if p.parent == EXAMPLES or p.parent.name == "accepted"]
    assert len(files) >= 2
    proc = _check_jsonschema(schema, *files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok -- validation done" in proc.stdout


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_check_jsonschema_agrees_with_our_schema_step_on_every_case() -> None:
    """Every ledger in examples/ and tests/cases/ that our schema step accepts, check-jsonschema accepts too."""
    from ledgerspec.checks.schema_check import schema_hits
    from ledgerspec.contract.document import load

    clean = [p for p in _documents("ledger") if not list(schema_hits(load(p)))]
    assert len(clean) >= 5
    proc = _check_jsonschema("ledger.v1.json", *clean)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # starts check-jsonschema processes: the full suite, not the edit loop
@pytest.mark.parametrize("bad", ["unit_gibb", "typo_top_key", "unknown_source", "negative_size", "wrong_types"])
def test_check_jsonschema_rejects_a_bad_ledger(bad: str) -> None:
    path = BAD / f"{bad}.ledger.yaml"
    proc = _check_jsonschema("ledger.v1.json", path)
    assert proc.returncode == 1, proc.stdout
    assert "Schema validation errors were encountered" in proc.stdout
    assert str(path) in proc.stdout


@pytest.mark.slow  # starts check-jsonschema processes: the full suite, not the edit loop
def test_check_jsonschema_rejects_a_ledger_as_intake() -> None:
    proc = _check_jsonschema("intake.v1.json", EXAMPLES / "llama-2-7b-lora.ledger.yaml")
    assert proc.returncode == 1


@pytest.mark.parametrize("name", NAMES)
def test_cli_prints_the_committed_schema(name: str, cli: CliRunner) -> None:
    code, out, err = cli("schema", name)
    assert (code, err) == (0, "")
    assert out == _committed(name)
    assert json.loads(out) == load_schema(name)


def test_cli_schema_defaults_to_ledger(cli: CliRunner) -> None:
    assert cli("schema")[1] == _committed("ledger")


@pytest.mark.slow
def test_schema_ships_inside_the_wheel(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO_ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "hatchling" in proc.stderr and "No matching distribution" in proc.stderr:
        pytest.skip("no package index to fetch the build backend from")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = wheels.glob("ledgerspec-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for file in SCHEMA_FILES.values():
            assert f"ledgerspec/_schema/{file}" in names
            assert zf.read(f"ledgerspec/_schema/{file}") == (SCHEMA_DIR / file).read_bytes()
        zf.extractall(tmp_path / "site")
    # import the installed copy (not this checkout) and load every schema through the public function
    site = tmp_path / "site"
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import ledgerspec; "
        "from ledgerspec.contract.schema import load_schema, schema_dir; "
        "assert ledgerspec.__file__.startswith(sys.argv[1]), ledgerspec.__file__; "
        "print(json.dumps([str(schema_dir()), [load_schema(n)['$id'] for n in ('ledger', 'intake', 'defs')]]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert run.returncode == 0, run.stderr
    where, ids = json.loads(run.stdout)
    assert where == str(site / "ledgerspec" / "_schema")
    assert ids == [load_schema(n)["$id"] for n in ("ledger", "intake", "defs")]
