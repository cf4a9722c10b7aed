"""``ledgerspec init``: a ledger skeleton with every field UNKNOWN and the article's guidance as comments."""

from __future__ import annotations

import textwrap
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, from_text, rebase
from ledgerspec.contract.writer import render

_WIDTH = 100
# the catalogue fields that are free-form: left out of the skeleton rather than written UNKNOWN
_SKIP = {("notes",), ("title",), ("status",)}


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, _WIDTH - len(indent) - 2)]


def _lines(fields: tuple[F.Field, ...], depth: int, prefix: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    indent = "  " * depth
    for f in fields:
        path = (*prefix, f.name)
        if path in _SKIP:
            continue
        if f.kind == F.OBJECT:
            if depth == 0:
                out.append("")
            out += _comment(f.description, indent)
            out.append(f"{indent}{f.name}:")
            out += _lines(f.children, depth + 1, path)
        else:
            out += _comment(f.description, indent)
            out.append(f"{indent}{f.name}: UNKNOWN")
    return out


def skeleton_text(kind: str = "ledger") -> str:
    head = [
        "# Training Memory Ledger skeleton (ledgerspec init). Every field is UNKNOWN: replace each with a",
        "# plain value, or the long form",
        "# {value: ..., source: MEASURED|VERIFIED|CALCULATED|ASSUMPTION, note: ..., method: ...}.",
        "# `ledgerspec resolve` fills the derivable figures; `ledgerspec validate` says what holds the status down.",
        f"ledgerspec: {kind}/v1",
        "status: INSUFFICIENT DATA",
        "title: UNKNOWN",
    ]
    return "\n".join([*head, *_lines(F.top_fields(kind), 0, ())]) + "\n"


def skeleton(from_intake: Document | None = None, output: str | None = None) -> str:
    """A ledger skeleton; with ``from_intake``, the values of its intake sections are copied in.

    The skeleton's guidance comments stay; comments written beside keys in the intake do not travel
    (only those inside a copied nested mapping do).

    ``output`` is where the ledger will be written (standard output: the current folder), so that a
    relative ``identity.config_path`` still points at the same file.
    """
    text = skeleton_text("ledger")
    if from_intake is None:
        return text
    doc = from_text(text, "<skeleton>")
    data: Any = doc.data
    src: Any = from_intake.data
    for key, value in src.items():
        if key in ("ledgerspec", "status", "pilot"):
            continue
        if key in data and isinstance(value, dict) and isinstance(data[key], dict):
            for sub, subvalue in value.items():
                data[key][sub] = subvalue
        else:
            data[key] = value
    config_path = from_intake.get("identity", "config_path").text()
    if config_path and from_intake.get("identity", "config_path").form == "plain":
        data["identity"]["config_path"] = rebase(config_path, from_intake.path, output)
    pilot = src.get("pilot")
    if isinstance(pilot, dict):
        for sub in ("peak_allocated", "peak_reserved", "device_peak"):
            if sub in pilot:
                data["metrics"][sub] = pilot[sub]
        if "oom_phase" in pilot:
            data["result"]["oom_phase"] = pilot["oom_phase"]
    return render(data, text)
