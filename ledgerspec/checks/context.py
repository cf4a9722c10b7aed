"""What every rule sees: the document, its supported status, and small typed accessors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, pointer
from ledgerspec.contract.values import Value

if TYPE_CHECKING:
    from ledgerspec.checks.ladder import StatusResult


@dataclass
class Context:
    doc: Document
    status: StatusResult

    @property
    def kind(self) -> str:
        return self.doc.kind or "ledger"

    def get(self, *path: str) -> Value:
        return self.doc.get(*path)

    def switch(self, *path: str) -> bool | None:
        return self.doc.get(*path).switch()

    def measured(self) -> bool:
        """True when ``phases`` or ``metrics`` hold a MEASURED figure ("when measured" in the spec)."""
        return is_measured(self.doc)

    def fields(self) -> Iterator[tuple[tuple[str, ...], F.Field, Value]]:
        """Every present catalogue field with its value (list items of figure lists included)."""
        yield from present_fields(self.doc)


def present_fields(doc: Document) -> Iterator[tuple[tuple[str, ...], F.Field, Value]]:
    for path, field in F.walk(F.top_fields(doc.kind or "ledger")):
        if field.kind == F.OBJECT:
            continue
        v = doc.get(*path)
        if not v.present:
            continue
        yield path, field, v
        if field.kind == F.FIGURES and v.form == "plain" and isinstance(v.raw, list):
            for i, item in enumerate(v.raw):
                yield (*path, str(i)), field, Value.of(item)


def is_measured(doc: Document) -> bool:
    for section in ("phases", "metrics"):
        for key in doc.section(section):
            if doc.get(section, key).source == "MEASURED":
                return True
    return False


def ptr(*path: str) -> str:
    return pointer(*path)
