"""Every edit of a document: figures in long form with provenance, plain values, extension blocks, the header,
the status, removals. Nothing else in ledgerspec changes a document's tree (``tests`` check it).

Each helper edits the round-trip tree (comments, order and quoting kept) and the plain copy together and records
the edit (:meth:`Document.edited`), so readings of the document stay true. A value is never replaced by a weaker
one: a MEASURED or VERIFIED figure stays unless the new one is at least as strong (MEASURED > VERIFIED >
CALCULATED > ASSUMPTION > unknown). Sections and keys are inserted in catalogue order. Writing a document to disk
is :func:`ledgerspec.contract.writer.save`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, pointer, set_path
from ledgerspec.contract.units import format_size
from ledgerspec.contract.values import SOURCE_RANK, Value


@dataclass(frozen=True)
class Change:
    pointer: str
    old: Any
    new: Any
    skipped: str | None = None  # why the change was not applied


def _order(doc: Document, parent_path: tuple[str, ...]) -> list[str]:
    kind = doc.kind or "ledger"
    fields = (
        F.top_fields(kind) if not parent_path else ((F.lookup(kind, parent_path) or F.Field("", F.OBJECT, "")).children)
    )
    names = [f.name for f in fields]
    return ["ledgerspec", *names] if not parent_path else names


def _ensure_map(doc: Document, path: tuple[str, ...]) -> CommentedMap:
    node: Any = doc.data
    for i, part in enumerate(path):
        child = node.get(part) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            child = CommentedMap()
            _insert(doc, node, path[:i], part, child)
        node = child
    return node


def _insert(doc: Document, mapping: CommentedMap, parent_path: tuple[str, ...], key: str, value: Any) -> None:
    if key in mapping:
        mapping[key] = value
        return
    order = _order(doc, parent_path)
    pos = len(mapping)
    if key in order:
        rank = order.index(key)
        for i, existing in enumerate(mapping):
            if existing in order and order.index(existing) > rank:
                pos = i
                break
    section = doc.data[parent_path[0]] if parent_path else doc.data
    at_end = pos == len(mapping) and _on_spine(section, parent_path[1:])
    before = _spine_end(section) if at_end else None
    mapping.insert(pos, key, value)
    if before is not None:  # appended at the end of its section: the lines that closed the section still close it
        tail = _take_tail(*before)
        after = _spine_end(section)
        if tail and after is not None:
            _give_tail(*after, tail)
    if not parent_path and _is_block(value) and blank_lines_between_sections(doc):
        _space_section(mapping, key)


def _on_spine(section: Any, path: tuple[str, ...]) -> bool:
    """Whether the mapping at ``path`` inside ``section`` ends it: each key on the way is the last of its mapping."""
    node = section
    for part in path:
        if not isinstance(node, dict) or not len(node) or list(node)[-1] != part:
            return False
        node = node[part]
    return True


def _spine_end(node: Any) -> tuple[Any, Any] | None:
    """The last leaf of a block ``node`` (the container and key/index that holds it): where ruamel keeps the lines
    that follow the block (blank lines, the next section's comments)."""
    container: Any = None
    last: Any = None
    while _is_block(node) and len(node):
        container = node
        last = list(node)[-1] if isinstance(node, CommentedMap) else len(node) - 1
        node = node[last]
    return (container, last) if container is not None else None


def _take_tail(container: Any, last: Any) -> str:
    """Remove and return the lines after the end-of-line comment of ``last`` (its own comment stays)."""
    slot = _eol_slot(container, last)
    if slot is None:
        return ""
    entry, index = slot
    head, sep, tail = str(entry[index].value).partition("\n")
    if not sep or not tail:
        return ""
    if head.strip():
        entry[index].value = head + "\n"
    else:
        entry[index] = None
    return tail


def _give_tail(container: Any, last: Any, tail: str) -> None:
    """Put ``tail`` (lines) after the line of ``last``, after its end-of-line comment if it has one."""
    slot = _eol_slot(container, last)
    if slot is None:
        container.yaml_add_eol_comment("#", last, column=0)
        entry, index = _eol_slot(container, last) or (None, 0)
        assert entry is not None
        entry[index].value = "\n" + tail
        return
    entry, index = slot
    value = str(entry[index].value)
    entry[index].value = (value if value.endswith("\n") else value + "\n") + tail


_TOP_KEY_RE = re.compile(r"^(?![#\s-])[^:\n]+:\s*(#.*)?$")


def blank_lines_between_sections(doc: Document) -> bool:
    """Whether the document's text separates its top-level sections (block mappings) with blank lines: most of
    them, after the first, follow a blank line."""
    lines = doc.text.splitlines()
    starts = [i for i, line in enumerate(lines) if i > 0 and _TOP_KEY_RE.match(line)]
    if len(starts) < 2:
        return False
    spaced = sum(1 for i in starts[1:] if not lines[i - 1].strip())
    return spaced * 2 >= len(starts) - 1


def _space_section(mapping: CommentedMap, key: str) -> None:
    """A blank line before the new top-level section ``key`` and before the section that follows it, as between
    the document's other sections."""
    keys = list(mapping)
    index = keys.index(key)
    if index > 0:
        previous = keys[index - 1]
        container, last = _spine_end(mapping[previous]) or (mapping, previous)
        slot = _eol_slot(container, last)
        tail = str(slot[0][slot[1]].value).partition("\n")[2] if slot is not None else ""
        if not tail.startswith("\n"):
            taken = _take_tail(container, last)
            _give_tail(container, last, "\n" + taken)
    if index + 1 < len(keys):
        following = keys[index + 1]
        before = (mapping.ca.items.get(following) or [None, None])[1]
        if not before:
            mapping.yaml_set_comment_before_after_key(following, before="\n")


def _is_block(value: Any) -> bool:
    return isinstance(value, CommentedMap | CommentedSeq) and not value.fa.flow_style()


def _eol_slot(container: Any, key: Any) -> tuple[list[Any], int] | None:
    """Where ruamel keeps the end-of-line comment of ``key``: (the ca.items entry, its index)."""
    entry = container.ca.items.get(key)
    if entry is None:
        return None
    index = 2 if isinstance(container, CommentedMap) else 0
    return (entry, index) if len(entry) > index and entry[index] is not None else None


def long_form(
    value: Any, source: str, method: str | None = None, note: str | None = None, extra: dict[str, Any] | None = None
) -> CommentedMap:
    m = CommentedMap()
    m["value"] = value
    m["source"] = source
    if method:
        m["method"] = method
    if note:
        m["note"] = note
    for k, v in (extra or {}).items():
        m[k] = v
    m.fa.set_flow_style()
    return m


def set_figure(
    doc: Document,
    path: tuple[str, ...],
    value: Any,
    source: str,
    method: str | None = None,
    note: str | None = None,
    size_comment: bool | None = None,
    force: bool = False,
) -> Change | None:
    """Write ``value`` at ``path`` in long form. Returns the change, or None when nothing changed."""
    where = pointer(*path)
    current = doc.get(*path)
    if current.present and not force:
        old_rank = SOURCE_RANK.get(current.effective_source(True), 0)
        new_rank = SOURCE_RANK.get(source, 0)
        if current.known and old_rank > new_rank:
            return Change(where, current.raw, value, skipped=f"kept {current.effective_source(True)} value")
        if (
            current.form == "long"
            and current.value == value
            and current.source == source
            and (method is None or current.method == method)
        ):
            return None
    parent = _ensure_map(doc, path[:-1])
    key = path[-1]
    old = parent.get(key)
    if isinstance(old, CommentedMap) and current.form == "long":
        old_copy = dict(old)
        old["value"] = value
        old["source"] = source
        if method:
            old["method"] = method
        elif "method" in old and source != current.source:
            del old["method"]
        if note:
            old["note"] = note
        elif "note" in old and source != current.source:
            del old["note"]
        node = old
        old_raw: Any = old_copy
    else:
        node = long_form(value, source, method, note)
        old_raw = old
        _insert(doc, parent, path[:-1], key, node)
    field = F.lookup(doc.kind or "ledger", path)
    want_comment = (
        size_comment
        if size_comment is not None
        else bool(field and field.kind in (F.MEMORY, F.SIZE) and isinstance(value, int))
    )
    if want_comment and isinstance(value, int):
        _set_eol_comment(parent, key, format_size(value))
    _sync_plain(doc, path, _plain(node))
    return Change(where, old_raw, value)


def set_plain(doc: Document, path: tuple[str, ...], value: Any, force: bool = False) -> Change | None:
    """Write a plain (declared) value, e.g. ``identity.architecture``; never replaces a known value unless forced."""
    current = doc.get(*path)
    if current.present and current.known and not force:
        if current.value == value:
            return None
        return Change(pointer(*path), current.raw, value, skipped="kept the declared value")
    parent = _ensure_map(doc, path[:-1])
    old = parent.get(path[-1])
    if isinstance(value, list):
        seq = CommentedSeq(value)
        seq.fa.set_flow_style()
        value_node: Any = seq
    elif isinstance(value, dict):
        value_node = CommentedMap(value)
        value_node.fa.set_flow_style()
    else:
        value_node = value
    _insert(doc, parent, path[:-1], path[-1], value_node)
    _sync_plain(doc, path, value)
    return Change(pointer(*path), old, value)


def set_extension(doc: Document, path: tuple[str, ...], value: Any) -> Change | None:
    """Replace an ``x-`` extension block wholesale (tool-owned data such as ``x-breakdown``)."""
    parent = _ensure_map(doc, path[:-1])
    old = parent.get(path[-1])
    if _plain(old) == value:
        return None
    node = _to_node(value)
    _insert(doc, parent, path[:-1], path[-1], node)
    _sync_plain(doc, path, value)
    return Change(pointer(*path), old, value)


def _to_node(value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict):
        m = CommentedMap()
        for k, v in value.items():
            m[k] = _to_node(v, depth + 1)
        if depth >= 2 or (depth >= 1 and all(not isinstance(v, dict | list) for v in value.values())):
            m.fa.set_flow_style()
        return m
    if isinstance(value, list):
        s = CommentedSeq([_to_node(v, depth + 1) for v in value])
        if all(not isinstance(v, dict | list) for v in value):
            s.fa.set_flow_style()
        return s
    return value


def _set_eol_comment(parent: CommentedMap, key: str, text: str) -> None:
    existing = parent.ca.items.get(key)
    tail = ""
    if existing and existing[2] is not None:
        head, _, tail = existing[2].value.partition("\n")
        old = head.strip()
        if old.startswith("#") and not _is_size_comment(old[1:].strip()):
            text = old  # a user's comment: keep it (re-placed two spaces after the new value)
        existing[2] = None
    # column 0 + a leading space: two spaces after the value, never aligned to a neighbour's (often far) comment;
    # the lines that followed the old comment (blank lines, the next section's comments) stay
    parent.yaml_add_eol_comment(text, key, column=0)
    token = parent.ca.items[key][2]
    token.value = " " + token.value.rstrip("\n") + "\n" + tail


def _is_size_comment(text: str) -> bool:
    parts = text.split()
    return len(parts) == 2 and parts[1] in ("B", "KiB", "MiB", "GiB", "TiB")


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _sync_plain(doc: Document, path: tuple[str, ...], value: Any) -> None:
    set_path(doc.plain, path, value)
    doc.edited(path)


# -- the header, the status, removals ----------------------------------------------------------------------------


def to_ledger(doc: Document) -> Change | None:
    """An intake becomes a ``ledger/v1`` document: the header switched, ``pilot`` kept as ``x-pilot`` in place
    (a ledger has no pilot section; the ladder reads a pilot run there)."""
    if doc.kind == "ledger":
        return None
    data: CommentedMap = doc.data
    old = data.get("ledgerspec")
    data["ledgerspec"] = "ledger/v1"
    doc.kind = "ledger"
    if "pilot" in data:
        pos = list(data.keys()).index("pilot")
        value = data.pop("pilot")
        data.insert(pos, "x-pilot", value)
        doc.plain["x-pilot"] = doc.plain.pop("pilot")
        doc.edited(("x-pilot",))
    doc.plain["ledgerspec"] = "ledger/v1"
    doc.edited(("ledgerspec",))
    return Change("/ledgerspec", old, "ledger/v1")


def set_status(doc: Document, status: str, comment: str) -> Change | None:
    """Set the declared ``status`` with ``comment`` (why) beside it. Written back as a one-line edit of the
    ``status:`` line when nothing else changed (every other byte of the file kept), else with the whole tree."""
    old = doc.plain.get("status")
    if old == status:
        return None
    data: CommentedMap = doc.data
    if "status" in data:
        data["status"] = status
    else:
        _insert(doc, data, (), "status", status)
    data.yaml_add_eol_comment(comment, "status", column=len(f"status: {status}") + 2)  # two spaces, as the line edit
    doc.plain["status"] = status
    first = doc.status_edit[0] if doc.status_edit is not None else old
    doc.status_edit = (first, status, comment)
    doc.edited(("status",))
    return Change("/status", old, status)


def remove(doc: Document, path: tuple[str, ...], prune: bool = True, _carry: str = "") -> Change | None:
    """Delete the key at ``path`` (nothing when absent); the blank lines and comments that followed it stay where
    they were. ``prune``: a section left empty by the removal goes too (else it stays, to be refilled)."""
    parent: Any = doc.data
    for part in path[:-1]:
        parent = parent.get(part) if isinstance(parent, dict) else None
    key = path[-1]
    if not isinstance(parent, CommentedMap) or key not in parent:
        return None
    keys = list(parent)
    old = _plain(parent[key])
    entry = parent.ca.items.get(key)
    token = entry[2] if entry and len(entry) > 2 else None
    tail = (token.value.partition("\n")[2] if token is not None else "") + _carry
    del parent[key]
    parent.ca.items.pop(key, None)
    index = keys.index(key)
    plain: Any = doc.plain
    for part in path[:-1]:
        plain = plain.get(part, {}) if isinstance(plain, dict) else {}
    if isinstance(plain, dict):
        plain.pop(key, None)
    doc.edited(path)
    if prune and len(path) > 1 and not parent:  # the section goes, and the lines that followed move up with it
        remove(doc, path[:-1], prune, tail)
    elif tail.strip() and index > 0:
        _append_lines(parent, keys[index - 1], tail)
    return Change(pointer(*path), old, None)


def remove_keys(doc: Document, section: str, keys: tuple[str, ...] | None = None, prune: bool = True) -> list[Change]:
    """Remove ``keys`` of ``section`` (every key when None); ``prune``: the section goes when nothing is left."""
    node = doc.data.get(section) if isinstance(doc.data, dict) else None
    if not isinstance(node, dict):
        return []
    names = [k for k in list(node) if keys is None or k in keys]
    return [c for c in (remove(doc, (section, k), prune) for k in names) if c is not None]


def _append_lines(mapping: Any, key: Any, tail: str) -> None:
    while (
        isinstance(mapping[key], CommentedMap | CommentedSeq) and not mapping[key].fa.flow_style() and len(mapping[key])
    ):  # the lines after a block sit on its deepest last node
        mapping = mapping[key]
        key = list(mapping)[-1] if isinstance(mapping, CommentedMap) else len(mapping) - 1
    index = 2 if isinstance(mapping, CommentedMap) else 0
    entry = mapping.ca.items.get(key)
    if entry and len(entry) > index and entry[index] is not None:
        head = entry[index].value.partition("\n")[0]
        entry[index].value = head + "\n" + tail
        return
    mapping.yaml_add_eol_comment("#", key, column=0)
    mapping.ca.items[key][index].value = "\n" + tail


def variant(doc: Document, values: dict[tuple[str, ...], Any]) -> Document:
    """A detached copy of ``doc`` with plain values set at some paths (a what-if for ``--sweep``); ``doc`` itself
    is not changed. The copy has no comments to keep: it is for reading, never for writing back."""
    import copy

    plain = copy.deepcopy(doc.plain)
    for path, value in values.items():
        if value is _REMOVE:
            parent: Any = plain
            for part in path[:-1]:
                parent = parent.get(part, {}) if isinstance(parent, dict) else {}
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
        else:
            set_path(plain, path, value)
    return Document(doc.path, doc.text, plain, plain, doc.kind, doc.version, facts=dict(doc.facts))


#: a value for :func:`variant` that removes the key
_REMOVE: Any = object()
REMOVE = _REMOVE


__all__ = [
    "REMOVE",
    "Change",
    "Value",
    "long_form",
    "remove",
    "remove_keys",
    "set_extension",
    "set_figure",
    "set_plain",
    "set_status",
    "to_ledger",
    "variant",
]
