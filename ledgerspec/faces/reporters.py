"""Output formats for ``validate``: a registry of reporters (text, json, github, sarif)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TextIO

from ledgerspec.checks.findings import ERROR, INFO, WARNING
from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.validate import Report
from ledgerspec.checks.verdict import next_status, next_steps
from ledgerspec.version import __version__

Reporter = Callable[[list[Report], TextIO, bool], None]
REPORTERS: dict[str, Reporter] = {}


def reporter(name: str) -> Callable[[Reporter], Reporter]:
    def register(fn: Reporter) -> Reporter:
        REPORTERS[name] = fn
        return fn

    return register


@reporter("text")
def text_report(reports: list[Report], out: TextIO, verbose: bool) -> None:
    for r in reports:
        if verbose and r.verdict is not None:  # the answer first: does it fit, and by how much
            out.write(f"{r.path}: {r.verdict.sentence()}\n")
        for f in r.findings:
            if f.severity == INFO and not verbose:
                continue
            out.write(f"{r.path}:{f.line}:{f.column}: {f.rule}: {f.severity}: {f.message}\n")
        if r.supported_status is not None:
            declared = r.declared_status or "none declared"
            out.write(
                f"{r.path}: {r.kind}/v1, status {r.supported_status} (declared: {declared})"
                f"{'' if r.ok else ', INVALID'}\n"
            )
            for line in status_lines(r, verbose):
                out.write(line + "\n")
    infos = sum(1 for r in reports for f in r.findings if f.severity == INFO)
    if infos and not verbose:
        out.write(f"({infos} info finding(s) hidden; -v shows them)\n")


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
    json.dump({"files": [r.to_json() for r in reports]}, out, indent=2, ensure_ascii=False)
    out.write("\n")


def _gh_escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


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
    from ledgerspec.checks.registry import all_rules

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
                    "message": {"text": f.message},
                    "locations": [
                        {
                            "physicalLocation": {
                                "artifactLocation": {"uri": r.path.replace("\\", "/")},
                                "region": {"startLine": f.line, "startColumn": f.column},
                            },
                            "logicalLocations": [{"fullyQualifiedName": f.pointer or "/"}],
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
    json.dump(sarif, out, indent=2)
    out.write("\n")


def _sarif_level(severity: str) -> str:
    return {ERROR: "error", WARNING: "warning", INFO: "note"}.get(severity, "warning")
