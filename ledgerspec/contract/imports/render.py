"""Render a :class:`~ledgerspec.contract.imports.builder.Builder` as ``intake/v1`` YAML text (ruamel, comments kept)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from ledgerspec.contract import fields as F
from ledgerspec.contract import writer
from ledgerspec.errors import printable

if TYPE_CHECKING:
    from ledgerspec.contract.imports.builder import Builder, Entry

_HEAD = """\
# Imported by `ledgerspec import` (mapping: docs "From your setup"). The comment beside each value names the
# setting it came from. {{value, source: ASSUMPTION, note}} is a tool's default for a setting the file does not
# give: confirm it (write the plain value) or change it. UNKNOWN: the files cannot tell; give it.
# Findings (settings not carried over) are listed in x-import at the end.
"""


def render(b: Builder) -> str:
    doc = CommentedMap()
    doc["ledgerspec"] = "intake/v1"
    doc["status"] = "INSUFFICIENT DATA"
    doc.yaml_add_eol_comment("# `ledgerspec validate` says what the evidence supports", "status")
    if b.titles:
        doc["title"] = b.titles[0]
    for section in F.INTAKE_SECTIONS:
        node = _section(b, section, (section.name,))
        if node:
            doc[section.name] = node
    doc["x-import"] = _extension(b)
    body = re.sub(r"\n(?=[a-z]|x-import:)", "\n\n", writer.render(doc, ""))
    body = body.replace("\n\nstatus:", "\nstatus:").replace("\n\ntitle:", "\ntitle:")
    return _HEAD.format() + body


def _section(b: Builder, f: F.Field, path: tuple[str, ...]) -> CommentedMap:
    node = CommentedMap()
    for child in f.children:
        p = (*path, child.name)
        if child.kind == F.OBJECT:
            sub = _section(b, child, p)
            if sub:
                node[child.name] = sub
            continue
        e = b.entries.get(p)
        if e is None:
            continue
        node[child.name] = _value(e)
        node.yaml_add_eol_comment("# " + _one_line(e.origin), child.name)
    return node


def _value(e: Entry) -> Any:
    if e.unknown:
        return "UNKNOWN"
    value = _plain(e.value)
    if not e.assumed:
        return value
    long = CommentedMap()
    long["value"] = value
    long["source"] = "ASSUMPTION"
    long["note"] = e.note
    long.fa.set_flow_style()
    return long


def _plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        seq = CommentedSeq(_plain(v) for v in value)
        seq.fa.set_flow_style()
        return seq
    if isinstance(value, dict):
        m = CommentedMap((str(k), _plain(v)) for k, v in value.items())
        m.fa.set_flow_style()
        return m
    return value


def _extension(b: Builder) -> CommentedMap:
    x = CommentedMap()
    x["tools"] = CommentedSeq(b.tools)
    if b.findings:
        seq = CommentedSeq()
        for f in b.findings:
            m = CommentedMap(f.as_dict())
            m.fa.set_flow_style()
            seq.append(m)
        x["findings"] = seq
    if any(b.not_modelled.values()):
        x["not_modelled"] = CommentedMap(
            (file, CommentedMap((k, _plain(v)) for k, v in keys.items()))
            for file, keys in b.not_modelled.items()
            if keys
        )
    if any(b.unknown_keys.values()):
        x["unknown_keys"] = CommentedMap((file, _plain(keys)) for file, keys in b.unknown_keys.items() if keys)
    if any(b.ignored.values()):
        x["ignored"] = CommentedMap((file, _plain(keys)) for file, keys in b.ignored.items() if keys)
        x.yaml_set_comment_before_after_key(
            "ignored",
            before="settings of the tools that do not change training memory (learning rate, logging...)",
            indent=2,
        )
    return x


def _one_line(text: str) -> str:
    """A comment's text: one line, and a control character of the user's value (which YAML forbids in a comment)
    written as its escape."""
    return printable(" ".join(text.split()))
