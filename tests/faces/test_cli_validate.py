"""``ledgerspec validate`` (exit codes, text/json/github/sarif, --fix), ``schema`` and ``init``: the CLI contract."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ledgerspec.checks.catalogue import all_rules
from ledgerspec.checks.findings import ERROR, Finding
from ledgerspec.checks.validate import Report
from ledgerspec.contract import fields as F
from ledgerspec.contract.document import load
from ledgerspec.contract.schema import schema_dir
from ledgerspec.faces.reporters import REPORTERS
from tests.support import BAD, EXAMPLES, REPO_ROOT, TESTS, CliRunner

DATA = TESTS / "data"
CASES = TESTS / "cases" / "rules"
OK_FILE = EXAMPLES / "llama-2-7b-lora.ledger.yaml"
BAD_FILE = EXAMPLES / "naive-article-audit.ledger.yaml"
DOWNGRADED = EXAMPLES / "downgraded.ledger.yaml"


def line_of(path: Path, needle: str, after: str | None = None) -> int:
    """1-based number of the first line containing ``needle`` (after the line that is exactly ``after``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, text in enumerate(lines) if text == after) if after else 0
    return next(i for i in range(start, len(lines)) if needle in lines[i]) + 1


# -- exit codes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "code"),
    [
        ([OK_FILE], 0),
        ([EXAMPLES / "llama-2-7b-lora.intake.yaml"], 0),
        ([EXAMPLES / "14b-qlora.intake.yaml"], 0),  # warnings and info only: valid, just INSUFFICIENT DATA
        ([BAD_FILE], 1),
        ([DOWNGRADED], 1),
        ([OK_FILE, BAD_FILE], 1),
        ([OK_FILE, "does/not/exist.ledger.yaml"], 2),
        ([BAD_FILE, "does/not/exist.ledger.yaml"], 2),
    ],
    ids=["calculated", "intake", "14b-qlora", "audit", "downgraded", "ok+bad", "ok+missing", "bad+missing"],
)
def test_exit_codes(cli: CliRunner, files: list[Any], code: int) -> None:
    assert cli("validate", *files)[0] == code


