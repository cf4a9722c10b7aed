"""The intake an import builds: each value with where it came from, the findings, and the rendered ``intake/v1``.

Three kinds of value (spec, "Value forms and provenance"):

- read from a file: a plain value, with an end-of-line comment naming the file's key (``# axolotl: lora_r``);
- a tool's default (the key is absent from the file): ``{value, source: ASSUMPTION, note}``, the note naming the tool,
  its version and the default (ASSUMPTION caps the status at CANDIDATE until the user confirms it);
- not knowable from the files: ``UNKNOWN`` (written only for the minimum intake, so ``validate`` lists them).

Two files that give one field different values are a conflict: the first file's value is kept and a finding says
so. Every finding is also recorded in the document's ``x-import`` extension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import fields as F

Path = tuple[str, ...]


@dataclass(frozen=True)
class Finding:
    """Something the import could not carry over as it is, at a key of a source file."""

    file: str
    line: int | None
    column: int | None
    key: str  # the source key (dotted for nested keys), "" for the file
    message: str
    kind: str  # unknown-key | not-modelled | conflict | unknown | refused-value | note

    def format(self) -> str:
        loc = self.file
        if self.line is not None:
            loc += f":{self.line}"
            if self.column is not None:
                loc += f":{self.column}"
        head = f"{self.key}: " if self.key else ""
        return f"{loc}: import: {head}{self.message}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file}
        if self.line is not None:
            out["line"] = self.line
        out["key"] = self.key
        out["kind"] = self.kind
        out["message"] = self.message
        return out


@dataclass
class Entry:
    path: Path
    value: Any  # None: UNKNOWN
    origin: str  # the comment: where the value came from
    note: str | None = None  # set: an ASSUMPTION (a tool default) with this note
    file: str = ""

    @property
    def assumed(self) -> bool:
        return self.note is not None

    @property
    def unknown(self) -> bool:
        return self.value is None


@dataclass
class Builder:
    """Collects entries and findings from every source, then renders one ``intake/v1``."""

    entries: dict[Path, Entry] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)  # "axolotl 0.18.0 (file)" lines for x-import
    ignored: dict[str, list[str]] = field(default_factory=dict)  # file -> keys with no effect on memory
    not_modelled: dict[str, dict[str, Any]] = field(default_factory=dict)  # file -> key -> value
    unknown_keys: dict[str, list[str]] = field(default_factory=dict)  # file -> keys the tool does not have
    titles: list[str] = field(default_factory=list)
    config_files: list[str] = field(default_factory=list)  # model config.json files given (identity.config_path)
    facts: dict[str, Any] = field(default_factory=dict)  # what one file tells the others (e.g. trl: True)

    # -- values --------------------------------------------------------------------------------------------------
    def set(self, path: Path, value: Any, origin: str, file: str = "", where: tuple[Any, Any] = (None, None)) -> None:
        """A value read from ``file``. A different value from an earlier file is a conflict (the first is kept)."""
        _check_path(path)
        old = self.entries.get(path)
        if old is not None and not old.assumed and not old.unknown:
            if _same(old.value, value):
                if file and file != old.file:
                    old.origin += f"; also {origin}"
                return
            self.finding(
                file,
                where,
                origin,
                f"conflicts with {old.file or 'an earlier file'} ({old.origin}): {_show(value)} here, "
                f"{_show(old.value)} there; the ledger keeps {_show(old.value)} ({'.'.join(path)})",
                "conflict",
            )
            return
        self.entries[path] = Entry(path, value, origin, None, file)

    def assume(self, path: Path, value: Any, origin: str, note: str, file: str = "") -> None:
        """A tool's default for a key the file does not set: ASSUMPTION with ``note`` (never over a read value)."""
        _check_path(path)
        old = self.entries.get(path)
        if old is not None and not old.unknown:
            return
        self.entries[path] = Entry(path, value, origin, note, file)

    def force(self, path: Path, value: Any, origin: str, file: str = "") -> None:
        """A value the tool sets whatever the files say (TRL overriding a setting it cannot train with): replaces an
        earlier entry, and the origin says which value it replaced."""
        _check_path(path)
        old = self.entries.get(path)
        if old is not None and old.value is not None and not _same(old.value, value):
            origin += f" (over {_show(old.value)}: {old.origin})"
        self.entries[path] = Entry(path, value, origin, None, file or (old.file if old is not None else ""))

    def unknown(self, path: Path, origin: str, file: str = "") -> None:
        """A field the files cannot tell (written UNKNOWN; never over a value)."""
        _check_path(path)
        if path not in self.entries:
            self.entries[path] = Entry(path, None, origin, None, file)

    def value(self, path: Path) -> Any:
        e = self.entries.get(path)
        return None if e is None else e.value

    def read_from_file(self, path: Path) -> bool:
        """Whether ``path`` holds a value read from a file (not a default, not UNKNOWN)."""
        e = self.entries.get(path)
        return e is not None and not e.assumed and not e.unknown

    # -- findings ------------------------------------------------------------------------------------------------
    def finding(self, file: str, where: tuple[Any, Any], key: str, message: str, kind: str) -> None:
        self.findings.append(Finding(file, where[0], where[1], key, message, kind))

    # -- the document --------------------------------------------------------------------------------------------
    def render(self) -> str:
        """The ``intake/v1`` text: sections and keys in catalogue order, comments saying where each value came from."""
        from ledgerspec.contract.imports.render import render

        return render(self)


def _check_path(path: Path) -> None:
    if F.lookup("intake", path) is None:  # a programming error in a mapping table, never the user's input
        raise ValueError(f"not an intake field: {'.'.join(path)}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(str, a)) == sorted(map(str, b))
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
