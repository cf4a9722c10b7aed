"""Bad input to the heavy commands: one line ``FILE:LINE:COL: rule: message (hint: ...)``, exit 1 or 2, the input
file untouched, never a traceback. Most errors are found before a model is built (``measure`` and ``triage`` check
the config and the recipe in the parent process, before a child imports torch), so these cases are fast.

An unexpected exception is an internal error: one line that says so, exit 70, the traceback with LEDGERSPEC_DEBUG=1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.errors import EXIT_INTERNAL
from tests.support import EXAMPLES, TESTS, CliRunner

DATA = TESTS / "data" / "measure"
LEDGER = (DATA / "tiny-llama-lora.yaml").read_text(encoding="utf-8")
INTAKE = LEDGER.replace("ledgerspec: ledger/v1", "ledgerspec: intake/v1").replace("status: INSUFFICIENT DATA\n", "")
CONFIG = json.loads((DATA / "tiny-llama" / "config.json").read_text(encoding="utf-8"))
#: ``FILE[:LINE:COL]: rule: message`` (FILE is ``ledgerspec`` for a bad flag)
ONE_LINE = re.compile(r"^\S.*?(:\d+:\d+)?: [a-z][\w-]*: \S.*$")

HEAVY = ("resolve", "estimate", "measure", "triage", "shard", "report")
#: the command lines, FILE standing for the input; estimate models the CPU kernels (no attention modelling needed)
ARGS = {
    "resolve": ["resolve", "FILE"],
    "estimate": ["estimate", "FILE", "--target", "cpu"],
    "measure": ["measure", "FILE", "--device", "cpu"],
    "triage": ["triage", "FILE", "--device", "cpu"],
    "shard": ["shard", "FILE", "--nproc", "2"],
    "report": ["report", "FILE", "--plain"],
}


def _edit(old: str, new: str, text: str = LEDGER) -> str:
    assert old in text
    return text.replace(old, new)


#: name -> (ledger text, config.json text, the commands that must refuse it, a phrase of the message, line)
DOCUMENTS: dict[str, tuple[str, str | None, tuple[str, ...], str, int | None]] = {
    # the unclosed bracket's own line (13), not the next key's, where the parser stops
    "yaml-syntax-error": (_edit("rank: 4", "rank: [4"), None, HEAVY, "unclosed '[' (a flow sequence)", 13),
    "unknown-optimizer": (
        _edit("name: adamw_torch", "name: adamw_bogus"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "adamw_bogus",
        31,
    ),
    "rank-zero": (
        _edit("rank: 4", "rank: 0"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "integer >= 1",
        13,
    ),
    "bad-loaded-dtype": (
        _edit("loaded_dtype: float32", "loaded_dtype: bf17"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "unknown dtype 'bf17'",
        19,
    ),
    "bad-adapter-dtype": (
        _edit("  dtype: float32", "  dtype: foo32"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "unknown dtype 'foo32'",
        22,
    ),
    "config-not-json": (
        LEDGER,
        "{not json",
        ("resolve", "estimate", "measure", "triage", "shard"),
        "is not valid JSON",
        7,
    ),
    "config-not-an-object": (
        LEDGER,
        "[1, 2]",
        ("resolve", "estimate", "measure", "triage", "shard"),
        "is not a JSON object",
        7,
    ),
    "config-missing": (
        _edit("tiny-llama/config.json", "nowhere/config.json"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "no config.json",
        7,
    ),
    "unknown-model-type": (
        LEDGER,
        json.dumps({**CONFIG, "model_type": "nosuchmodel"}),
        ("resolve", "estimate", "shard"),
        "nosuchmodel",
        7,
    ),
    # transformers' strict config dataclasses: the reason is on the message's second line
    "config-wrong-type": (
        LEDGER,
        json.dumps({**CONFIG, "vocab_size": "big"}),
        ("resolve", "estimate", "shard"),
        "Field 'vocab_size' expected int, got str",
        7,
    ),
    "config-inconsistent": (
        LEDGER,
        json.dumps({**CONFIG, "num_attention_heads": 3}),
        ("resolve", "estimate", "shard"),
        "not a multiple of the number of attention heads (3)",
        7,
    ),
    # the config is not the one the ledger pinned: every command that reads it refuses (LS006 relies on the pin)
    "config-pin-mismatch": (
        _edit("config_sha256: UNKNOWN", "config_sha256: '" + "0" * 64 + "'"),
        None,
        ("resolve", "estimate", "measure", "triage", "shard"),
        "config_sha256 does not match",
        6,
    ),
    "targets-match-nothing": (
        _edit("[q_proj, v_proj]", "[nothing_here]"),
        None,
        ("resolve", "estimate", "shard"),
        "nothing_here",
        16,
    ),
    "intake-where-a-ledger-is-needed": (INTAKE, None, ("measure", "triage"), "writes into a ledger/v1 document", 1),
}
DOC_CASES = [
    pytest.param(name, cmd, id=f"{cmd}-{name}") for name, (_, _, cmds, _, _) in DOCUMENTS.items() for cmd in cmds
]


def _setup(folder: Path, text: str, config: str | None = None) -> Path:
    (folder / "tiny-llama").mkdir()
    (folder / "tiny-llama" / "config.json").write_text(
        config if config is not None else json.dumps(CONFIG), encoding="utf-8"
    )
    path = folder / "t.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _one_line_error(code: int, out: str, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code in (1, 2), (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert len(lines) == 1, err
    assert ONE_LINE.match(lines[0]), lines[0]
    return lines[0]


def _argv(cmd: str, path: Path | str, *extra: str) -> list[str]:
    return [str(path) if a == "FILE" else a for a in ARGS[cmd]] + list(extra)


@pytest.mark.parametrize(("name", "cmd"), DOC_CASES)
def test_a_bad_document_is_one_line_and_untouched(cli: CliRunner, tmp_path: Path, name: str, cmd: str) -> None:
    text, config, _, phrase, line = DOCUMENTS[name]
    path = _setup(tmp_path, text, config)
    before = path.read_bytes()
    message = _one_line_error(*cli(*_argv(cmd, path)))
    assert phrase in message
    assert message.startswith(f"{path}:{line}:"), message
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.ledger.yaml", "tiny-llama"]  # no stray temp file


@pytest.mark.parametrize("cmd", HEAVY)
@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_an_unreadable_input_is_one_line(cli: CliRunner, tmp_path: Path, cmd: str, kind: str) -> None:
    path = tmp_path / "nothing.yaml" if kind == "missing" else tmp_path
    message = _one_line_error(*cli(*_argv(cmd, path)))
    assert message.startswith(f"{path}: load: ")
    assert ("no such file" if kind == "missing" else "not a regular file") in message


#: (command, flags, phrase): bad flag values, refused before the document is used
FLAGS = [
    ("estimate", ["--device-memory", "banana"], "'banana' is not a size"),
    ("estimate", ["--device-memory", "0"], "must be a positive size"),
    ("estimate", ["--device-memory", "-5GB"], "negative size '-5GB'"),  # a value, not an unknown flag
    ("estimate", ["--device-memory=-5GB"], "negative size '-5GB'"),
    ("estimate", ["--device-memory", "24gib"], "did you mean GiB?"),
    ("estimate", ["--device-memory", "24"], "did you mean 24GiB or 24GB?"),
    ("shard", ["--estimate", "--device-memory", "80"], "too small for a device"),
    ("shard", ["--estimate", "--device-memory", "0"], "must be a positive size"),
    ("shard", ["--estimate", "--device-memory", "-1"], "negative size '-1'"),
    ("estimate", ["--sweep", "rank"], "expected NAME=V1,V2"),
    ("estimate", ["--sweep", "bogus=1,2"], "unknown input 'bogus'"),
    ("estimate", ["--sweep", "rank=0"], "must be >= 1"),
    ("measure", ["--memory-limit", "banana"], "'banana' is not a size"),
    ("measure", ["--memory-limit", "0"], "must be a positive size"),
    ("measure", ["--memory-limit", "-2MiB"], "negative size '-2MiB'"),
    ("measure", ["--steps", "1"], "--steps must be >= 2"),
    ("triage", ["--memory-limit", "banana"], "'banana' is not a size"),
    ("triage", ["--memory-limit", "0"], "must be a positive size"),
    ("triage", ["--steps", "0"], "--steps must be >= 2"),
    ("shard", ["--nproc", "0"], "--nproc must be >= 1"),
]


@pytest.mark.parametrize(("cmd", "flags", "phrase"), FLAGS, ids=[f"{c}{''.join(f)}" for c, f, _ in FLAGS])
def test_a_bad_flag_is_one_line(cli: CliRunner, tmp_path: Path, cmd: str, flags: list[str], phrase: str) -> None:
    path = _setup(tmp_path, LEDGER)
    before = path.read_bytes()
    assert phrase in _one_line_error(*cli(*_argv(cmd, path, *flags)))
    assert path.read_bytes() == before


OUTPUT_FLAG = {"resolve": "-o", "estimate": "-o", "measure": "-o", "triage": "-o", "shard": "-o", "report": "--html"}


@pytest.mark.parametrize("cmd", HEAVY)
@pytest.mark.parametrize("where", ["under-a-file", "a-folder"])
def test_an_unwritable_output_is_refused_up_front(cli: CliRunner, tmp_path: Path, cmd: str, where: str) -> None:
    """``-o OUT`` that cannot be written: one line, before any model is built or measured, input untouched."""
    path = _setup(tmp_path, LEDGER)
    before = path.read_bytes()
    blocker = tmp_path / "a-file"
    blocker.write_text("x", encoding="utf-8")
    out = blocker / "out.yaml" if where == "under-a-file" else tmp_path / "tiny-llama"
    message = _one_line_error(*cli(*_argv(cmd, path, OUTPUT_FLAG[cmd], str(out))))
    assert message.startswith(f"{out}: write: ")
    assert path.read_bytes() == before and blocker.read_text(encoding="utf-8") == "x"


def test_an_intake_is_not_estimated_into_a_new_file(cli: CliRunner, tmp_path: Path) -> None:
    path = _setup(tmp_path, INTAKE)
    message = _one_line_error(*cli("estimate", str(path), "-o", str(tmp_path / "out.yaml")))
    assert message.startswith(f"{path}:1:1: estimate: an intake holds no ledger figures")
    assert not (tmp_path / "out.yaml").exists()


def test_an_intake_is_resolved_only_into_a_new_file(cli: CliRunner, tmp_path: Path) -> None:
    path = _setup(tmp_path, INTAKE)
    before = path.read_bytes()
    assert "give -o OUT" in _one_line_error(*cli("resolve", str(path)))
    assert path.read_bytes() == before


def test_a_ledger_where_an_intake_is_needed(cli: CliRunner, tmp_path: Path) -> None:
    path = _setup(tmp_path, LEDGER)
    message = _one_line_error(*cli("init", "--from", str(path), "-o", str(tmp_path / "new.yaml")))
    assert message.startswith(f"{path}:1:1: init: --from expects an intake/v1 document")
    assert not (tmp_path / "new.yaml").exists()


def test_the_adapter_dtype_is_checked_before_measuring() -> None:
    """A misspelt adapter.dtype used to fall back silently to PEFT's float32 in estimate/measure/triage."""
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.errors import LedgerspecError

    doc = from_text(_edit("  dtype: float32", "  dtype: bf16"), str(DATA / "t.yaml"))
    assert WorkloadSpec.from_document(doc).adapter_dtype == "bfloat16"
    assert (
        WorkloadSpec.from_document(from_text(_edit("  dtype: float32\n", "\n"), str(DATA / "t.yaml"))).adapter_dtype
        is None
    )
    with pytest.raises(LedgerspecError, match="unknown dtype 'foo32'"):
        WorkloadSpec.from_document(from_text(_edit("  dtype: float32", "  dtype: foo32"), str(DATA / "t.yaml")))


