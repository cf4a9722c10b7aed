"""Malformed input: every file in ``tests/bad/`` is refused with one clear line, FILE:LINE:COL, no traceback.

Each case names the exit code (2: unreadable input, refused by the loader; 1: readable but invalid),
the rule that reports it, the line it points at (counted by hand from the file) and a phrase of
the message. ``tests/bad/accepted/`` holds odd-but-legal files (CRLF, BOM) that must be accepted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.loader import MAX_FILE_BYTES, MAX_NODES
from tests.support import BAD, CliRunner

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
