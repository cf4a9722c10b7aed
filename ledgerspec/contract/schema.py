"""The committed JSON Schema files: where they live, and a cached compiled validator."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILES = {"ledger": "ledger.v1.json", "intake": "intake.v1.json", "defs": "defs.v1.json"}


def schema_dir() -> Path:
    """``ledgerspec/_schema`` inside a wheel, the repository's ``schema/`` in a source checkout."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "_schema"
    if packaged.is_dir():
        return packaged
    return here.parent / "schema"


@cache
def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema ``ledger``, ``intake`` or ``defs`` as committed."""
    if name not in SCHEMA_FILES:
        raise KeyError(name)
    with open(schema_dir() / SCHEMA_FILES[name], encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def schema_text(name: str) -> str:
    return (schema_dir() / SCHEMA_FILES[name]).read_text(encoding="utf-8")


@cache
def validator(kind: str) -> Any:
    """A compiled draft 2020-12 validator for ``kind``; built once per process."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    resources = [(load_schema(n)["$id"], Resource.from_contents(load_schema(n))) for n in SCHEMA_FILES]
    registry: Registry[Any] = Registry().with_resources(resources)
    return Draft202012Validator(load_schema(kind), registry=registry)
