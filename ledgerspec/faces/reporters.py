"""Output formats for ``validate``: a registry of reporters (text, json, github, sarif)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote

from ledgerspec.checks.findings import ERROR, INFO, WARNING
from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report
from ledgerspec.checks.verdict import next_status, next_steps
from ledgerspec.errors import encodable, json_text, printable
from ledgerspec.version import __version__

Reporter = Callable[[list[Report], TextIO, bool], None]
REPORTERS: dict[str, Reporter] = {}


def reporter(name: str) -> Callable[[Reporter], Reporter]:
    def register(fn: Reporter) -> Reporter:
        REPORTERS[name] = fn
        return fn

    return register


def _lines(out: TextIO) -> Callable[[str], None]:
    """Write one line to ``out``: every user string in it (a path, a value quoted in a message) made
    :func:`~ledgerspec.errors.printable`, so a terminal never receives an escape sequence from a file."""

    def write(line: str) -> None:
        out.write(printable(line) + "\n")

    return write


@reporter("text")
def text_report(reports: list[Report], out: TextIO, verbose: bool) -> None:
    line = _lines(out)
    for r in reports:
        if verbose and r.verdict is not None:  # the answer first: does it fit, and by how much
            line(f"{r.path}: {r.verdict.sentence()}")
        for f in r.findings:
            if f.severity == INFO and not verbose:
                continue
            line(f.located(r.path))
        if r.supported_status is not None:
            declared = r.declared_status or "none declared"
            line(
                f"{r.path}: {r.kind}/v1, status {r.supported_status} (declared: {declared})"
                f"{'' if r.ok else ', INVALID'}"
            )
            for text in status_lines(r, verbose):
                line(text)
    infos = sum(1 for r in reports for f in r.findings if f.severity == INFO)
    if infos and not verbose:
        line(f"({infos} info finding(s) hidden; -v shows them)")


def _encodable(value: Any) -> Any:
    """Every string of a JSON value :func:`~ledgerspec.errors.encodable` (a file name's undecodable bytes as
    ``\\xNN``): the output is valid UTF-8 whatever the names; JSON escapes control characters itself."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return {encodable(str(k)): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def status_lines(r: Report, verbose: bool) -> list[str]:
    """What the next status needs, one line per kind of missing evidence; every reason with ``verbose`` or when the
    declared status claims more than the evidence supports."""
    if not r.reasons or r.supported_status is None:
        return []
    lines = []
    target = next_status(r.supported_status)
    if target is not None:
        lines.append(f"  to reach {target}:")
    lines += [f"  - {step.line()}" for step in next_steps(r.reasons, r.path)]
    overclaimed = RANK.get(r.declared_status or "", -1) > RANK.get(r.supported_status, -1)
    if verbose or overclaimed:
        lines.append(f"  every reason ({len(r.reasons)}):")
        lines += [f"    - {reason}" for reason in r.reasons]
    elif any(len(step.reasons) > 1 for step in next_steps(r.reasons, r.path)):
        lines.append(f"  ({len(r.reasons)} reasons in all; -v lists each)")
    return lines


@reporter("json")
def json_report(reports: list[Report], out: TextIO, verbose: bool) -> None:
    out.write(
        json_text(json.dumps(_encodable({"files": [r.to_json() for r in reports]}), indent=2, ensure_ascii=False))
    )
    out.write("\n")


def _gh_escape(text: str, prop: bool = False) -> str:
    """A workflow command's value: ``%``, CR and LF percent-encoded (GitHub's own escaping), then every other
    control character and escape sequence shown escaped (:func:`~ledgerspec.errors.printable`)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return printable(text)


def sarif_uri(path: str) -> str:
    """A SARIF ``artifactLocation.uri`` for ``path``: RFC 3986, every byte of the name that is not unreserved
    percent-encoded (spaces, ``#``, ``<``, ``%``, control characters, non-ASCII as its UTF-8 bytes, a non-UTF-8
    name's own bytes). A relative path stays a relative reference (code scanning reads it against the repository
    root); an absolute one becomes a ``file://`` URI (SARIF 2.1.0 §3.10.2: a URI or a relative reference)."""
    name = path.replace("\\", "/") if os.sep == "\\" else path
    raw = os.fsencode(name)
    if os.path.isabs(name):
        return "file://" + quote(raw, safe="/")
    return quote(raw, safe="/")


@reporter("github")
def github_report(reports: list[Report], out: TextIO, verbose: bool) -> None:
    """GitHub Actions workflow commands: ::error file=...,line=...,col=...,title=...::message"""
    level = {ERROR: "error", WARNING: "warning", INFO: "notice"}
    for r in reports:
        for f in r.findings:
            if f.severity == INFO and not verbose:
                continue
            props = f"file={_gh_escape(r.path, True)},line={f.line},col={f.column},title={_gh_escape(f.rule, True)}"
            out.write(f"::{level[f.severity]} {props}::{_gh_escape(f.message)}\n")


@reporter("sarif")
def sarif_report(reports: list[Report], out: TextIO, verbose: bool) -> None:
    """SARIF 2.1.0 for code scanning."""
    from ledgerspec.checks.catalogue import all_rules

    rules = all_rules()
    extra = [
        ("schema", "document does not match the JSON Schema"),
        ("header", "unknown document kind/version"),
        ("load", "file cannot be read as a ledger"),
    ]
    descriptors = [
        {
            "id": r.id,
            "name": r.id,
            "shortDescription": {"text": r.title},
            "help": {"text": r.hint},
            "defaultConfiguration": {"level": _sarif_level(r.severity.split(" ")[0])},
        }
        for r in rules
    ]
    descriptors += [
        {"id": i, "name": i, "shortDescription": {"text": t}, "defaultConfiguration": {"level": "error"}}
        for i, t in extra
    ]
    index = {d["id"]: n for n, d in enumerate(descriptors)}
    results = []
    for r in reports:
        for f in r.findings:
            result: dict[str, Any] = {"ruleId": f.rule}
            if f.rule in index:
                result["ruleIndex"] = index[f.rule]
            result.update(
                {
                    "level": _sarif_level(f.severity),
                    "message": {"text": encodable(f.message)},
                    "locations": [
                        {
                            "physicalLocation": {
                                "artifactLocation": {"uri": sarif_uri(r.path)},
                                "region": {"startLine": f.line, "startColumn": f.column},
                            },
                            "logicalLocations": [{"fullyQualifiedName": encodable(f.pointer or "/")}],
                        }
                    ],
                }
            )
            results.append(result)
    sarif = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "ledgerspec",
                        "version": __version__,
                        "informationUri": "https://ledgerspec.dev",
                        "rules": descriptors,
                    }
                },
                "results": results,
            }
        ],
    }
    out.write(json_text(json.dumps(sarif, indent=2, ensure_ascii=False)))
    out.write("\n")


def _sarif_level(severity: str) -> str:
    return {ERROR: "error", WARNING: "warning", INFO: "note"}.get(severity, "warning")