# -- internal errors ------------------------------------------------------------------------------------------------


def _crashing(exc: BaseException) -> Callable[[object], int]:
    def run(_args: object) -> int:
        raise exc

    return run


@pytest.mark.parametrize("cmd", HEAVY)
def test_an_unexpected_exception_is_an_internal_error(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: str
) -> None:
    import argparse

    monkeypatch.delenv("LEDGERSPEC_DEBUG", raising=False)
    path = _setup(tmp_path, LEDGER)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_crash(self: argparse.ArgumentParser, *a: object, **kw: object) -> argparse.Namespace:
        ns: Any = parse(self, *a, **kw)
        ns.run = _crashing(ZeroDivisionError("division by zero\nsecond line"))
        return ns

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_crash)
    code, _, err = cli(*_argv(cmd, path))
    assert code == EXIT_INTERNAL and code not in (1, 2)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("ledgerspec: internal-error: ")
    assert f"`ledgerspec {cmd}`" in lines[0] and "ZeroDivisionError: division by zero" in lines[0]
    assert "second line" not in lines[0]
    assert "please report it" in lines[0] and "LEDGERSPEC_DEBUG=1" in lines[0]

    monkeypatch.setenv("LEDGERSPEC_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli(*_argv(cmd, path))


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_a_crash_of_the_measurement_child_is_an_internal_error(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception inside the child process reaches the user as an internal error, not a user error."""
    from ledgerspec.derivations.measure import measurer as measure

    monkeypatch.delenv("LEDGERSPEC_DEBUG", raising=False)
    path = _setup(tmp_path, LEDGER)
    before = path.read_bytes()
    make_request = measure.make_request

    def broken_request(*a: object, **kw: object) -> measure.Request:
        req = make_request(*a, **kw)  # type: ignore[arg-type]
        req.spec = {"no_such_knob": 1}  # the child's WorkloadSpec.from_json raises TypeError
        return req

    monkeypatch.setattr(measure, "make_request", broken_request)
    code, _, err = cli("measure", str(path), "--device", "cpu")
    assert code == EXIT_INTERNAL, err
    assert err.count("\n") == 1 and "internal-error" in err and "the measurement process crashed: TypeError" in err
    assert path.read_bytes() == before


def test_a_broken_command_module_takes_down_only_its_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug that breaks one command module at import must leave validate (the pre-commit hook) working."""
    import importlib

    from ledgerspec.faces import cli

    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name == "ledgerspec.faces.commands.measure":
            raise NameError("name 'positive_size' is not defined")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.delenv("LEDGERSPEC_DEBUG", raising=False)
    assert cli.main(["validate", str(EXAMPLES / "llama-2-7b-lora.intake.yaml")]) == 0
    capsys.readouterr()
    assert cli.main(["triage", "x.yaml", "--device", "cpu"]) == 70
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "ledgerspec: internal-error: `ledgerspec triage` failed unexpectedly (NameError: name "
            "'positive_size' is not defined)"
        )
        and "\n" not in err
    )
