"""The estimate cache: a traced estimate kept on disk, keyed by every input that changes it.

A repeated or swept question costs the delta: the same configuration asked again is answered from here without
importing torch, and a sweep re-run with one more value traces only the new points. What makes the key
(:func:`key`), read before anything heavy is imported:

- every input section of the document as written (:func:`ledgerspec.contract.fingerprint.input_digest`; a figure
  ``estimate`` writes back lives outside them, so writing the answer keeps the key);
- the model's ``config.json`` bytes (``identity.config_path``, or the file in the local Hugging Face cache for a
  ``model_id``: the estimate is offline, so that file is the one it reads). No file found: no key, no cache;
- the question: the target (cuda/cpu kernels) and the depth plan (``auto``/``full``);
- the stack: the names of every installed distribution (``*.dist-info``: their versions), the Python version, and
  a digest of ledgerspec's own source files (a changed modelling rule is a new key).

Location: ``$LEDGERSPEC_CACHE_DIR`` if set (``off`` turns the cache off), else ``$XDG_CACHE_HOME/ledgerspec`` or
``~/.cache/ledgerspec``; entries under ``estimates/``, one JSON file each (a few KiB). Bounded: after a write the
oldest entries (by last use) go until the folder is under ``$LEDGERSPEC_CACHE_MAX_MB`` (default 64 MiB). Safe to
delete at any time; an unreadable, corrupt or foreign entry is a miss, and a cache that cannot be written is no
cache (never an error). Only complete, successful estimates are stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.fingerprint import input_digest

#: bump when the stored form changes (entries of another format are misses)
FORMAT = 1
DIR_ENV = "LEDGERSPEC_CACHE_DIR"
MAX_ENV = "LEDGERSPEC_CACHE_MAX_MB"
DEFAULT_MAX_BYTES = 64 * 2**20
#: environment variables a trace reads (none today besides the ones torch reads at import, which the stack covers)
TRACE_ENVIRONMENT: tuple[str, ...] = ()
_PACKAGE = Path(__file__).resolve().parents[2]  # ledgerspec/


def default_dir() -> Path | None:
    """Where the cache lives (None: turned off with ``LEDGERSPEC_CACHE_DIR=off``)."""
    chosen = os.environ.get(DIR_ENV, "").strip()
    if chosen.lower() in ("off", "0", "none", "false", "no"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "ledgerspec"


def max_bytes() -> int:
    raw = os.environ.get(MAX_ENV, "").strip()
    try:
        return max(0, int(float(raw) * 2**20)) if raw else DEFAULT_MAX_BYTES
    except ValueError:
        return DEFAULT_MAX_BYTES


@cache
def code_digest() -> str:
    """SHA-256 of ledgerspec's own source files (path and bytes), in a fixed order."""
    h = hashlib.sha256()
    for file in sorted(_PACKAGE.rglob("*.py")):
        h.update(file.relative_to(_PACKAGE).as_posix().encode())
        h.update(b"\0")
        h.update(file.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@cache
def installed_distributions() -> tuple[str, ...]:
    """The names of every installed distribution's metadata folder (``torch-2.13.0+cpu.dist-info``...): a listing
    of the import path, no import and no metadata parsing (``importlib.metadata`` costs a fifth of a second)."""
    names: set[str] = set()
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        names.update(n for n in listing if n.endswith((".dist-info", ".egg-info")))
    return tuple(sorted(names))


def config_bytes(doc: Document) -> bytes | None:
    """The ``config.json`` the estimate will read, without transformers: the local file, or the Hugging Face cache's
    copy for ``identity.model_id`` (and ``revision``). None when there is none to read (no cache then)."""
    from ledgerspec.derivations.stack.build import config_file

    local = config_file(doc)  # raises the same one-line error the estimate would for a missing file
    if local is not None:
        return local[1]
    model_id = doc.get("identity", "model_id").text()
    if not model_id:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json", revision=doc.get("identity", "revision").text())
    except Exception:  # an id huggingface_hub refuses, or no huggingface_hub: no key, the estimate says the rest
        return None
    if not isinstance(found, str):
        return None
    try:
        return Path(found).read_bytes()
    except OSError:
        return None


def key(doc: Document, question: dict[str, Any]) -> str | None:
    """The cache key of ``doc`` asked ``question`` (target, depth plan...), or None when it cannot be known."""
    config = config_bytes(doc)
    if config is None:
        return None
    parts = {
        "format": FORMAT,
        "inputs": input_digest(doc),
        "config": hashlib.sha256(config).hexdigest(),
        "question": question,
        "python": sys.version,
        "distributions": installed_distributions(),
        "code": code_digest(),
        "environment": {name: os.environ.get(name) for name in TRACE_ENVIRONMENT},
    }
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class EstimateCache:
    """The folder of cached estimates (see the module docstring)."""

    folder: Path
    limit: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_environment(cls) -> EstimateCache | None:
        folder = default_dir()
        return None if folder is None else cls(folder, max_bytes())

    @property
    def entries(self) -> Path:
        return self.folder / "estimates"

    def get(self, name: str) -> dict[str, Any] | None:
        path = self.entries / f"{name}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != name:
            return None
        try:
            os.utime(path)  # last use: what the size bound keeps
        except OSError:
            pass
        value = data.get("value")
        return value if isinstance(value, dict) else None

    def put(self, name: str, value: dict[str, Any]) -> None:
        """Store atomically (a reader sees the old entry or the new one); any failure leaves no cache, no error."""
        text = json.dumps({"format": FORMAT, "key": name, "value": value})  # in order: phases keep theirs
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.entries)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.entries / f"{name}.json")
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            return
        self.prune()

    def prune(self) -> None:
        """Remove the least recently used entries until the folder holds at most :attr:`limit` bytes."""
        try:
            files = [(p.stat(), p) for p in self.entries.glob("*.json")]
        except OSError:
            return
        total = sum(s.st_size for s, _ in files)
        for st, path in sorted(files, key=lambda f: f[0].st_mtime):
            if total <= self.limit:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= st.st_size


def cached(
    store: EstimateCache | None,
    doc: Document,
    question: dict[str, Any],
    compute: Callable[[], Any],
    encode: Callable[[Any], dict[str, Any]],
    decode: Callable[[dict[str, Any], float], Any],
) -> Any:
    """``compute()``, or its stored answer for the same key: ``decode(value, seconds_spent)`` on a hit."""
    started = time.perf_counter()
    name = key(doc, question) if store is not None else None
    if store is not None and name is not None:
        value = store.get(name)
        if value is not None:
            try:
                return decode(value, time.perf_counter() - started)
            except (KeyError, TypeError, ValueError):
                pass  # an entry this version cannot read: traced again and overwritten
    result = compute()
    if store is not None and name is not None:
        store.put(name, encode(result))
    return result


def plain(obj: Any) -> dict[str, Any]:
    """A dataclass as JSON-ready data."""
    return asdict(obj)
