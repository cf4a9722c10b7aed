"""Import helpers: the fixtures under tests/data/imports and a document made from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document, from_text
from ledgerspec.contract.imports import Imported, import_files
from tests.support import DATA

IMPORTS = DATA / "imports"


def imported(*paths: str | Path, **kw: Any) -> tuple[Document, Imported]:
    """Import ``paths`` (relative to tests/data/imports) into an intake document."""
    result = import_files([str(IMPORTS / p) for p in paths], **kw)
    return from_text(result.text, "<import>"), result


def plain(doc: Document, *path: str) -> Any:
    """The value at ``path`` when it was read from a file (a plain value), else a marker of its form."""
    v = doc.get(*path)
    if v.form == "plain":
        return v.value
    if v.form == "long":
        return ("ASSUMPTION", v.value) if v.source == "ASSUMPTION" else (v.source, v.value)
    return v.form if v.form == "absent" else "UNKNOWN"


def keys_of(result: Imported, kind: str) -> list[str]:
    return [f.key for f in result.findings if f.kind == kind]
