"""What the files a document names look like on disk, observed once when the document is loaded.

The checks are pure functions of a document (no I/O), yet ``validate`` must say when ``identity.config_path``
names no file, as ``resolve`` would, without importing torch. So :func:`ledgerspec.contract.document.load`
records the facts here (:attr:`Document.facts`), and a rule reads them. A document read from a stream, or built in
memory, has no facts: nothing is claimed about files it was not loaded beside.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ledgerspec.contract.document import Document

CONFIG_PATH = "config_path"


@dataclass(frozen=True)
class ConfigFile:
    """``identity.config_path`` as written (``text``), where it leads, and whether a config.json is there."""

    text: str
    file: str  # the config.json it names (a folder's config.json), absolute
    exists: bool
    folder_without_config: bool = False  # it names a folder that holds no config.json


def config_file_of(text: str, document_path: str) -> ConfigFile:
    """Where ``config_path`` ``text`` leads from the document at ``document_path`` (a file, or a folder's
    config.json; from the current folder for ``<stdin>``), as :func:`ledgerspec.derivations.stack.build.config_file`
    reads it."""
    base = Path.cwd() if document_path.startswith("<") else Path(document_path).parent
    p = (base / text).resolve()
    is_dir = p.is_dir()
    file = p / "config.json" if is_dir else p
    exists = file.is_file()
    return ConfigFile(text, str(file), exists, is_dir and not exists)


def observe(doc: Document) -> dict[str, ConfigFile]:
    """The facts about files ``doc`` names (its ``identity.config_path``), seen from where it was loaded."""
    value = doc.get("identity", "config_path")
    text = value.text() if value.form in ("plain", "long") else None
    if not text or not isinstance(value.value, str):
        return {}
    try:
        return {CONFIG_PATH: config_file_of(text, doc.path)}
    except (OSError, ValueError):  # an unreadable path (a NUL byte, a loop): say nothing rather than guess
        return {}


__all__ = ["CONFIG_PATH", "ConfigFile", "config_file_of", "observe"]