def test_unreadable_file_gets_exit_2_and_one_line_naming_it(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "latin1.ledger.yaml"
    path.write_bytes("ledgerspec: ledger/v1\ntitle: caf\xe9\n".encode("latin-1"))
    code, out, err = cli("validate", path)
    assert code == 2
    assert re.search(rf"^{re.escape(str(path))}:2:\d+: load: error: invalid UTF-8", out, re.M), out
    assert "Traceback" not in out + err


@pytest.mark.parametrize("args", [("validate",), ("validate", "--format", "xml", str(OK_FILE)), ("nonsense",)])
def test_usage_errors_exit_2(cli: CliRunner, args: tuple[str, ...]) -> None:
    code, _, err = cli(*args)
    assert code == 2
    assert "usage" in err and "Traceback" not in err


def test_a_flag_that_took_the_file_is_named(cli: CliRunner) -> None:
    """``--devices`` takes an optional CATALOGUE: written before the ledger, it takes the ledger."""
    code, out, err = cli("estimate", "--devices", OK_FILE)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"required: FILE (--devices took '{OK_FILE}' as its CATALOGUE; if it is the FILE, write it before" in err
    assert f"`ledgerspec estimate {OK_FILE} --devices ...`, or --devices=CATALOGUE)" in err
    assert "took" not in cli("estimate")[2]  # FILE simply missing: nothing taken


def test_text_format_names_file_line_and_rule(cli: CliRunner) -> None:
    _, out, _ = cli("validate", BAD_FILE)
    line = line_of(BAD_FILE, "  parameters:", after="gradients:")
    assert f"{BAD_FILE}:{line}:3: LS020: error: gradients.parameters 7,000,000,000 exceeds" in out
    assert "INVALID" in out and "info finding(s) hidden" in out
    assert "LS002" not in out  # info is shown with -v only
    assert "LS002" in cli("validate", "-v", BAD_FILE)[1]


def test_the_same_document_reads_the_same_on_every_run(tmp_path: Path) -> None:
    """A CI diff or a golden file needs the same output for the same input: the UNKNOWN intake fields that hold a
    CANDIDATE below VALIDATED are listed in catalogue order, whatever the interpreter's string hashing (a set of
    section names once listed them in a different order from one process to the next)."""
    text = (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").read_text(encoding="utf-8")
    for section, field in (("software", "trl"), ("workload", "padding_free"), ("optimizer", "paged")):
        text = text.replace(f"\n{section}:\n", f"\n{section}:\n  {field}: UNKNOWN\n", 1)
    text = text.replace("config_path: configs/", f"config_path: {EXAMPLES.as_posix()}/configs/", 1)
    doc = tmp_path / "unknowns.ledger.yaml"
    doc.write_text(text, encoding="utf-8")

    def run(seed: int) -> str:
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(
            [sys.executable, "-m", "ledgerspec", "validate", "-v", str(doc)],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    outputs = {run(seed) for seed in range(6)}
    assert len(outputs) == 1
    assert "no UNKNOWN in the intake (software.trl, workload.padding_free, optimizer.paged)" in outputs.pop()


# -- --format json ---------------------------------------------------------------------------------

SPEC_FILE_KEYS = ["path", "kind", "ok", "declared_status", "supported_status", "reasons", "findings"]
SPEC_FINDING_KEYS = ["rule", "severity", "pointer", "line", "column", "message"]


def test_json_report_has_the_spec_shape(cli: CliRunner) -> None:
    code, out, _ = cli("validate", "--format", "json", OK_FILE, BAD_FILE, EXAMPLES / "14b-qlora.intake.yaml")
    assert code == 1
    report = json.loads(out)
    assert list(report) == ["files"]
    paths = [str(OK_FILE), str(BAD_FILE), str(EXAMPLES / "14b-qlora.intake.yaml")]
    assert [f["path"] for f in report["files"]] == paths
    for entry in report["files"]:
        # the spec's keys, in its order; `intake_complete` is this implementation's one addition
        assert list(entry)[: len(SPEC_FILE_KEYS)] == SPEC_FILE_KEYS
        assert set(entry) - set(SPEC_FILE_KEYS) == {"intake_complete", "verdict"}
        assert isinstance(entry["ok"], bool) and isinstance(entry["reasons"], list)
        assert entry["supported_status"] in F.STATUSES
        for finding in entry["findings"]:
            assert list(finding) == SPEC_FINDING_KEYS
            assert finding["severity"] in ("error", "warning", "info")
            assert finding["pointer"].startswith("/")
            assert isinstance(finding["line"], int) and finding["line"] >= 1
            assert isinstance(finding["column"], int) and finding["column"] >= 1
    ok, bad, intake = report["files"]
    assert (ok["kind"], ok["ok"], ok["declared_status"], ok["supported_status"]) == (
        "ledger",
        True,
        "CALCULATED",
        "CALCULATED",
    )
    assert (bad["ok"], bad["declared_status"], bad["supported_status"]) == (False, "CALCULATED", "INSUFFICIENT DATA")
    assert (intake["kind"], intake["ok"], intake["supported_status"]) == ("intake", True, "INSUFFICIENT DATA")
    assert intake["intake_complete"] is False


def test_json_findings_point_at_the_right_lines(cli: CliRunner) -> None:
    entry = json.loads(cli("validate", "--format", "json", BAD_FILE)[1])["files"][0]
    by_rule = {(f["rule"], f["pointer"]): f for f in entry["findings"]}
    lines = BAD_FILE.read_text(encoding="utf-8").splitlines()
    for (rule, pointer), f in by_rule.items():
        key = pointer.rsplit("/", 1)[-1]
        assert lines[f["line"] - 1][f["column"] - 1 :].startswith(key + ":"), (rule, pointer, f["line"])
    assert ("LS020", "/gradients/parameters") in by_rule
    assert ("LS021", "/optimizer/optimized_parameters") in by_rule
    assert ("LS022", "/ledger/adapter") in by_rule
    assert ("LS001", "/status") in by_rule


def test_json_reports_an_unreadable_file_as_an_entry(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "dup.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nstatus: CALCULATED\nstatus: VALIDATED\n", encoding="utf-8")
    code, out, _ = cli("validate", "--format", "json", path)
    assert code == 2
    (entry,) = json.loads(out)["files"]
    assert (entry["path"], entry["kind"], entry["ok"], entry["supported_status"]) == (str(path), None, False, None)
    (finding,) = entry["findings"]
    assert finding["rule"] == "load" and finding["severity"] == "error" and finding["line"] == 3
    assert "duplicate key" in finding["message"]


# -- --format github -------------------------------------------------------------------------------

GH_LINE = re.compile(
    r"^::(error|warning|notice) file=(?P<file>[^,:]+),line=(?P<line>\d+),col=(?P<col>\d+),"
    r"title=(?P<title>[A-Za-z0-9]+)::(?P<message>[^\r\n]+)$"
)


def test_github_annotations_are_workflow_commands(cli: CliRunner) -> None:
    code, out, _ = cli("validate", "--format", "github", BAD_FILE)
    assert code == 1
    lines = out.splitlines()
    assert lines and all(GH_LINE.match(line) for line in lines), out
    report = json.loads(cli("validate", "--format", "json", BAD_FILE)[1])["files"][0]
    shown = [f for f in report["findings"] if f["severity"] != "info"]
    assert len(lines) == len(shown)
    for line, f in zip(lines, shown, strict=True):
        m = GH_LINE.match(line)
        assert m is not None
        level = {"error": "error", "warning": "warning"}[f["severity"]]
        assert line.startswith(f"::{level} ")
        assert (m["file"], int(m["line"]), int(m["col"]), m["title"]) == (
            str(BAD_FILE),
            f["line"],
            f["column"],
            f["rule"],
        )
    verbose = cli("validate", "--format", "github", "-v", BAD_FILE)[1]
    assert any(line.startswith("::notice ") and "title=LS002" in line for line in verbose.splitlines())


def test_github_escapes_data_and_properties() -> None:
    import io

    finding = Finding("LS999", ERROR, "/x", "100% wrong:\nsecond line, really", 3, 4)
    report = Report("dir,with:odd%name.ledger.yaml", "ledger", None, "CALCULATED", [], [finding])
    out = io.StringIO()
    REPORTERS["github"]([report], out, False)
    assert out.getvalue() == (
        "::error file=dir%2Cwith%3Aodd%25name.ledger.yaml,line=3,col=4,title=LS999::"
        "100%25 wrong:%0Asecond line, really\n"
    )


# -- --format sarif --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sarif_validator() -> Any:
    schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
    jsonschema.Draft4Validator.check_schema(schema)
    # every format jsonschema knows: the draft-04 checker would skip the schema's uri-reference (a draft-06 name)
    checker = jsonschema.FormatChecker()
    assert {"uri", "uri-reference"} <= set(checker.checkers), "pip install rfc3986-validator (ledgerspec[dev])"
    return jsonschema.Draft4Validator(schema, format_checker=checker)


def test_sarif_is_valid_against_the_official_schema(cli: CliRunner, sarif_validator: Any, tmp_path: Path) -> None:
    missing = tmp_path / "missing <#%> .ledger.yaml"  # a name the uri-reference format refuses unless encoded
    code, out, _ = cli("validate", "--format", "sarif", "-v", BAD_FILE, DOWNGRADED, OK_FILE, missing)
    assert code == 2
    log = json.loads(out)
    errors = sorted(sarif_validator.iter_errors(log), key=str)
    assert not errors, [f"{e.json_path}: {e.message}" for e in errors[:5]]


def test_sarif_structure(cli: CliRunner) -> None:
    log = json.loads(cli("validate", "--format", "sarif", "-v", BAD_FILE)[1])
    assert log["version"] == "2.1.0"
    assert log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "ledgerspec"
    rules = driver["rules"]
    assert {r.id for r in all_rules()} <= {r["id"] for r in rules}
    for r in rules:
        assert r["shortDescription"]["text"]
        assert r["defaultConfiguration"]["level"] in ("error", "warning", "note")
    report = json.loads(cli("validate", "--format", "json", BAD_FILE)[1])["files"][0]
    assert len(run["results"]) == len(report["findings"])
    for result, f in zip(run["results"], report["findings"], strict=True):
        assert result["ruleId"] == f["rule"]
        assert rules[result["ruleIndex"]]["id"] == f["rule"]
        assert result["level"] == {"error": "error", "warning": "warning", "info": "note"}[f["severity"]]
        assert result["message"]["text"] == f["message"]
        (loc,) = result["locations"]
        assert loc["physicalLocation"]["artifactLocation"]["uri"] == BAD_FILE.as_uri()  # an absolute path: file://
        assert loc["physicalLocation"]["region"] == {"startLine": f["line"], "startColumn": f["column"]}
    ls020 = next(r for r in rules if r["id"] == "LS020")
    assert ls020["defaultConfiguration"]["level"] == "error"


# -- --fix -----------------------------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path, transform: Any = None) -> Path:
    """``src`` byte for byte into ``tmp_path``, with the example configs its ``identity.config_path`` names (LS008)."""
    if src.parent == EXAMPLES and not (tmp_path / "configs").exists():
        shutil.copytree(EXAMPLES / "configs", tmp_path / "configs")
    dst = tmp_path / src.name
    data = src.read_bytes()
    dst.write_bytes(transform(data) if transform else data)
    return dst


def _changed_lines(before: bytes, after: bytes) -> list[tuple[bytes, bytes]]:
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    assert len(a) == len(b), "--fix adds or removes no line"
    return [(x, y) for x, y in zip(a, b, strict=True) if x != y]


@pytest.mark.parametrize("variant", ["plain", "crlf+bom", "quoted", "commented"])
def test_fix_lowers_the_status_and_changes_nothing_else(cli: CliRunner, tmp_path: Path, variant: str) -> None:
    transform = {
        "plain": None,
        "crlf+bom": lambda b: b"\xef\xbb\xbf" + b.replace(b"\n", b"\r\n"),
        "quoted": lambda b: b.replace(b"\nstatus: VALIDATED\n", b"\nstatus: 'VALIDATED'\n"),
        "commented": lambda b: b.replace(b"\nstatus: VALIDATED\n", b"\nstatus: VALIDATED   # we measured it!\n"),
    }[variant]
    path = _copy(DOWNGRADED, tmp_path, transform)
    before = path.read_bytes()
    code, out, err = cli("validate", "--fix", path)
    assert code == 0, out  # LS001 and LS031 are gone once the status is honest
    assert "status lowered from VALIDATED to CANDIDATE" in err
    after = path.read_bytes()
    ((_, new),) = _changed_lines(before, after)
    text = new.decode("utf-8")
    quote = "'" if variant == "quoted" else ""
    assert text.startswith(f"status: {quote}CANDIDATE{quote}  # ledgerspec: lowered from VALIDATED: ")
    assert "measurement.device is cpu" in text
    assert text.endswith("\r\n" if variant == "crlf+bom" else "\n") and "\r" not in text.rstrip("\r\n")
    if variant == "commented":
        assert "we measured it!" in text
    if variant == "crlf+bom":
        assert after.startswith(b"\xef\xbb\xbf") and after.count(b"\r\n") == after.count(b"\n")
    doc = load(path)
    assert doc.plain["status"] == "CANDIDATE"
    # a second run is a no-op
    code, _, err = cli("validate", "--fix", path)
    assert code == 0 and err == ""
    assert path.read_bytes() == after


def test_fix_replaces_the_file_atomically_and_keeps_its_mode(cli: CliRunner, tmp_path: Path) -> None:
    path = _copy(DOWNGRADED, tmp_path)
    path.chmod(0o640)
    inode = path.stat().st_ino
    cli("validate", "--fix", path)
    assert path.stat().st_ino != inode, "the file is replaced by a rename, never rewritten in place"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "configs")
    assert left == [path.name], "no temporary file is left behind"


def test_fix_leaves_honest_files_untouched(cli: CliRunner, tmp_path: Path) -> None:
    path = _copy(OK_FILE, tmp_path)
    inode, before = path.stat().st_ino, path.read_bytes()
    assert cli("validate", "--fix", path)[0] == 0
    assert path.stat().st_ino == inode and path.read_bytes() == before


def test_fix_raises_a_status_the_evidence_supports(cli: CliRunner, tmp_path: Path) -> None:
    """Spec, "The status ladder": `validate --fix` sets the supported status up or down; raising it is one line."""
    path = _copy(OK_FILE, tmp_path, lambda b: b.replace(b"\nstatus: CALCULATED\n", b"\nstatus: INSUFFICIENT DATA\n"))
    before = path.read_bytes()
    code, out, _ = cli("validate", "-v", path)
    assert (
        code == 0 and "LS007: info: declared status INSUFFICIENT DATA is below the supported status CALCULATED" in out
    )
    code, _, err = cli("validate", "--fix", path)
    assert code == 0 and "status raised from INSUFFICIENT DATA to CALCULATED" in err
    ((old, new),) = _changed_lines(before, path.read_bytes())
    assert old == b"status: INSUFFICIENT DATA\n"
    assert new.startswith(b"status: CALCULATED  # ledgerspec: raised from INSUFFICIENT DATA: the minimum intake is ")
    assert load(path).plain["status"] == "CALCULATED"
    assert "LS007" not in cli("validate", "-v", path)[1]


def test_fix_keeps_other_errors(cli: CliRunner, tmp_path: Path) -> None:
    path = _copy(BAD_FILE, tmp_path)
    code, out, _ = cli("validate", "--fix", path)
    assert code == 1 and "LS020" in out and "LS001" not in out
    assert load(path).plain["status"] == "INSUFFICIENT DATA"
    assert (
        "status: INSUFFICIENT DATA  # ledgerspec: lowered from CALCULATED: minimum intake: identity.model_id"
        in path.read_text(encoding="utf-8")
    )


def test_fix_lowers_an_intake(cli: CliRunner, tmp_path: Path) -> None:
    path = _copy(
        EXAMPLES / "14b-qlora.intake.yaml",
        tmp_path,
        lambda b: b.replace(b"\nstatus: INSUFFICIENT DATA\n", b"\nstatus: CANDIDATE\n"),
    )
    assert cli("validate", path)[0] == 1
    assert cli("validate", "--fix", path)[0] == 0
    assert load(path).plain["status"] == "INSUFFICIENT DATA"


def test_fix_comment_counts_the_reasons_it_leaves_out(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "x.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nstatus: VALIDATED\n", encoding="utf-8")
    cli("validate", "--fix", path)
    status_line = path.read_text(encoding="utf-8").splitlines()[1]
    assert status_line.startswith("status: INSUFFICIENT DATA  # ledgerspec: lowered from VALIDATED: minimum intake:")
    assert re.search(r"\(\+\d+ more\)$", status_line)


def test_fix_of_a_flow_style_document_still_yields_a_valid_file(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "flow.ledger.yaml"
    path.write_text("{ledgerspec: ledger/v1, status: CALCULATED, title: t}\n", encoding="utf-8")
    assert cli("validate", "--fix", path)[0] == 0
    assert load(path).plain == {"ledgerspec": "ledger/v1", "status": "INSUFFICIENT DATA", "title": "t"}


# -- schema ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name"), [(("schema", "ledger"), "ledger"), (("schema", "intake"), "intake"), (("schema",), "ledger")]
)
def test_schema_prints_the_committed_schema(cli: CliRunner, args: tuple[str, ...], name: str) -> None:
    code, out, _ = cli(*args)
    assert code == 0
    printed = json.loads(out)
    assert printed == json.loads((schema_dir() / f"{name}.v1.json").read_text(encoding="utf-8"))
    assert printed["$schema"] == "https://json-schema.org/draft/2020-12/schema" and printed["$id"]


def test_schema_rejects_an_unknown_name(cli: CliRunner) -> None:
    assert cli("schema", "ledgers")[0] == 2


# -- init ------------------------------------------------------------------------------------------


def test_init_skeleton_is_valid_and_every_field_unknown(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "new.ledger.yaml"
    assert cli("init", "-o", out)[0] == 0
    text = out.read_text(encoding="utf-8")
    assert text.count("\n#") + text.count("\n  #") > 50, "the article's guidance is written as comments"
    code, report_text, _ = cli("validate", "--format", "json", out)
    assert code == 0
    (entry,) = json.loads(report_text)["files"]
    assert entry["ok"] and entry["supported_status"] == "INSUFFICIENT DATA"
    doc = load(out)
    for path, field in F.walk(F.top_fields("ledger")):
        if field.kind == F.OBJECT or path in (("status",), ("notes",)):
            continue
        value = doc.get(*path)
        assert value.present and value.raw == "UNKNOWN", f"{'.'.join(path)} is not UNKNOWN in the skeleton"
    assert doc.plain["status"] == "INSUFFICIENT DATA"


def test_init_writes_to_stdout_by_default(cli: CliRunner) -> None:
    code, out, _ = cli("init")
    assert code == 0 and "\nledgerspec: ledger/v1\n" in out


def test_init_does_not_overwrite_without_force(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "mine.ledger.yaml"
    out.write_text("precious\n", encoding="utf-8")
    code, _, err = cli("init", "-o", out)
    assert code == 2 and "exists" in err and "--force" in err
    assert out.read_text(encoding="utf-8") == "precious\n"
    assert cli("init", "-o", out, "--force")[0] == 0
    assert out.read_text(encoding="utf-8").count("UNKNOWN") > 50


def test_init_into_a_folder_says_so_at_once(cli: CliRunner, tmp_path: Path) -> None:
    """Not "file exists (pass --force)", which only led to "is a folder" on the second try."""
    for extra in ((), ("--force",)):
        code, _, err = cli("init", "-o", tmp_path, *extra)
        assert code == 2 and err.strip() == f"{tmp_path}: write: is a folder (hint: give a file name)"


def test_init_from_an_intake_copies_its_sections(cli: CliRunner, tmp_path: Path) -> None:
    intake = EXAMPLES / "llama-2-7b-lora.intake.yaml"
    out = tmp_path / "sub" / "from-intake.ledger.yaml"
    out.parent.mkdir()
    assert cli("init", "--from", intake, "-o", out)[0] == 0
    doc, src = load(out), load(intake)
    for section in ("identity", "method", "base_model", "adapter", "workload", "optimizer", "memory_options"):
        for key, value in src.plain[section].items():
            if (section, key) != ("identity", "config_path"):
                assert doc.plain[section][key] == value, f"{section}.{key}"
    # config_path is relative to its document: it still names the same config.json from the new place
    config = (out.parent / doc.plain["identity"]["config_path"]).resolve()
    assert config == (EXAMPLES / "configs" / "llama-2-7b" / "config.json").resolve()
    assert doc.plain["ledger"]["frozen_base"] == "UNKNOWN"
    assert "# Exact model repository id" in out.read_text(encoding="utf-8"), "the guidance comments stay"
    code, report_text, _ = cli("validate", "--format", "json", out)
    (entry,) = json.loads(report_text)["files"]
    assert code == 0 and entry["kind"] == "ledger" and entry["supported_status"] == "INSUFFICIENT DATA"
    assert entry["intake_complete"] is True
    assert all(r.startswith("CALCULATED needs exact figures: ledger.") for r in entry["reasons"])


@pytest.mark.parametrize("intake", sorted(p.name for p in EXAMPLES.glob("*.intake.yaml")))
def test_init_from_an_intake_keeps_its_comments(cli: CliRunner, tmp_path: Path, intake: str) -> None:
    """Never lose user data: every comment of the intake's body travels (end-of-line ones on their key's line);
    only the status line's and the header's describe the intake itself and stay behind."""
    source = (EXAMPLES / intake).read_text(encoding="utf-8").splitlines()
    body = source[next(i for i, line in enumerate(source) if line.startswith("ledgerspec:")) :]
    out = tmp_path / "l.yaml"
    assert cli("init", "--from", EXAMPLES / intake, "-o", out)[0] == 0
    text = out.read_text(encoding="utf-8")
    lines = text.splitlines()
    for line in body:
        if "#" not in line or line.startswith("status:"):
            continue
        code, _, comment = line.partition("#")
        assert f"#{comment}" in text, comment
        if code.strip():  # an end-of-line comment: still on the line of its key
            key = code.strip().split(":")[0]
            assert any(x.strip().startswith(f"{key}:") and x.endswith(f"#{comment}") for x in lines), line
    again = tmp_path / "again.yaml"
    assert cli("init", "--from", EXAMPLES / intake, "-o", again)[0] == 0
    assert again.read_text(encoding="utf-8") == text  # deterministic
    method = load(out).plain["method"]
    assert all(method[k] == v for k, v in load(EXAMPLES / intake).plain["method"].items())


@pytest.mark.parametrize(
    ("edit", "absent", "present"),
    [
        ({}, [("base_model", "quantization"), ("base_model", "prepare_for_kbit_training")], [("software", "rocm")]),
        ({"software": {"cuda": "12.8"}}, [("software", "rocm"), ("base_model", "quantization")], []),
        (
            {"method": {"kind": "QLoRA"}, "base_model": {"quantized": True}},
            [],
            [("base_model", "quantization", "type"), ("base_model", "prepare_for_kbit_training")],
        ),
    ],
)
def test_init_from_leaves_out_what_cannot_apply(
    cli: CliRunner, tmp_path: Path, edit: dict[str, Any], absent: list[tuple[str, ...]], present: list[tuple[str, ...]]
) -> None:
    """A LoRA run has no quantization and a CUDA stack no ROCm version: UNKNOWN, they would block VALIDATED."""
    data = load(EXAMPLES / "llama-2-7b-lora.intake.yaml").plain
    data["identity"]["config_path"] = str(EXAMPLES / data["identity"]["config_path"])  # it names a file (LS008)
    for section, values in edit.items():
        data.setdefault(section, {}).update(values)
    src = tmp_path / "i.intake.yaml"
    src.write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "l.yaml"
    assert cli("init", "--from", src, "-o", out)[0] == 0
    doc = load(out)
    assert all(not doc.get(*p).present for p in absent), absent
    assert all(doc.get(*p).present for p in present), present
    assert cli("validate", out)[0] == 0


def test_init_from_a_ledger_is_refused_in_one_line(cli: CliRunner) -> None:
    code, out, err = cli("init", "--from", OK_FILE)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--from expects an intake/v1 document" in err and str(OK_FILE) in err
    assert "(hint: --from takes an intake or a tool's configuration" in err


# -- validate stays light: no torch, no network ------------------------------------------------------

HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "numpy")


def test_validate_imports_no_heavy_library() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "ledgerspec",
            "validate",
            str(OK_FILE),
            str(BAD_FILE),
            "--format",
            "sarif",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    imported = {
        m.group(1).split(".")[0] for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", proc.stderr, re.M)
    }
    assert "ledgerspec" in imported and "jsonschema" in imported, "the import log was read"
    assert not imported & set(HEAVY), f"validate imported {sorted(imported & set(HEAVY))}"


@pytest.mark.slow  # the whole corpus, or a process per case: the full suite, not the edit loop
def test_validate_never_touches_the_network(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validate opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    files = sorted(EXAMPLES.glob("*.yaml")) + sorted(CASES.glob("*.yaml")) + sorted(BAD.rglob("*.yaml"))
    code, out, err = cli("validate", "--format", "sarif", *files)
    assert code == 2 and "Traceback" not in err  # the bad corpus holds unreadable files
    assert json.loads(out)["runs"][0]["results"]


@pytest.mark.parametrize(
    ("example", "verbose"),
    [("14b-qlora.intake.yaml", False), ("14b-qlora.intake.yaml", True), ("downgraded.ledger.yaml", False)],
)
def test_text_output_always_says_what_holds_the_status_down(cli: CliRunner, example: str, verbose: bool) -> None:
    """One line per kind of missing evidence (what the next status needs); every reason with -v, or when the declared
    status claims more than the evidence supports."""
    from ledgerspec.checks.ladder import RANK, supported_status
    from ledgerspec.checks.verdict import next_steps

    doc = load(EXAMPLES / example)
    res = supported_status(doc)
    _, out, _ = cli("validate", *(["-v"] if verbose else []), EXAMPLES / example)
    steps = [line[4:] for line in out.splitlines() if line.startswith("  - ")]
    every = [line[6:] for line in out.splitlines() if line.startswith("    - ")]
    assert steps == [s.line() for s in next_steps(res.reasons, str(EXAMPLES / example))]
    assert len(steps) < len(res.reasons) or example.startswith("downgraded")
    overclaimed = RANK[doc.plain["status"]] > RANK[res.status]
    if verbose or overclaimed:
        assert every == res.reasons
    else:
        assert every == [] and f"({len(res.reasons)} reasons in all; -v lists each)" in out
