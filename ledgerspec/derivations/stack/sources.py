"""Which installed library code a replacement was written against: the SHA-256 of a function's source.

Private functions of torch change between releases without notice. Code of ours that replaces one (FSDP1's storage
checks, :mod:`ledgerspec.derivations.shard.fsdp.storage_checks`) or writes out what one does
(:mod:`ledgerspec.derivations.engine.fakemode`) records the digest of each such function per release it was read
in, and compares it with the installed function's before relying on it. No torch.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any


def source_digest(function: Any) -> str | None:
    """SHA-256 of ``function``'s source as :func:`inspect.getsource` reads it; None when it cannot be read."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode("utf-8")).hexdigest()
    except (OSError, TypeError):
        return None


__all__ = ["source_digest"]
