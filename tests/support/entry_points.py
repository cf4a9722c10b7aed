"""Every command that reads a document, run in-process on one file, for the bad-input corpus and the property test.

The torch-free commands run whole. ``resolve`` and ``estimate`` run their input stage only: the derivation they
hand the document to (``resolver.resolve``, ``estimator.estimate``) is replaced by a stub that raises
:class:`HeavyStage`, and ``torch`` cannot be imported meanwhile, so a command that reached for torch before it had
checked its input fails the run (as an internal error, exit 70).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from ledgerspec.faces.cli import main

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
#: what a terminal must never get raw (written out here, not taken from ledgerspec.errors): C0/C1 controls, DEL,
#: line/paragraph separators, bidirectional controls, lone surrogates (undecodable bytes of a file name)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def is_printable(line: str) -> bool:
    """No character a terminal must not receive raw (see :data:`_UNPRINTABLE`)."""
    return _UNPRINTABLE.search(line) is None


#: every document-reading entry point, by name
ENTRY_POINTS = (
    "validate",
    "validate-json",
    "validate-github",
    "validate-sarif",
    "validate-fix",
    "report",
    "report-plain",
    "report-html",
    "init-from",
    "resolve",
    "estimate",
)
#: the ones that run whole without torch
TORCH_FREE = tuple(e for e in ENTRY_POINTS if e not in ("resolve", "estimate"))


class HeavyStage(BaseException):
    """The command accepted its input and handed the document to the derivation (stubbed here)."""


@dataclass
class Run:
    entry: str
    #: the file the command was given (a copy for --fix and init --from)
    path: Path
    #: None: the command reached its heavy stage (resolve, estimate)
    code: int | None
    out: str
    err: str
    written: dict[str, bytes] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.out + self.err


def as_intake(text: str) -> str:
    """A ledger's text as an intake's (``init --from`` reads intakes): the header's kind changed, nothing else."""
    return text.replace("ledgerspec: ledger/", "ledgerspec: intake/", 1)


@contextlib.contextmanager
def _no_torch() -> Iterator[None]:
    """``import torch`` raises ImportError (a module already imported keeps working); restored afterwards."""
    saved = {name: sys.modules.get(name) for name in ("torch", "transformers", "peft")}
    for name in saved:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _heavy(*_a: Any, **_k: Any) -> Any:
    raise HeavyStage


@contextlib.contextmanager
def _stubbed() -> Iterator[None]:
    import ledgerspec.derivations.estimate.estimator as estimator
    import ledgerspec.derivations.resolve.resolver as resolver

    with mock.patch.object(resolver, "resolve", _heavy), mock.patch.object(estimator, "estimate", _heavy):
        yield


def _cli(args: list[str]) -> tuple[int | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | None = main(args)
        except HeavyStage:
            code = None
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def run_entry(entry: str, path: Path, work: Path) -> Run:
    """Run ``entry`` on ``path``; files it may write (a --fix copy, the HTML page, an intake copy) go to ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    target = path
    written: dict[str, bytes] = {}
    if entry == "validate-fix":
        target = work / path.name
        shutil.copyfile(path, target)
        args = ["validate", "--fix", str(target)]
    elif entry.startswith("validate"):
        fmt = entry.partition("-")[2] or "text"
        args = ["validate", "--format", fmt, str(path)]
    elif entry == "report":
        args = ["report", str(path)]
    elif entry == "report-plain":
        args = ["report", "--plain", str(path)]
    elif entry == "report-html":
        html = work / "report.html"
        html.unlink(missing_ok=True)
        args = ["report", str(path), "--html", str(html)]
    elif entry == "init-from":
        target = work / path.name.replace(".ledger.", ".intake.")
        try:
            raw = path.read_bytes()
            target.write_bytes(as_intake(raw.decode("utf-8")).encode("utf-8") if _utf8(raw) else raw)
        except OSError:
            target = path
        args = ["init", "--from", str(target)]
    elif entry == "resolve":
        args = ["resolve", str(path), "--offline"]
    elif entry == "estimate":
        args = ["estimate", str(path)]
    else:
        raise ValueError(entry)
    with _no_torch(), _stubbed():
        code, out, err = _cli(args)
    if entry == "report-html" and (work / "report.html").exists():
        written["html"] = (work / "report.html").read_bytes()
    if entry == "validate-fix":
        written["fixed"] = target.read_bytes()
    return Run(entry, target, code, out, err, written)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_run(run: Run, sarif_check: Callable[[Any], list[str]] | None = None) -> None:
    """What holds for every run on any input: exit 0/1/2 (or the heavy stage reached), no internal error, one line
    per problem, every output line printable (no raw control character or escape sequence) and valid UTF-8, the
    machine formats parseable (SARIF valid against the official schema), the HTML page well-formed XML."""
    where = f"{run.entry} on {run.path}"
    assert run.code in (0, 1, 2, None), f"{where}: exit {run.code}\n{run.text[-2000:]}"
    assert "internal-error" not in run.text and "Traceback" not in run.text, f"{where}:\n{run.text[-2000:]}"
    if run.code is None:
        assert run.entry in ("resolve", "estimate"), where
    # init's standard output is the YAML document itself: the emitter escapes every control character, while
    # other Unicode (a bidirectional mark included) is written as the document holds it, as `cat` would show it
    yaml_out = run.entry == "init-from" and run.code == 0
    for line in (run.err if yaml_out else run.text).splitlines():
        assert is_printable(line), f"{where}: unprintable output line {line[:300]!r}"
        line.encode("utf-8")
    if yaml_out:
        assert not _CONTROL.search(run.out.replace("\n", "")), f"{where}: a control character in the YAML"
        run.out.encode("utf-8")
    if run.code == 2 and not run.entry.startswith("validate"):
        problems = [ln for ln in run.err.splitlines() if ln.strip()]
        assert problems, f"{where}: exit 2 with nothing on stderr"
    if run.entry == "validate-json":
        json.loads(run.out)
    if run.entry == "validate-sarif":
        log = json.loads(run.out)
        if sarif_check is not None:
            errors = sarif_check(log)
            assert not errors, f"{where}: SARIF invalid: {errors[:3]}"
    if "html" in run.written:
        page = run.written["html"]
        page.decode("utf-8")
        ET.fromstring(page)  # well-formed: no control character, every tag closed


_SARIF: list[Any] = []


def sarif_errors(log: Any) -> list[str]:
    """The official SARIF 2.1.0 schema's complaints about ``log`` (``tests/data/sarif-schema-2.1.0.json``), formats
    checked: ``uri`` and ``uri-reference`` with rfc3986-validator (what jsonschema's format checker uses for them)."""
    import jsonschema

    if not _SARIF:
        from tests.support import DATA

        schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
        jsonschema.Draft4Validator.check_schema(schema)
        checker = jsonschema.FormatChecker()  # every format it knows, uri-reference included (a draft-06 name)
        assert "uri-reference" in checker.checkers, "pip install rfc3986-validator (ledgerspec[dev])"
        _SARIF.append(jsonschema.Draft4Validator(schema, format_checker=checker))
    return [f"{e.json_path}: {e.message}" for e in _SARIF[0].iter_errors(log)]
