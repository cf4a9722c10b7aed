"""Library attributes replaced for the duration of a block, and put back whatever happens.

The simulations ask torch and DeepSpeed questions their code answers with data pointers or values that fake
tensors do not have (FSDP1's storage checks in :mod:`.fsdp.storage_checks`, the host reads of gradient values in
:mod:`.zero.engine`); each such replacement goes through :func:`patched`. No torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def patched(*replacements: tuple[Any, str, Any]) -> Iterator[None]:
    """Each ``(owner, name, value)``: ``owner.name`` is ``value`` inside the block and what it was after it, whatever
    happens (``unittest.mock.patch.object``, one per replacement)."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for owner, name, value in replacements:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


__all__ = ["patched"]
