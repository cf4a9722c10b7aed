"""mkdocs hook: the pages that are generated from the code at build time, never copied by hand.

Markers in the Markdown pages are replaced when the site is built:

- ``<!-- ledgerspec:fields -->``: the field reference, read from ``schema/*.json``;
- ``<!-- ledgerspec:rules -->``: the rule catalogue, from ``ledgerspec.checks.catalogue.all_rules()``, with
  each rule's example validated now and the finding it really produces;
- ``<!-- ledgerspec:gallery -->``: every file in ``examples/`` with its validation result and its HTML
  report (written next to the page as ``reports/NAME.html``);
- ``<!-- ledgerspec:cli -->``: ``ledgerspec COMMAND --help`` for every command of this build;
- ``<!-- ledgerspec:differences -->``: the known stack differences, from ``ledgerspec.contract.differences.KNOWN``;
- ``<!-- ledgerspec:outside -->``: what lies outside the caching allocator, from
  ``ledgerspec/derivations/devices/outside.yaml`` (:func:`ledgerspec.derivations.devices.outside.markdown`).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schema"
EXAMPLES = ROOT / "examples"
log = logging.getLogger("mkdocs.hooks.ledgerspec")


# -- files ------------------------------------------------------------------------------------------
def on_files(files: Files, config: Any) -> Files:
    for path in example_files():
        files.append(File.generated(config, f"reports/{path.stem}.html", content=example_report_html(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    generators = {
        "<!-- ledgerspec:fields -->": fields_markdown,
        "<!-- ledgerspec:rules -->": rules_markdown,
        "<!-- ledgerspec:gallery -->": gallery_markdown,
        "<!-- ledgerspec:cli -->": cli_markdown,
        "<!-- ledgerspec:differences -->": differences_markdown,
        "<!-- ledgerspec:outside -->": outside_markdown,
    }
    for marker, make in generators.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


# -- field reference (from the JSON Schema) ---------------------------------------------------------
def _schema(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SCHEMA / f"{name}.v1.json").read_text(encoding="utf-8"))
    return data


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def value_type(prop: dict[str, Any]) -> str:
    """A short name for what a property accepts: size, count, switch, one of (...), list of sizes ..."""
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return "one of " + ", ".join(f"`{v}`" for v in prop["enum"])
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        if name == "status":
            return "one of " + ", ".join(f"`{v}`" for v in _schema("defs")["$defs"]["status"]["enum"])
        return {"size": "size", "count": "count", "switch": "switch", "strings": "string or list of strings"}.get(
            name, name
        )
    if prop.get("type") == "object":
        return "mapping" if "properties" in prop else "mapping (free-form)"
    if prop.get("type") == "array":
        return "list of " + value_type(prop.get("items", {}))
    if isinstance(prop.get("type"), str):
        t = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}[prop["type"]]
        if "minimum" in prop:
            t += f" ≥ {prop['minimum']:g}"
        return t
    options = prop.get("anyOf", [])
    plain = [o for o in options if not str(o.get("$ref", "")).endswith(("unknownWord", "longForm"))]
    if plain:
        return " or ".join(value_type(o) for o in plain)
    if options:
        return "long form"
    return "anything"


def _forms(prop: dict[str, Any]) -> str:
    refs = [str(o.get("$ref", "")) for o in prop.get("anyOf", [])]
    words = []
    if any(r.endswith("unknownWord") for r in refs):
        words.append("UNKNOWN")
    if any(r.endswith("longForm") for r in refs):
        words.append("long form")
    return ", ".join(words)


def _rows(props: dict[str, Any], prefix: str) -> list[str]:
    rows = []
    for name, prop in props.items():
        key = f"{prefix}{name}"  # relative to the section the table is under
        rows.append(
            f"| `{key}` | {_cell(value_type(prop))} | {_cell(_forms(prop))} | {_cell(prop.get('description', ''))} |"
        )
        if prop.get("type") == "object" and "properties" in prop:
            rows += _rows(prop["properties"], f"{key}.")
    return rows


def _table(props: dict[str, Any], prefix: str = "") -> str:
    head = ["| key | value | also accepts | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join(head + _rows(props, prefix))


def fields_markdown() -> str:
    ledger, intake, defs = _schema("ledger"), _schema("intake"), _schema("defs")
    out = [f"_Generated from `schema/ledger.v1.json` ({ledger['$id']}) when this site was built._", ""]
    top = {k: v for k, v in ledger["properties"].items() if v.get("type") != "object"}
    out += ["## Top-level keys", "", _table(top), ""]
    for name, prop in ledger["properties"].items():
        if prop.get("type") != "object":
            continue
        out += [f"## `{name}`", "", _cell(prop.get("description", "")), "", _table(prop.get("properties", {})), ""]
    only_intake = {k: v for k, v in intake["properties"].items() if k not in ledger["properties"]}
    shared = [
        k for k in intake["properties"] if k in ledger["properties"] and intake["properties"][k].get("type") == "object"
    ]
    out += [
        "## `intake/v1`",
        "",
        _cell(intake.get("description", "")),
        "",
        "Its sections have the same keys as in a ledger: " + ", ".join(f"`{k}`" for k in shared) + ".",
        "Only in an intake:",
        "",
        _table(only_intake),
        "",
    ]
    out += [
        "## Shared definitions",
        "",
        f"_From `schema/defs.v1.json` ({defs['$id']})._",
        "",
        "| name | meaning |",
        "| --- | --- |",
    ]
    out += [f"| `{k}` | {_cell(v.get('description', ''))} |" for k, v in defs["$defs"].items()]
    return "\n".join(out) + "\n"


# -- rule catalogue (from the registry, examples validated now) -------------------------------------
def rule_example_document(example: str) -> str:
    return "ledgerspec: ledger/v1\n" + example.rstrip() + "\n"


def differences_markdown() -> str:
    from ledgerspec.contract.differences import KNOWN, NEWER, OLDER

    out = ["| id | versions | what they hold | what the other versions hold | moves | sources |", "| --- " * 6 + "|"]
    for d in KNOWN:
        sources = "<br>".join(_cell(s) for s in d.sources)
        out.append(
            f"| `{d.id}` | {_cell(d.span(OLDER))} | {_cell(d.older)} | {_cell(d.span(NEWER))}: {_cell(d.newer)} | "
            f"{_cell(d.figures)} | {sources} |"
        )
    return "\n".join(out) + "\n"


def outside_markdown() -> str:
    from ledgerspec.derivations.devices.outside import markdown

    return markdown()


def rules_markdown() -> str:
    from ledgerspec.checks.catalogue import all_rules
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import from_text

    out = ["| id | severity | what it catches |", "| --- | --- | --- |"]
    rules = all_rules()
    out += [f"| [{r.id}](#{r.id.lower()}) | {r.severity} | {_cell(r.title)} |" for r in rules]
    out.append("")
    for r in rules:
        out += [f"## {r.id}", "", f"**{_cell(r.title)}** · severity: {r.severity}", "", f"**How to fix:** {r.hint}", ""]
        if not r.example:
            out += ["_No example in the registry._", ""]
            continue
        text = rule_example_document(r.example)
        report = validate(from_text(text, "example.yaml"))
        hits = [f for f in report.findings if f.rule == r.id]
        out += [
            "Example that triggers it:",
            "",
            "```yaml",
            text.rstrip(),
            "```",
            "",
            "What `ledgerspec validate -v example.yaml` reports for it:",
            "",
            "```text",
        ]
        out += [f"example.yaml:{f.line}:{f.column}: {f.rule} {f.severity}: {f.message}" for f in hits] or [
            f"(no {r.id} finding: the registry example does not trigger its rule)"
        ]
        out += ["```", ""]
    return "\n".join(out)


# -- examples gallery -------------------------------------------------------------------------------
def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*.yaml") if p.is_file())


def _display(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def example_report_html(path: Path) -> str:
    from ledgerspec.contract.document import load
    from ledgerspec.faces.report.data import gather
    from ledgerspec.faces.report.html import render_html

    return render_html(gather(load(path, _display(path))))


def gallery_markdown() -> str:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load
    from ledgerspec.faces.reporters import REPORTERS

    out = ["| example | kind | supported status | declared | valid |", "| --- | --- | --- | --- | --- |"]
    sections = []
    for path in example_files():
        doc = load(path, _display(path))
        report = validate(doc)
        buf = io.StringIO()
        REPORTERS["text"]([report], buf, True)
        title = doc.get("title").text() or path.name
        anchor = path.stem.replace(".", "-")
        out.append(
            f"| [{path.name}](#{anchor}) | {doc.kind}/v1 | {report.supported_status} | "
            f"{report.declared_status or '—'} | {'yes' if report.ok else 'no (errors)'} |"
        )
        sections += [
            f"## {path.name} {{#{anchor}}}",
            "",
            f"**{_cell(title)}**",
            "",
            f"`ledgerspec validate -v {_display(path)}`:",
            "",
            "```text",
            buf.getvalue().rstrip(),
            "```",
            "",
            f"`ledgerspec report {_display(path)} --html report.html` ([open it full size](reports/{path.stem}.html)):",
            "",
            f'<iframe class="ledger-report" src="reports/{path.stem}.html" loading="lazy" '
            f'title="HTML report of {path.name}"></iframe>',
            "",
            f'??? example "The file: {path.name}"',
            "",
            "    ```yaml",
        ]
        sections += [f"    {line}".rstrip() for line in path.read_text(encoding="utf-8").splitlines()]
        sections += ["    ```", ""]
    return "\n".join([*out, "", *sections]) + "\n"


# -- command line help ------------------------------------------------------------------------------
def cli_markdown() -> str:
    from ledgerspec.faces.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    choices: dict[str, Any] = getattr(sub, "choices", {})
    out = ["```text", parser.format_help().rstrip(), "```", ""]
    for name, p in choices.items():
        out += [f"## `ledgerspec {name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)
