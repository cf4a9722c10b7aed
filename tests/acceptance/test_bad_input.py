"""Malformed input: every file in ``tests/bad/`` is refused with one clear line, FILE:LINE:COL, no traceback.

Each case names the exit code (2: unreadable input, refused by the loader; 1: readable but invalid),
the rule that reports it, the line it points at (counted by hand from the file) and a phrase of
the message. ``tests/bad/accepted/`` holds odd-but-legal files (CRLF, BOM) that must be accepted.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.loader import MAX_FILE_BYTES, MAX_NODES
from tests.support import BAD, CliRunner
from tests.support import REPO_ROOT as REPO
from tests.support.entry_points import ENTRY_POINTS, Run, check_run, is_printable, run_entry, sarif_errors

# file -> (exit code, rule, line, phrase in the message)
CASES: dict[str, tuple[int, str, int, str]] = {
    "empty": (2, "load", 1, "empty document"),
    "only_comment": (2, "load", 1, "empty document"),
    "document_end_marker_only": (2, "load", 1, "empty document"),
    "list_at_top": (2, "load", 1, "is a list, not a mapping"),
    "scalar_at_top": (2, "load", 1, "not a mapping"),
    "duplicate_keys": (2, "load", 6, 'duplicate key "rank"'),
    "alias_bomb": (2, "load", 3, "anchors (&lol1) are not allowed"),
    "anchor_alias": (2, "load", 4, "anchors (&r) are not allowed"),
    "anchor_only": (2, "load", 3, "anchors (&m) are not allowed"),
    "merge_key": (2, "load", 3, "anchors (&base) are not allowed"),
    "tab_indentation": (2, "load", 4, "indent with spaces, not tabs"),
    "bad_indentation": (2, "load", 5, "expected <block end>"),
    "invalid_utf8": (2, "load", 3, "invalid UTF-8 byte 0xe9"),
    "utf16_bom": (2, "load", 1, "UTF-16"),
    "utf16le_no_bom": (2, "load", 1, "NUL character"),
    "nul_bytes": (2, "load", 3, "NUL character"),
    "control_char": (2, "load", 3, "control character U+0007"),
    "python_tag": (2, "load", 3, "explicit YAML tags (tag:yaml.org,2002:python/object/apply:os.system)"),
    "python_name_tag": (2, "load", 3, "python/name:os.system"),
    "binary_tag": (2, "load", 3, "explicit YAML tags (tag:yaml.org,2002:binary)"),
    "custom_tag": (2, "load", 4, "explicit YAML tags (!int)"),
    "set_tag": (2, "load", 4, "explicit YAML tags (tag:yaml.org,2002:set)"),
    "multiple_documents": (2, "load", 3, "a ledger file holds one YAML document"),
    "yaml_directive_2": (2, "load", 1, "version 1.* is required"),
    "unterminated_quote": (2, "load", 3, "quoted scalar"),
    "unclosed_flow": (2, "load", 3, "flow mapping"),
    "bad_escape": (2, "load", 3, "unknown escape character 'q'"),
    "lone_surrogate": (2, "load", 3, "lone surrogate U+D800"),
    "int_key": (2, "load", 4, "key 16 is not a string"),
    "null_key": (2, "load", 4, "key None is not a string"),
    "complex_key": (2, "load", 4, "a list or mapping used as a key"),
    "list_of_mapping_key": (2, "load", 4, "a list or mapping used as a key"),
    "merge_inline": (2, "load", 4, "merge keys (<<) are not allowed"),
    "date_key": (2, "load", 3, "is not a string"),
    "deep_flow": (2, "load", 3, "nesting deeper than 32 levels"),
    # the root mapping is depth 1 (line 1); k0 sits on line 3 and the mapping at depth d starts on line d + 2
    "deep_block": (2, "load", 35, "nesting deeper than 32 levels"),
    "giant_int_10e400": (2, "load", 4, "integer of about 401 digits is too large"),
    "giant_int_5000_digits": (2, "load", 4, "5000 digits"),
    "version_v2": (1, "header", 1, "unsupported version 'ledger/v2'"),
    # issue 15: int() of over 4,300 digits used to raise ValueError (an internal error) in every command
    "header_version_5000_digits": (1, "header", 1, "unsupported version 'ledger/v111"),
    "unknown_kind": (1, "header", 1, "unknown document kind 'budget/v1'"),
    "header_not_string": (1, "header", 1, "unknown document kind 1"),
    "missing_header": (1, "header", 1, "missing header"),
    "wrong_types": (1, "schema", 5, "method.rank: expected an integer >= 1, got 'sixteen'"),
    "section_is_list": (1, "schema", 3, "method must be a mapping"),
    "unit_gibb": (1, "schema", 4, "unknown unit 'GiBB'"),
    "unit_lowercase_gb": (1, "schema", 4, "did you mean GB?"),
    "unit_bytes_fraction": (1, "schema", 4, "unknown unit 'bytes'"),
    "fractional_bytes": (1, "schema", 4, "not a whole number of bytes"),
    "negative_size": (1, "schema", 4, "negative size -1024"),
    "negative_size_unit": (1, "schema", 4, "negative size '-2 GiB'"),
    "negative_count": (1, "schema", 4, "workload.microbatch: expected an integer >= 1, got -4"),
    "size_fraction_of_byte": (1, "schema", 4, "'0.5 B' is not a whole number of bytes"),
    "size_over_exbibyte": (1, "schema", 4, "is larger than 1 EiB"),
    "giant_float_1e400": (1, "schema", 4, "inf is not a size"),
    "nan_size": (1, "schema", 4, "nan is not a size"),
    "typo_top_key": (1, "schema", 3, "unknown key 'ledgr' (did you mean 'ledger'?)"),
    "typo_section_key": (1, "schema", 4, "unknown key 'rnak' (did you mean 'rank'?)"),
    "unknown_source": (1, "schema", 4, "unknown source 'GUESSED'"),
    "long_form_no_source": (1, "schema", 4, "a long-form value needs `source`"),
    "long_form_stray_key": (1, "schema", 4, "unknown key(s) 'unit'"),
    "unknown_status": (1, "schema", 2, "'DONE' is not one of"),
    "enum_typo": (1, "schema", 4, "did you mean 'QLoRA'?"),
    "enum_in_capitals": (
        1,
        "schema",
        4,
        "'DPO' is not one of sft, dpo, kto, orpo, cpo, grpo, rloo, ppo, reward (did you mean 'dpo'?)",
    ),
    "unknown_in_lower_case": (1, "schema", 4, "got 'unknown' (UNKNOWN is written in capitals)"),
    # not a typo (no did-you-mean 'title'): the other kind's section
    "pilot_in_a_ledger": (1, "schema", 2, "'pilot' (a section of an intake/v1 document, not of a ledger/v1 one)"),
    # YAML reads a bare 4.50 as the number 4.5: the message shows it as written and says to quote it
    "version_as_number": (
        1,
        "schema",
        4,
        "expected a string, got the number 4.50; quote it to keep it as written: '4.50'",
    ),
    # issue 15: hostile strings; report used to fail on them (KeyError, MarkupError) or print them raw
    "source_is_a_status": (1, "schema", 5, "unknown source 'CANDIDATE'"),
    "rich_markup": (1, "schema", 6, "unknown source '[/red]'"),
    "terminal_escapes": (1, "schema", 6, "unknown source '\\x1b[31mCALCULATED'"),
    # issue 15: init --from used to fail with TypeError ('CommentToken' object is not iterable)
    "scalar_with_comment": (1, "schema", 3, "adapter must be a mapping of keys (got 'float32')"),
}

ACCEPTED = sorted(p.name for p in (BAD / "accepted").iterdir())


def _bad(name: str) -> Path:
    return BAD / f"{name}.ledger.yaml"


def _check_output(path: Path, code: int, out: str, expect: tuple[int, str, int, str]) -> None:
    want_code, rule, line, phrase = expect
    assert code == want_code, out
    assert "Traceback" not in out, out
    hits = [ln for ln in out.splitlines() if ln.startswith(f"{path}:{line}:") and f" {rule}: " in ln]
    assert any(phrase in ln for ln in hits), f"no `{path}:{line}:COL: {rule}` line with {phrase!r} in:\n{out}"
    for ln in out.splitlines():  # one line per problem: each names the file, none is a dump
        assert ln.startswith((str(path), "  ")) or not ln.strip(), ln
        assert len(ln) < 1200, ln[:200]
    if want_code == 2:  # a refused file gives exactly one line
        assert len([ln for ln in out.splitlines() if ln.strip()]) == 1, out


def test_corpus_is_complete() -> None:
    on_disk = {p.name.removesuffix(".ledger.yaml") for p in BAD.glob("*.ledger.yaml")}
    assert on_disk == set(CASES), on_disk ^ set(CASES)
    assert len(CASES) >= 25
    assert CORE <= set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_is_refused_with_its_line(name: str, cli: CliRunner) -> None:
    path = _bad(name)
    code, out, err = cli("validate", path)
    _check_output(path, code, out + err, CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_json_report_names_file_and_line(name: str, cli: CliRunner) -> None:
    import json

    want_code, rule, line, _ = CASES[name]
    code, out, _err = cli("validate", "--format", "json", _bad(name))
    assert code == want_code
    (entry,) = json.loads(out)["files"]
    assert entry["path"] == str(_bad(name)) and entry["ok"] is False
    assert any(f["rule"] == rule and f["line"] == line and f["severity"] == "error" for f in entry["findings"])


@pytest.mark.parametrize("name", ACCEPTED)
def test_crlf_and_bom_are_accepted(name: str, cli: CliRunner) -> None:
    path = BAD / "accepted" / name
    raw = path.read_bytes()
    assert b"\r\n" in raw or raw.startswith(b"\xef\xbb\xbf")
    code, out, err = cli("validate", path)
    assert code == 0, out + err
    assert "error" not in out + err


def test_crlf_bom_values_read_like_lf(tmp_path: Path) -> None:
    from ledgerspec.contract.document import load

    crlf = load(BAD / "accepted" / "crlf_bom.ledger.yaml")
    lf = tmp_path / "lf.ledger.yaml"
    lf.write_bytes((BAD / "accepted" / "crlf_bom.ledger.yaml").read_bytes()[3:].replace(b"\r\n", b"\n"))
    assert crlf.plain == load(lf).plain
    assert crlf.plain["method"] == {"kind": "LoRA", "rank": 16}
    assert crlf.position("/method/rank") == (8, 3)  # the BOM shifts no column, CR adds no line


def test_twenty_megabyte_file_is_refused_before_parsing(tmp_path: Path, cli: CliRunner) -> None:
    path = tmp_path / "huge.ledger.yaml"
    with path.open("w", encoding="utf-8") as fh:
        fh.write("ledgerspec: ledger/v1\n")
        fh.writelines(f"x-filler-{i}: {'a' * 1000}\n" for i in range(20 * 1024))
    assert path.stat().st_size > 20 * 10**6
    code, out, _ = cli("validate", path)
    assert code == 2
    assert f"{path}:1:1: load: error: file is {path.stat().st_size} bytes, over the {MAX_FILE_BYTES}-byte limit" in out


@pytest.mark.slow  # the whole corpus, or a process per case: the full suite, not the edit loop
def test_too_many_nodes_is_refused(tmp_path: Path, cli: CliRunner) -> None:
    path = tmp_path / "wide.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nx-list: [" + ", ".join(["1"] * (MAX_NODES + 10)) + "]\n")
    assert path.stat().st_size < MAX_FILE_BYTES
    code, out, _ = cli("validate", path)
    assert code == 2
    assert re.search(rf"^{re.escape(str(path))}:2:\d+: load: error: more than {MAX_NODES} YAML nodes", out, re.M)


def test_hex_integer_too_long_to_print_is_refused(tmp_path: Path, cli: CliRunner) -> None:
    # 0x + 5000 hex digits: Python can build it but not print it (int max str digits), which used to crash
    path = tmp_path / "hex.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nworkload:\n  microbatch: 0x" + "f" * 5000 + "\n")
    code, out, _ = cli("validate", path)
    assert code == 2
    assert f"{path}:3:15: load: error: integer of about 6021 digits is too large" in out


def test_impossible_date_is_refused_at_its_position(tmp_path: Path, cli: CliRunner) -> None:
    path = tmp_path / "date.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nmeasurement:\n  date: 2024-13-45\n")
    code, out, _ = cli("validate", path)
    assert code == 2
    assert f"{path}:3:9: load: error: cannot read the value '2024-13-45': month must be in 1..12" in out


def test_several_files_one_line_each(cli: CliRunner) -> None:
    names = ["empty", "duplicate_keys", "python_tag", "unit_gibb"]
    code, out, _ = cli("validate", *[_bad(n) for n in names])
    assert code == 2  # the worst of the files
    for n in names:
        assert f"{_bad(n)}:{CASES[n][2]}:" in out


def test_stdin_bad_input(monkeypatch: pytest.MonkeyPatch, cli: CliRunner) -> None:
    import io

    class _Stdin:
        buffer = io.BytesIO(_bad("alias_bomb").read_bytes())

    monkeypatch.setattr(sys, "stdin", _Stdin)
    code, out, _ = cli("validate", "-")
    assert code == 2
    assert "<stdin>:3:7: load: error: anchors (&lol1) are not allowed" in out


def test_python_tags_never_execute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: CliRunner) -> None:
    calls: list[Any] = []

    def system(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(os, "system", system)
    monkeypatch.chdir(tmp_path)
    for name in ("python_tag", "python_name_tag"):
        code, _, _ = cli("validate", _bad(name))
        assert code == 2
    assert calls == []
    assert not (tmp_path / "ledgerspec-pwned").exists()


@pytest.mark.slow  # the whole corpus, or a process per case: the full suite, not the edit loop
def test_real_subprocess_on_the_whole_corpus(tmp_path: Path) -> None:
    """One real process over every bad file: the console script path, with python tags in the mix."""
    files = [str(_bad(n)) for n in sorted(CASES)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerspec", "validate", *files],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "Traceback" not in out
    for name, (_, _rule, line, phrase) in CASES.items():
        assert any(ln.startswith(f"{_bad(name)}:{line}:") and phrase in ln for ln in out.splitlines()), name
    assert not (tmp_path / "ledgerspec-pwned").exists()


@pytest.mark.parametrize("name", ["python_tag", "alias_bomb", "empty"])
def test_console_script_single_file(name: str, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "ledgerspec"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ledgerspec"]
    proc = subprocess.run([*cmd, "validate", str(_bad(name))], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == CASES[name][0]
    assert proc.stdout.startswith(f"{_bad(name)}:{CASES[name][2]}:")
    assert proc.stderr == "" and "Traceback" not in proc.stdout


# -- every command that reads a document, on every file of the corpus (issue 15) -------------------------------

VALIDATE_FORMATS = ("validate", "validate-json", "validate-github", "validate-sarif")
#: the corpus files every command reads in the fast tier (one or more of each kind of refusal, and issue 15's
#: hostile files); the others go through every command in the slow tier (validate reads all of them in both)
CORE = {
    "empty",
    "duplicate_keys",
    "alias_bomb",
    "python_tag",
    "invalid_utf8",
    "control_char",
    "lone_surrogate",
    "giant_int_5000_digits",
    "int_key",
    "version_v2",
    "unknown_kind",
    "missing_header",
    "header_version_5000_digits",
    "wrong_types",
    "section_is_list",
    "unit_gibb",
    "nan_size",
    "source_is_a_status",
    "rich_markup",
    "terminal_escapes",
    "scalar_with_comment",
}
EVERY = [
    pytest.param(name, entry, id=f"{entry}-{name}", marks=() if name in CORE else pytest.mark.slow)
    for name in sorted(CASES)
    for entry in ENTRY_POINTS
]


def _line_of(run: Run, name: str) -> list[str]:
    """The lines of ``run`` that point at the problem of corpus case ``name`` (its line, in the file it was given)."""
    _, _, line, _ = CASES[name]
    return [ln for ln in run.text.splitlines() if ln.startswith(f"{run.path}:{line}:")]


@pytest.mark.slow  # the whole corpus, or a process per case: the full suite, not the edit loop
@pytest.mark.parametrize(("name", "entry"), EVERY)
def test_every_command_refuses_or_reads_the_corpus_cleanly(name: str, entry: str, tmp_path: Path) -> None:
    """Exit 0/1/2, never an internal error; a file refused at load is refused by every command with the same one
    line; a header validate rejects (ledger/v2) is refused by every command that works on the document; resolve and
    estimate never reach their model (nor import torch) on a file they refuse."""
    _, rule, line, phrase = CASES[name]
    run = run_entry(entry, _bad(name), tmp_path / "work")
    check_run(run, sarif_errors)
    refused_at_load = rule == "load"
    if refused_at_load:
        assert run.code == 2, run.text
        hits = _line_of(run, name)
        if entry == "validate-json":
            (doc,) = json.loads(run.out)["files"]
            assert any(f["line"] == line and phrase in f["message"] for f in doc["findings"]), run.out
        elif entry == "validate-sarif":
            results = json.loads(run.out)["runs"][0]["results"]
            assert any(r["locations"][0]["physicalLocation"]["region"]["startLine"] == line for r in results)
        elif entry == "validate-github":
            assert f",line={line}," in run.out, run.out
        else:
            assert any(phrase in ln and f" {rule}: " in ln for ln in hits), run.text
            if entry not in VALIDATE_FORMATS and entry != "validate-fix":  # one line, on stderr
                assert run.out == "" and len(run.err.splitlines()) == 1, run.text
    elif rule == "header":
        if entry in (*VALIDATE_FORMATS, "validate-fix"):
            assert run.code == 1, run.text
        else:  # report, init --from, resolve, estimate: the header is refused before any work
            assert run.code == 2, run.text
            assert run.err.startswith(f"{run.path}:1:") and " header: " in run.err, run.text
            if entry != "init-from":
                assert phrase in run.err, run.text
    else:  # readable but invalid: validate says so; the others read it (and may refuse what they need)
        if entry in (*VALIDATE_FORMATS, "validate-fix"):
            assert run.code == 1, run.text
        elif entry.startswith("report"):
            assert run.code == 0, run.text
    if entry not in ("validate-fix",):
        assert _bad(name).read_bytes() == (BAD / f"{name}.ledger.yaml").read_bytes()
    assert not [p for p in (tmp_path / "work").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_resolve_and_estimate_refuse_a_bad_file_without_importing_torch(tmp_path: Path) -> None:
    """A real process with torch made unimportable: every file refused at load (or by its header) is refused by
    resolve and estimate with validate's line, exit 2 (an import of torch would be an internal error, exit 70)."""
    refused = [n for n in sorted(CASES) if CASES[n][1] in ("load", "header")]
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from ledgerspec.faces.cli import main\n"
        "codes = [main([cmd, f]) for f in sys.argv[1:] for cmd in ('resolve', 'estimate')]\n"
        "print(codes, file=sys.stderr)\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "sys.exit(0 if set(codes) == {2} else 1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *[str(_bad(n)) for n in refused]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in refused:
        assert proc.stderr.count(f"{_bad(n)}:{CASES[n][2]}:") == 2, n


def test_rich_markup_in_a_note_is_text(cli: CliRunner) -> None:
    """``[/red]`` used to raise MarkupError; ``[link=URL]`` became a hidden hyperlink; ``:warning:`` an emoji."""
    code, out, err = cli("report", _bad("rich_markup"))
    assert code == 0, err
    assert "[bold red]not bold[/bold red] [/red]" in out
    assert "[/red]" in out and "[/]" in out
    assert "[link=https://example.com/phish]click" in out.replace("\n", " ") or "[link=https://example" in out
    assert ":warning:" in out and "\u26a0" not in out


def test_rich_terminal_with_colour_sends_only_its_own_escape_sequences() -> None:
    """With colours on, the only escape sequences are rich's own SGR colour codes: a user's are shown escaped."""
    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import gather
    from ledgerspec.faces.report.terminal import render_rich

    for name in ("terminal_escapes", "rich_markup"):
        out = io.StringIO()
        render_rich(gather(load(_bad(name))), out, color=True)
        text = out.getvalue()
        assert "\x1b[" in text  # coloured
        bare = re.sub(r"\x1b\[[0-9;]*m", "", text)
        assert all(is_printable(ln) for ln in bare.splitlines()), [
            ln for ln in bare.splitlines() if not is_printable(ln)
        ]
        assert "\x1b]8" not in text  # no hyperlink (OSC 8), neither the user's nor one made from markup
        if name == "terminal_escapes":
            assert "\\x1b[2J" in bare and "\\u202e" in bare


def test_terminal_escapes_are_shown_escaped_everywhere(tmp_path: Path) -> None:
    for entry in ENTRY_POINTS:
        run = run_entry(entry, _bad("terminal_escapes"), tmp_path / entry)
        check_run(run, sarif_errors)
        assert "\x1b" not in run.text and "\x9b" not in run.text, entry
        if entry != "init-from":  # init prints the YAML document: a bidi mark is written as the document holds it
            assert "\u202e" not in run.text, entry
        if entry.startswith("report") and entry != "report-html":
            assert "\\x1b[2J" in run.out and "\\u202e" in run.out and "\\x9b" in run.out, run.out
        if entry == "report-html":
            assert b"\x1b" not in run.written["html"] and b"\\x1b[2J" in run.written["html"]


def test_init_from_a_scalar_with_a_comment_where_a_mapping_belongs(tmp_path: Path) -> None:
    run = run_entry("init-from", _bad("scalar_with_comment"), tmp_path)
    assert run.code == 0, run.text
    assert re.search(r"^adapter: float32 +# c$", run.out, re.M), run.out


def test_report_shows_a_source_that_is_no_provenance_word(tmp_path: Path) -> None:
    for entry in ("report", "report-plain", "report-html"):
        run = run_entry(entry, _bad("source_is_a_status"), tmp_path)
        assert run.code == 0, run.text
        assert "CANDIDATE" in (run.out if entry != "report-html" else run.written["html"].decode())


def test_a_version_of_5000_digits_stops_nothing_else(cli: CliRunner) -> None:
    """One such file used to abort a multi-file validate with an internal error."""
    code, out, _ = cli("validate", _bad("header_version_5000_digits"), _bad("unit_gibb"))
    assert code == 1
    assert f"{_bad('unit_gibb')}:4:" in out and len(max(out.splitlines(), key=len)) < 400


def test_intake_v2_is_refused_by_init(tmp_path: Path, cli: CliRunner) -> None:
    path = tmp_path / "v2.intake.yaml"
    path.write_text("ledgerspec: intake/v2\nmethod:\n  kind: LoRA\n", encoding="utf-8")
    code, out, err = cli("init", "--from", path)
    assert code == 2 and out == ""
    assert err == f"{path}:1:1: header: unsupported version 'intake/v2'; this ledgerspec reads ledger/v1, intake/v1\n"


def test_ledger_v2_is_refused_by_every_writing_command(tmp_path: Path, cli: CliRunner) -> None:
    """resolve used to accept ``ledger/v2`` and write figures into it; no command writes a document validate
    rejects for its header."""
    path = tmp_path / "v2.ledger.yaml"
    path.write_bytes(_bad("version_v2").read_bytes())
    before = path.read_bytes()
    for args in (
        ["resolve", path],
        ["resolve", path, "-o", tmp_path / "out.yaml"],
        ["estimate", path, "--target", "cpu"],
        ["shard", path, "--nproc", "2"],
        ["measure", path],
        ["triage", path],
    ):
        code, out, err = cli(*args)
        assert code == 2, (args, out, err)
        assert (
            err == f"{path}:1:1: header: unsupported version 'ledger/v2'; this ledgerspec reads ledger/v1, intake/v1\n"
        )
    assert path.read_bytes() == before and not (tmp_path / "out.yaml").exists()


# -- encodings and names (issue 15, item 2) ------------------------------------------------------------------

HOSTILE_NAMES = [
    os.fsdecode(b"\xff\xfe-not-utf8.ledger.yaml"),
    "with space #hash <lt> %25 &amp.ledger.yaml",
    "newline\nand\x1b[2J-escape.ledger.yaml",
    "caf\u00e9-\u202eevil.ledger.yaml",
]


@pytest.mark.slow  # the whole corpus, or a process per case: the full suite, not the edit loop
@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=["non-utf8", "uri-chars", "controls", "unicode-bidi"])
def test_every_output_format_is_valid_utf8_whatever_the_file_name(name: str, tmp_path: Path) -> None:
    """A non-UTF-8 name used to crash report --html and validate's text and JSON output; SARIF carried the raw path
    (a space, ``#`` or ``<`` fails the schema's uri-reference format)."""
    from urllib.parse import unquote_to_bytes

    path = tmp_path / name
    path.write_bytes((BAD / "unit_gibb.ledger.yaml").read_bytes())
    for entry in ENTRY_POINTS:
        run = run_entry(entry, path, tmp_path / "work" / entry)
        check_run(run, sarif_errors)
        assert run.code in (1, 0, None) or entry in ("resolve", "estimate"), (entry, run.text)
        if entry == "validate-sarif":
            (result, *_) = json.loads(run.out)["runs"][0]["results"]
            uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            assert uri.startswith("file:///") and unquote_to_bytes(uri[len("file://") :]) == os.fsencode(path)
    rel = subprocess.run(
        [sys.executable, "-m", "ledgerspec", "validate", "--format", "sarif", os.fsencode(name)],
        capture_output=True,
        cwd=tmp_path,
        timeout=60,
    )
    log = json.loads(rel.stdout.decode("utf-8"))  # valid UTF-8 from a real process, whatever the locale
    assert not sarif_errors(log)
    uri = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert "/" not in uri and unquote_to_bytes(uri) == os.fsencode(name)  # a relative reference


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
@pytest.mark.parametrize("fmt", ["text", "json", "github", "sarif"])
@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_a_real_process_writes_valid_utf8_under_a_strict_or_c_locale(fmt: str, locale: str, tmp_path: Path) -> None:
    """Under PYTHONIOENCODING=utf-8:strict validate used to crash on a non-UTF-8 name; under the C locale
    (surrogateescape) --format json wrote the raw 0xFF byte."""
    name = b"\xff-name.ledger.yaml"
    (tmp_path / os.fsdecode(name)).write_bytes((BAD / "unit_gibb.ledger.yaml").read_bytes())
    for env in ({"PYTHONIOENCODING": "utf-8:strict"}, {"LC_ALL": locale, "LANG": locale}):
        proc = subprocess.run(
            [sys.executable, "-m", "ledgerspec", "validate", "--format", fmt, name],
            capture_output=True,
            cwd=tmp_path,
            env={**os.environ, **env},
            timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        out = proc.stdout.decode("utf-8")  # raises on a raw 0xFF
        assert "Traceback" not in out + proc.stderr.decode("utf-8", "replace")
        assert ("%FF" if fmt == "sarif" else "\\xff") in out
        if fmt in ("json", "sarif"):
            json.loads(out)


def test_stdin_is_read_with_the_file_bound(tmp_path: Path) -> None:
    """``validate -`` used to read all of stdin (1 GB piped in: 1 GB of memory); now at most 1 MiB + 1 byte."""
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (600 * 2**20, 600 * 2**20))\n"
        "from ledgerspec.faces.cli import main\n"
        "sys.exit(main(['validate', '-']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdin is not None
    chunk = b"ledgerspec: ledger/v1\n" + b"#" * (1 << 20) + b"\n"
    try:
        for _ in range(1024):  # up to 1 GiB: the reader stops after 1 MiB and exits
            proc.stdin.write(chunk)
    except BrokenPipeError:
        pass
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert (
        out.decode() == f"<stdin>:1:1: load: error: input is over the {MAX_FILE_BYTES}-byte limit for a ledger "
        "(hint: a ledger is a few KiB; is this the right input?)\n"
    )


