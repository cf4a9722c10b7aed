"""Write-back: a document as text (comments, order, quoting, blank lines, line endings and a BOM kept) and the one
save path (:func:`save`): relocation, rendering, an atomic replace."""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document, relocate
from ledgerspec.contract.loader import make_yaml
from ledgerspec.errors import LedgerspecError


def render(data: Any, original_text: str) -> str:
    """Dump ``data`` in the style of ``original_text`` (indentation, line endings); see :func:`document_text`
    for a whole document (its byte order mark, a status-only edit)."""
    yaml = make_yaml()
    mapping, sequence, offset = guess_indent(original_text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    buf = io.StringIO()
    yaml.dump(data, buf)
    text = buf.getvalue()
    if "\r\n" in original_text:
        text = text.replace("\r\n", "\n").replace("\n", "\r\n")
    return text


_KEY_ONLY = re.compile(r"""^[^#'"\s][^#'"]*:\s*(#.*)?$""")


def guess_indent(text: str) -> tuple[int, int, int]:
    """``(mapping, sequence, offset)`` as ``YAML.indent()`` takes them, read off ``text`` (default 2, 2, 0).

    ``mapping``: a nested key's indent relative to its parent key; ``sequence``: a block-sequence item's
    content relative to its parent key; ``offset``: the dash relative to the parent key.
    """
    mapping: int | None = None
    sequence: int | None = None
    offset = 0
    parent: int | None = None  # indent of the last `key:` line with its value on the next lines
    for line in text.splitlines():
        body = line.lstrip(" ")
        if not body.strip() or body.startswith("#"):
            continue
        lead = len(line) - len(body)
        dash = body.startswith("- ")
        if parent is not None and (lead > parent or (dash and lead == parent)):
            if dash and sequence is None:
                after = body[1:]
                offset = lead - parent
                sequence = offset + 1 + len(after) - len(after.lstrip(" "))
            elif not dash and mapping is None:
                mapping = lead - parent
        if mapping is not None and sequence is not None:
            break
        while body.startswith("- "):  # `- key:` opens a mapping at the key's column
            rest = body[1:].lstrip(" ")
            lead, body = lead + len(body) - len(rest), rest
        parent = lead if _KEY_ONLY.match(body) else None
    mapping = mapping or 2
    return mapping, max(sequence or mapping, offset + 2), offset


def atomic_write(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file in the same folder, fsync, rename)."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    try:
        mode = target.stat().st_mode & 0o7777
    except (FileNotFoundError, NotADirectoryError):  # a new file gets the usual 0666 & ~umask, not mkstemp's 0600
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    if target.is_dir():
        raise LedgerspecError("is a folder", str(path), rule="write", hint="give a file name")
    try:
        folder.mkdir(parents=True, exist_ok=True)  # `-o out/new.ledger.yaml` creates out/
    except OSError as exc:
        raise LedgerspecError(f"cannot create the folder {folder}: {exc.strerror}", str(path), rule="write") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise LedgerspecError(f"cannot write: {exc.strerror}", str(path), rule="write") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):  # a full disk, a quota, a target replaced by a folder meanwhile
            raise LedgerspecError(f"cannot write: {exc.strerror or exc}", str(path), rule="write") from None
        raise


def check_writable(path: str | os.PathLike[str]) -> None:
    """Fail early (before minutes of work) when :func:`atomic_write` could not write ``path``; changes nothing."""
    target = Path(path)
    if target.is_dir():
        raise LedgerspecError("is a folder", str(path), rule="write", hint="give a file name")
    folder = target.parent.absolute()
    while not folder.exists() and folder != folder.parent:  # atomic_write creates missing folders
        folder = folder.parent
    if not folder.is_dir():
        raise LedgerspecError(
            f"cannot create the folder {target.parent}: {folder} is a file",
            str(path),
            rule="write",
            hint="choose another output path",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LedgerspecError(f"cannot write: no write permission in {folder}", str(path), rule="write")


def document_text(doc: Document) -> str:
    """The text of ``doc`` as it is now: the original text with the status line edited when the status is all that
    changed (every other byte kept), else the round-trip tree rendered in the file's style; a BOM kept."""
    text = None
    if doc.edits == {("status",)} and doc.status_edit is not None:
        text = _status_line_edit(doc, *doc.status_edit)
    if text is None:
        text = render(doc.data, doc.text)
    return ("\ufeff" + text) if doc.bom else text


def render_to(doc: Document, target: str) -> str:
    """:func:`document_text` for ``doc`` written at ``target``: a relative ``identity.config_path`` is rebased so it
    still names the same config (``-o OUT`` in another folder)."""
    relocate(doc, target)
    return document_text(doc)


def save(doc: Document, target: str) -> None:
    """The one save path: write ``doc`` to ``target`` (its own file or ``-o OUT``) with :func:`render_to`, replacing
    the file atomically."""
    atomic_write(target, render_to(doc, target))


# the scalar after `status:` and what follows it on the line: a quoted or plain token, then an optional comment
_STATUS_VALUE_RE = re.compile(r"""(?P<token>"[^"\n]*"|'[^'\n]*'|[^#\n]*?)(?P<gap>[ \t]*)(?P<comment>\#.*)?$""")
#: how a comment ledgerspec wrote beside the status begins (a user's comment is kept after ``| was:``)
STATUS_COMMENT_PREFIXES = ("ledgerspec: ",)


def _status_line_edit(doc: Document, old: Any, status: str, comment: str) -> str | None:
    """The original text with the one line that holds ``status:`` rewritten; None when the status is not a one-line
    scalar of a block mapping (flow style, multi-line: the tree is rendered instead)."""
    try:
        line, col = doc.data.lc.value("status")
    except (AttributeError, KeyError, TypeError):
        return None
    lines = doc.text.splitlines(keepends=True)
    if line >= len(lines):
        return None
    raw = lines[line]
    body = raw.rstrip("\r\n")
    ending = raw[len(body) :]
    m = _STATUS_VALUE_RE.match(body, col)
    if m is None:
        return None
    token = m.group("token")
    if token.strip("\"' ") != str(old):
        return None  # not a one-line scalar we understand (multi-line, flow style, ...)
    quote = token[0] if token[:1] in ("'", '"') else ""
    previous = (m.group("comment") or "")[1:].strip()
    if previous and not previous.startswith(STATUS_COMMENT_PREFIXES):
        comment += f" | was: {previous}"
    lines[line] = f"{body[:col]}{quote}{status}{quote}  # {comment}{ending}"
    return "".join(lines)
