"""The document model: a loaded ledger or intake, its round-trip tree and its positions."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.loader import parse, read_document_bytes, to_plain
from ledgerspec.contract.values import Value
from ledgerspec.errors import EXIT_FINDINGS, EXIT_USAGE, LedgerspecError

HEADER_RE = re.compile(r"^(?P<kind>[a-z]+)/v(?P<version>[0-9]+)$")
#: a version number longer than this is no version (and ``int()`` of over 4,300 digits raises)
MAX_VERSION_DIGITS = 9


@dataclass
class Document:
    """A ledgerspec document. ``data`` is the round-trip tree (comments kept), ``plain`` a JSON copy."""

    path: str
    text: str
    data: Any
    plain: dict[str, Any]
    kind: str | None = None
    version: int | None = None
    _cache: dict[tuple[str, ...], Value] = field(default_factory=dict, repr=False)
    #: readings derived from the values (e.g. :func:`ledgerspec.contract.config.read`), dropped on every edit
    memo: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the file started with a UTF-8 byte order mark (write-back keeps it)
    bom: bool = False
    #: the paths edited since loading (:mod:`ledgerspec.contract.edit` records them)
    edits: set[tuple[str, ...]] = field(default_factory=set, repr=False)
    #: ``(old, new, comment)`` of a status set by :func:`ledgerspec.contract.edit.set_status`
    status_edit: tuple[Any, str, str] | None = field(default=None, repr=False)
    #: ``(real path, sha256 of the bytes read)`` of the file this document was loaded from: a save to that file
    #: first checks that nobody wrote it meanwhile (:func:`ledgerspec.contract.writer.save`)
    origin: tuple[str, str] | None = field(default=None, repr=False)
    #: what the files the document names looked like when it was loaded (:func:`ledgerspec.contract.files.observe`)
    facts: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- reading --------------------------------------------------------------------------------
    def get(self, *path: str) -> Value:
        """The value at ``path`` (section, key, ...), in any of the three forms."""
        cached = self._cache.get(path)
        if cached is not None:
            return cached
        node: Any = self.plain
        present = True
        for part in path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                present = False
                break
        value = Value.of(node, present)
        self._cache[path] = value
        return value

    def as_written(self, *path: str) -> str | None:
        """A number's text as the file wrote it (``4.50``, which YAML reads as 4.5), at ``path`` or in the long form
        there; None for anything else (not a number, not in the file, or written as Python would print it)."""
        node = self.data
        for part in path:
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        if isinstance(node, dict):
            node = node.get("value")
        source = getattr(node, "source", None)
        return source if isinstance(source, str) else None

    def section(self, name: str) -> dict[str, Any]:
        node = self.plain.get(name)
        return node if isinstance(node, dict) else {}

    def field(self, *path: str) -> F.Field | None:
        return F.lookup(self.kind or "ledger", path)

    # -- positions ------------------------------------------------------------------------------
    def position(self, pointer: str) -> tuple[int, int]:
        """1-based (line, column) of the node at a JSON Pointer; the nearest existing ancestor if absent."""
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]] if pointer else []
        node: Any = self.data
        line, col = 1, 1
        for part in parts:
            try:
                if isinstance(node, dict):
                    if part not in node:
                        break
                    ln, cl = node.lc.key(part)  # type: ignore[attr-defined]
                    line, col = ln + 1, cl + 1
                    node = node[part]
                elif isinstance(node, list):
                    i = int(part)
                    ln, cl = node.lc.item(i)  # type: ignore[attr-defined]
                    line, col = ln + 1, cl + 1
                    node = node[i]
                else:
                    break
            except (AttributeError, KeyError, IndexError, ValueError, TypeError):
                break
        return line, col

    def invalidate(self) -> None:
        self._cache.clear()
        self.memo.clear()

    def edited(self, path: tuple[str, ...]) -> None:
        """Record an edit of ``path`` (called by :mod:`ledgerspec.contract.edit` only) and drop cached readings."""
        self.edits.add(path)
        self.invalidate()


def rebase(config_path: str, doc_path: str, new_path: str | None) -> str:
    """A path relative to the document at ``doc_path``, re-expressed relative to ``new_path`` (None: the cwd)."""
    if os.path.isabs(config_path) or doc_path.startswith("<"):
        return config_path
    target = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(doc_path)), config_path))
    here = os.path.dirname(os.path.abspath(new_path)) if new_path else os.getcwd()
    return os.path.relpath(target, here).replace(os.sep, "/")


def relocate(doc: Document, new_path: str) -> None:
    """Make ``doc`` live at ``new_path`` (``-o OUT``): a relative ``identity.config_path`` is rewritten so it
    still names the same file; its comments and quoting style are kept."""
    if os.path.abspath(new_path) == os.path.abspath(doc.path) or doc.path.startswith("<"):
        return
    identity: Any = doc.data.get("identity") if isinstance(doc.data, dict) else None
    old = identity.get("config_path") if isinstance(identity, dict) else None
    if isinstance(identity, dict) and isinstance(old, str) and old.strip() not in ("UNKNOWN", "CONFIGURATION-SPECIFIC"):
        new = rebase(old, doc.path, new_path)
        if new != old:
            identity["config_path"] = type(old)(new) if type(old) is not str else new
            doc.plain["identity"]["config_path"] = new
            doc.edited(("identity", "config_path"))
    doc.path = new_path


def pointer(*path: str | int) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def error_at(
    doc: Document,
    path: tuple[str, ...],
    message: str,
    *,
    rule: str,
    hint: str | None = None,
    exit_code: int = EXIT_FINDINGS,
) -> LedgerspecError:
    """A :class:`LedgerspecError` at the position of ``path`` in ``doc`` (its nearest existing ancestor)."""
    line, col = doc.position(pointer(*path))
    return LedgerspecError(message, doc.path, line, col, rule=rule, hint=hint, exit_code=exit_code)


class ErrorAt:
    """:func:`error_at` with one command's rule name and exit code: ``_err = ErrorAt("estimate")``, then
    ``raise _err(doc, path, message, hint)``."""

    def __init__(self, rule: str, exit_code: int = EXIT_FINDINGS) -> None:
        self.rule = rule
        self.exit_code = exit_code

    def __call__(
        self,
        doc: Document,
        path: tuple[str, ...],
        message: str,
        hint: str | None = None,
        *,
        rule: str | None = None,
        exit_code: int | None = None,
    ) -> LedgerspecError:
        return error_at(
            doc,
            path,
            message,
            rule=rule or self.rule,
            hint=hint,
            exit_code=self.exit_code if exit_code is None else exit_code,
        )


def set_path(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """``node[a][b]...[z] = value`` for ``path`` (a, b, ..., z), creating (or replacing non-mapping) parents."""
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[path[-1]] = value


def from_text(text: str, display: str = "<input>") -> Document:
    """A document from its text; ``display`` is its path (``<stdin>``, ``<input>``: relative paths it names are
    read from the current folder, as the commands read them)."""
    from ledgerspec.contract.files import observe

    data = parse(text, display)
    doc = _build(display, text, data)
    doc.facts = observe(doc)
    return doc


def load(path: str | os.PathLike[str], display: str | None = None) -> Document:
    """Load a ledger or intake file; raises :class:`LedgerspecError` with FILE:LINE:COL on bad input."""
    shown = display or os.fsdecode(path)
    text, bom, digest = read_document_bytes(Path(path), shown)
    doc = from_text(text, shown)
    doc.bom = bom
    doc.origin = (os.path.realpath(path), digest)
    return doc


def header_problem(doc: Document) -> str | None:
    """Why ``doc``'s header is not one this ledgerspec reads (missing, unknown kind, unsupported version), else
    None. The one wording, for ``validate`` (a finding) and for every other command (a refusal)."""
    header = doc.plain.get("ledgerspec")
    supported = ", ".join(f"{k}/v{v}" for k, vs in F.VERSIONS.items() for v in vs)
    if header is None:
        return f"missing header `ledgerspec:`; the first key names the document kind ({supported})"
    shown = _short_repr(header)
    if doc.kind is None:
        return f"unknown document kind {shown}; supported: {supported}"
    if doc.version not in F.VERSIONS[doc.kind]:
        return f"unsupported version {shown}; this ledgerspec reads {supported}"
    return None


def _short_repr(value: Any, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = "<a very large number>"
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def require_header(doc: Document, command: str, kinds: tuple[str, ...] = ("ledger", "intake")) -> Document:
    """``doc`` when its header is one this ledgerspec reads and of one of ``kinds``; else the header's refusal
    (exit 2): a command never works on a document ``validate`` rejects for its header (``ledger/v2``)."""
    problem = header_problem(doc)
    if problem is None and doc.kind not in kinds:
        wanted = " or ".join(f"{k}/v{F.VERSIONS[k][-1]}" for k in kinds)
        problem = f"{command} reads a {wanted} document, got {_short_repr(doc.plain.get('ledgerspec'))}"
    if problem is not None:
        raise error_at(doc, ("ledgerspec",), problem, rule="header", exit_code=EXIT_USAGE)
    return doc


def load_for(path: str, command: str, kinds: tuple[str, ...] = ("ledger", "intake")) -> Document:
    """:func:`load`, then :func:`require_header`: what every command but ``validate`` reads a document with."""
    return require_header(load(path), command, kinds)


def load_ledger(path: str, command: str) -> Document:
    """Load ``path`` for a command that writes ledger figures into it: an intake (or anything else) is refused."""
    doc = load(path)
    if header_problem(doc) is not None:
        require_header(doc, command)
    if doc.kind != "ledger":
        raise error_at(
            doc,
            ("ledgerspec",),
            f"{command} writes into a ledger/v1 document, got {doc.plain.get('ledgerspec')!r}",
            rule=command,
            exit_code=EXIT_USAGE,
            hint="turn an intake into a ledger first: `ledgerspec resolve INTAKE -o LEDGER`",
        )
    return doc


def _build(display: str, text: str, data: Any) -> Document:
    if data is None:
        raise LedgerspecError(
            "empty document",
            display,
            1,
            1,
            rule="load",
            hint="start with `ledgerspec: ledger/v1` (see `ledgerspec init`)",
        )
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise LedgerspecError(
            f"the document is {what}, not a mapping",
            display,
            1,
            1,
            rule="load",
            hint="a ledger is a mapping that starts with `ledgerspec: ledger/v1`",
        )
    plain = to_plain(data, display)
    doc = Document(display, text, data, plain)
    header = plain.get("ledgerspec")
    if isinstance(header, str):
        m = HEADER_RE.match(header.strip())
        if m and m.group("kind") in F.KINDS:
            doc.kind = m.group("kind")
            digits = m.group("version")
            doc.version = int(digits) if len(digits) <= MAX_VERSION_DIGITS else None
    return doc