# -- item 9: --offline, BOM, CR-only line endings, the NaN reason ---------------------------------------------


def test_a_nan_figure_gets_a_clear_reason(cli: CliRunner, tmp_path: Path) -> None:
    """It used to read "CALCULATED needs exact figures: ledger.adapter is CALCULATED"."""
    path = tmp_path / "nan.ledger.yaml"
    text = (REPO / "examples" / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")
    assert "    value: 33554432     # 32 MiB\n" in text
    path.write_text(text.replace("    value: 33554432     # 32 MiB\n", "    value: .nan\n"), encoding="utf-8")
    code, out, _ = cli("validate", "-v", path)
    assert code == 1
    assert (
        "  - CALCULATED needs exact figures: ledger.adapter is CALCULATED but its value nan is not a size in bytes\n"
        in out
    )
    assert "ledger.adapter is CALCULATED\n" not in out


@pytest.mark.parametrize("ending", [b"\r", b"\r\n"], ids=["cr", "crlf"])
def test_fix_keeps_cr_and_crlf_line_endings(ending: bytes, tmp_path: Path, cli: CliRunner) -> None:
    """A CR-only file used to come back with mixed line endings."""
    path = tmp_path / "l.ledger.yaml"
    shutil.copytree(REPO / "examples" / "configs", tmp_path / "configs")  # the config_path it names (LS008)
    path.write_bytes((REPO / "examples" / "downgraded.ledger.yaml").read_bytes().replace(b"\n", ending))
    code, _, err = cli("validate", "--fix", path)
    assert code == 0 and "status lowered" in err
    raw = path.read_bytes()
    assert raw.count(ending) > 50
    assert raw.replace(ending, b"").count(b"\r") == 0 and raw.replace(ending, b"").count(b"\n") == 0


@pytest.mark.slow
def test_offline_touches_no_network(tmp_path: Path) -> None:
    """``--offline`` with only ``identity.model_id`` used to send one DNS query for the Hub (huggingface_hub's user
    agent fetches its agent registry unless its HF_HUB_OFFLINE constant is set). A real process with every socket
    call recorded and refused, and an empty Hugging Face cache."""
    intake = tmp_path / "hub.intake.yaml"
    intake.write_text(
        "ledgerspec: intake/v1\nidentity:\n  model_id: some-org/no-such-model\n  revision: main\n"
        "method:\n  kind: LoRA\n  rank: 8\n  target_modules: [q_proj]\n",
        encoding="utf-8",
    )
    script = (
        "import socket, sys\n"
        "calls = []\n"
        "def refuse(*a, **k):\n"
        "    calls.append(a[:2])\n"
        "    raise OSError('network refused by the test')\n"
        "socket.getaddrinfo = refuse\n"
        "socket.create_connection = refuse\n"
        "socket.socket.connect = lambda self, *a: refuse(*a)\n"
        "from ledgerspec.faces.cli import main\n"
        "code = main(['resolve', sys.argv[1], '-o', sys.argv[2], '--offline'])\n"
        "print('CALLS', calls, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(intake), str(tmp_path / "out.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "CALLS []" in proc.stderr, proc.stderr[-3000:]
    assert f"{intake}:3:3: resolve: cannot load the config of 'some-org/no-such-model'" in proc.stderr


@pytest.mark.slow
def test_resolve_into_a_new_file_keeps_the_bom(tmp_path: Path, cli: CliRunner) -> None:
    """``resolve -o`` used to drop a UTF-8 byte order mark that ``--fix`` kept (fixed in contract.writer)."""
    data = REPO / "tests" / "data" / "measure"
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_bytes((data / "tiny-llama" / "config.json").read_bytes())
    intake = tmp_path / "t.intake.yaml"
    text = (data / "tiny-llama-lora.yaml").read_text(encoding="utf-8")
    intake.write_bytes(b"\xef\xbb\xbf" + text.replace("ledgerspec: ledger/v1", "ledgerspec: intake/v1").encode())
    out = tmp_path / "t.ledger.yaml"
    code, _, err = cli("resolve", intake, "-o", out)
    assert code == 0, err
    raw = out.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfledgerspec: ledger/v1") and raw.count(b"\xef\xbb\xbf") == 1
