"""Generate ``schema/*.v1.json`` from the field catalogue.

Run ``python -m ledgerspec.contract.schema_gen`` after changing :mod:`ledgerspec.contract.fields`;
a test checks that the committed files equal what this produces, byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.units import MAX_BYTES, SIZE_PATTERN

BASE_URI = "https://ledgerspec.dev/schema/"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
DEFS_FILE = "defs.v1.json"
MAX_COUNT = 10**15
_SWITCH_PATTERN = "^(?:[Oo][Nn]|[Oo][Ff][Ff]|[Yy][Ee][Ss]|[Nn][Oo]|[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])$"
_EXT = {"^x-": {"description": "Extension key: anything goes."}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"{DEFS_FILE}#/$defs/{name}"}


def defs_schema() -> dict[str, Any]:
    d: dict[str, Any] = {
        "source": {"description": "Provenance of a value, strongest first.", "enum": list(F.SOURCES)},
        "unknownWord": {
            "description": "The value is not known yet (UNKNOWN) or depends on a stack detail "
            "not yet known (CONFIGURATION-SPECIFIC); both count as unknown.",
            "enum": ["UNKNOWN", "CONFIGURATION-SPECIFIC"],
        },
        "longForm": {
            "description": "The long form of a value: {value, source, note, method}.",
            "type": "object",
            "required": ["source"],
            "properties": {
                "value": {"description": "The value itself."},
                "source": {"$ref": "#/$defs/source", "description": "Where the value came from (provenance word)."},
                "note": {"type": "string", "description": "Why (required for ASSUMPTION)."},
                "method": {"type": "string", "description": "How the value was obtained (formula, tool, command)."},
            },
            "patternProperties": _EXT,
            "additionalProperties": False,
            "if": {"properties": {"source": {"enum": ["MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION"]}}},
            "then": {"required": ["value"]},
        },
        "size": {
            "description": "A quantity of memory: integer bytes, or a number with a unit (B, KB, MB, "
            "GB, TB decimal; KiB, MiB, GiB, TiB binary).",
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": MAX_BYTES},
                {"type": "string", "pattern": SIZE_PATTERN},
            ],
        },
        "count": {
            "description": "A non-negative integer count.",
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_COUNT,
        },
        "switch": {
            "description": "A two-valued switch: true/false, or ON/OFF, YES/NO in any case.",
            "anyOf": [{"type": "boolean"}, {"type": "string", "pattern": _SWITCH_PATTERN}],
        },
        "strings": {
            "description": "A string, or a list of strings.",
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        },
        "status": {
            "description": "The status ladder: INSUFFICIENT DATA < CALCULATED < CANDIDATE < VALIDATED.",
            "enum": list(F.STATUSES),
        },
    }
    return {
        "$schema": DRAFT,
        "$id": BASE_URI + DEFS_FILE,
        "title": "ledgerspec shared definitions, v1",
        "description": "Value forms, provenance and units shared by ledger/v1 and intake/v1.",
        "$defs": d,
    }


def _plain(field: F.Field) -> dict[str, Any]:
    k = field.kind
    if k in (F.MEMORY, F.SIZE):
        return _ref("size")
    if k == F.COUNT:
        return _ref("count")
    if k in (F.SECONDS, F.NUMBER):
        s: dict[str, Any] = {"type": "number"}
        if field.minimum is not None:
            s["minimum"] = field.minimum
        return s
    if k == F.INT:
        s = {"type": "integer", "maximum": MAX_COUNT}
        if field.minimum is not None:
            s["minimum"] = int(field.minimum)
        return s
    if k == F.STRING:
        return {"type": "string"}
    if k == F.SWITCH:
        return _ref("switch")
    if k == F.ENUM:
        return {"enum": list(field.enum)}
    if k == F.STRINGS:
        return _ref("strings")
    if k == F.INTMAP:  # module pattern -> rank; `x-` keys are extensions here too
        return {"type": "object", "patternProperties": _EXT, "additionalProperties": {"type": "integer", "minimum": 1}}
    if k == F.NUMMAP:
        return {"type": "object", "patternProperties": _EXT, "additionalProperties": {"type": "number"}}
    if k == F.STRMAP:
        return {"type": "object", "patternProperties": _EXT, "additionalProperties": {"type": "string"}}
    if k == F.ANY:
        return {}
    raise ValueError(f"no plain schema for kind {k}")


def field_schema(field: F.Field) -> dict[str, Any]:
    if field.kind == F.OBJECT:
        return {"description": field.description, **_object(field.children)}
    if field.kind == F.FIGURES:
        item = {
            "anyOf": [
                _ref("size"),
                _ref("unknownWord"),
                {"$ref": f"{DEFS_FILE}#/$defs/longForm", "properties": {"value": _long_value(_ref("size"))}},
            ]
        }
        return {
            "description": field.description,
            "anyOf": [{"type": "array", "items": item}, _ref("unknownWord"), _ref("longForm")],
        }
    plain = _plain(field)
    if field.kind == F.ANY:
        return {"description": field.description}
    return {
        "description": field.description,
        "anyOf": [
            plain,
            _ref("unknownWord"),
            {"$ref": f"{DEFS_FILE}#/$defs/longForm", "properties": {"value": _long_value(plain)}},
        ],
    }


def _long_value(plain: dict[str, Any]) -> dict[str, Any]:
    return {"description": "The value inside the long form; the same type as the plain value.", **plain}


def _object(children: tuple[F.Field, ...]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {c.name: field_schema(c) for c in children},
        "patternProperties": _EXT,
        "additionalProperties": False,
    }


def document_schema(kind: str) -> dict[str, Any]:
    top = F.top_fields(kind)
    props: dict[str, Any] = {
        "ledgerspec": {
            "description": f"Document kind and version: always `{kind}/v1` for this schema.",
            "const": f"{kind}/v1",
        },
    }
    for f in top:
        if f.name == "status":
            props["status"] = {"description": f.description, "$ref": f"{DEFS_FILE}#/$defs/status"}
        else:
            props[f.name] = field_schema(f)
    title = {"ledger": "Training Memory Ledger, v1", "intake": "Sizing intake, v1"}[kind]
    desc = {
        "ledger": "A Training Memory Ledger for LoRA/QLoRA fine-tuning: every memory component with its "
        "provenance, measurements and the supported status.",
        "intake": "What a user hands over to size a server for LoRA/QLoRA fine-tuning: model, method, dtypes, "
        "workload, optimizer, memory options and pilot results if any.",
    }[kind]
    # The shared definitions are bundled as an embedded resource (JSON Schema 2020-12, section 9.3) under
    # their own $id, so `$ref: defs.v1.json#...` resolves offline in any validator (check-jsonschema, editors)
    # without fetching BASE_URI. schema/defs.v1.json is the same resource, standalone.
    bundled = {k: v for k, v in defs_schema().items() if k != "$schema"}
    return {
        "$schema": DRAFT,
        "$id": f"{BASE_URI}{kind}.v1.json",
        "title": title,
        "description": desc,
        "type": "object",
        "required": ["ledgerspec"],
        "properties": props,
        "patternProperties": _EXT,
        "additionalProperties": False,
        "$defs": {"shared": bundled},
    }


def all_schemas() -> dict[str, dict[str, Any]]:
    return {
        DEFS_FILE: defs_schema(),
        "ledger.v1.json": document_schema("ledger"),
        "intake.v1.json": document_schema("intake"),
    }


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0] if argv else Path(__file__).resolve().parents[2] / "schema")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in all_schemas().items():
        (out / name).write_text(render(schema), encoding="utf-8")
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
