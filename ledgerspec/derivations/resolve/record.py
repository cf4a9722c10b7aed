"""What ``resolve`` records about its own output in ``x-resolve``: the plain values it wrote, and its inputs.

``resolve`` writes a few plain (declared-looking) values besides its long-form figures:
``identity.architecture``, ``gradients.dtype``, ``optimizer.state_format``, ``bits`` and ``paged``. A plain
value is also how a user declares one, so on its own the file cannot say who wrote it. ``x-resolve.written``
says: each plain value resolve wrote, as it wrote it. On the next run a value equal to its record is
resolve's own and is refreshed (or removed, when the new configuration no longer has it: ``bits`` and
``paged`` after switching away from a bitsandbytes optimizer); any other value is the user's and is kept,
with a message saying so. A value the user declared, even one equal to the derived value, is never taken
over: only what resolve wrote itself is resolve's (a user who wants resolve to manage it deletes it).

One exception, for ledgers resolved by a ledgerspec that wrote no ``x-resolve``: when ``x-resolve`` is absent
but ``method.x-breakdown`` (written only by resolve, in the same run) is there, a value equal to the derived
one is taken as resolve's own and recorded.

``x-resolve.inputs`` is the fingerprint of the fields resolve read (:mod:`ledgerspec.contract.fingerprint`):
``validate`` recomputes it (rule LS006) to notice an input edited after resolve ran.
``identity.config_sha256`` is not managed here: it is a pin that resolve checks, never refreshes.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.document import Document, pointer
from ledgerspec.contract.edit import Change, remove, set_extension, set_plain
from ledgerspec.contract.fingerprint import RESOLVE_INPUTS, digests

EXTENSION = "x-resolve"
KEPT = "kept the declared value (not written by resolve; delete it to let resolve fill it)"


class Record:
    """The plain values of one resolve run: written where resolve owns them, kept where the user declared them."""

    def __init__(self, doc: Document) -> None:
        self.doc = doc
        block = doc.get(EXTENSION)
        written = doc.get(EXTENSION, "written").raw if block.present else None
        self.before: dict[str, Any] = dict(written) if isinstance(written, dict) else {}
        self.legacy = not block.present and doc.get("method", "x-breakdown").present
        self.written: dict[str, Any] = {}

    def owned(self, path: tuple[str, ...], value: Any) -> bool:
        """Whether resolve may (re)write ``path``: absent or unknown, or holding what resolve wrote last time."""
        current = self.doc.get(*path)
        if current.unknown:
            return True
        if current.form != "plain":
            return False
        key = ".".join(path)
        if key in self.before:
            return bool(current.value == self.before[key])
        return self.legacy and current.value == value

    def set(self, path: tuple[str, ...], value: Any) -> Change | None:
        """Write the derived plain ``value`` at ``path`` unless the user declared another value there."""
        if not self.owned(path, value):
            current = self.doc.get(*path)
            if current.value == value:
                return None
            return Change(pointer(*path), current.raw, value, skipped=KEPT)
        self.written[".".join(path)] = value
        return set_plain(self.doc, path, value, force=True)

    def drop_stale(self) -> list[Change]:
        """Remove the values resolve wrote last time and no longer derives (still as it wrote them)."""
        changes = []
        for key, old in self.before.items():
            path = tuple(key.split("."))
            if key in self.written or not self.owned(path, None) or self.doc.get(*path).unknown:
                continue
            remove(self.doc, path)
            changes.append(Change(pointer(*path), old, None))
        return changes

    def finish(
        self, stack: dict[str, str] | None = None, differences: dict[str, dict[str, Any]] | None = None
    ) -> list[Change]:
        """Drop stale values, then store ``x-resolve``: what was written, the input fingerprint, the installed
        ``stack`` the figures were computed with and the known ``differences`` that apply
        (:mod:`ledgerspec.contract.differences`)."""
        changes = self.drop_stale()
        block: dict[str, Any] = {"inputs": digests(self.doc, RESOLVE_INPUTS)}
        if self.written:
            block["written"] = dict(self.written)
        if stack:
            block["stack"] = dict(stack)
        if differences:
            block["differences"] = {k: dict(v) for k, v in differences.items()}
        change = set_extension(self.doc, (EXTENSION,), block)
        return changes + ([change] if change is not None else [])


__all__ = ["EXTENSION", "KEPT", "Record"]
