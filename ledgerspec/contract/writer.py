"""Write-back: render a round-trip tree with comments, order and quoting kept; replace files atomically."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

from ruamel.yaml.util import load_yaml_guess_indent

from ledgerspec.contract.loader import make_yaml
from ledgerspec.errors import LedgerspecError


def render(data: Any, original_text: str) -> str:
    """Dump ``data`` in the style of ``original_text`` (indentation, line endings, a leading BOM)."""
    yaml = make_yaml()
    try:
        _, indent, block_seq_indent = load_yaml_guess_indent(original_text)
    except Exception:
        indent, block_seq_indent = 2, 0
    indent = indent or 2
    block_seq_indent = block_seq_indent or 0
    yaml.indent(mapping=indent, sequence=indent + block_seq_indent, offset=block_seq_indent)
    buf = io.StringIO()
    yaml.dump(data, buf)
    text = buf.getvalue()
    if "\r\n" in original_text:
        text = text.replace("\r\n", "\n").replace("\n", "\r\n")
    return text


def atomic_write(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file in the same folder, fsync, rename)."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    mode = None
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        pass
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise LedgerspecError(f"cannot write: {exc.strerror}", str(path), rule="write") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
