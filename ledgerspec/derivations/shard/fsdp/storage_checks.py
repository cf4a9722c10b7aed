"""FSDP1's storage checks asked of the storages for fake tensors, guarded against a torch they were not written for.

torch's FSDP1 tells storages apart by their data pointers, which fake tensors do not have (all 0):
:func:`fake_storage_checks` replaces the three private functions that ask (:data:`REPLACED`) with versions that ask
the storage objects. Private functions change between torch releases without notice, so the replacements are only
as good as the match between the installed functions and the ones they were written against: each replaced
function's source has a SHA-256 recorded per torch release it was read in (:data:`CHECKED`), and a torch whose
functions differ is refused with one line (:func:`refuse_unchecked_torch`) before anything is simulated. After a torch
upgrade: read the three functions again, adapt the replacements if needed, and record the new release's digests
(``tests/derivations/shard/test_fsdp1.py`` fails until then).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.shard.patching import patched
from ledgerspec.derivations.stack.sources import source_digest
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

#: the private torch FSDP1 functions :func:`fake_storage_checks` replaces, ``(module, name)``
REPLACED = (
    ("torch.distributed.fsdp._runtime_utils", "_catch_all_reshard"),
    ("torch.distributed.fsdp._flat_param", "_same_storage"),
    ("torch.distributed.fsdp._flat_param", "_data_ptr_allocated"),
)
#: ``{torch release: {function: SHA-256 of inspect.getsource(function)}}`` for every release whose functions were
#: read against the replacements (add one only after reading them again)
CHECKED = {
    "2.13.0": {
        "torch.distributed.fsdp._runtime_utils._catch_all_reshard": (
            "87545bc23b4ab23f932da6e0494dc8d6fcbc1e03df8b040dc835f9e1426bb297"
        ),
        "torch.distributed.fsdp._flat_param._same_storage": (
            "9af4ac1bb82a6016d89ce6f6dd23cc9cd4a442923681baa8d4ff8301a73355de"
        ),
        "torch.distributed.fsdp._flat_param._data_ptr_allocated": (
            "b7d501eb648cd95d3bf99aa531687e330c81021ff6218086536571b6012c0e2c"
        ),
    },
}
_RELEASES = ", ".join(CHECKED)
HINT = (
    f"ledgerspec's FSDP1 simulation was checked against torch {_RELEASES}; run `ledgerspec measure --nproc` instead, "
    f"or install torch {list(CHECKED)[-1]}"
)

_err = ErrorAt("shard", EXIT_USAGE)


def unchecked_function() -> str | None:
    """Why the installed torch cannot be simulated with :func:`fake_storage_checks` (one line: the installed torch
    and the first replaced function whose source is not one recorded in :data:`CHECKED`), or None."""
    import torch

    for module, name in REPLACED:
        qualname = f"{module}.{name}"
        function = getattr(importlib.import_module(module), name, None)
        if source_digest(function) not in {known[qualname] for known in CHECKED.values()}:
            return (
                f"torch {torch.__version__}'s {qualname} is not the function the FSDP1 simulation replaces for fake "
                f"tensors (it was read in torch {_RELEASES})"
            )
    return None


def refuse_unchecked_torch(doc: Document | None = None) -> None:
    """Raise the one-line refusal of :func:`unchecked_function` (at ``doc``'s strategy when given), if any."""
    why = unchecked_function()
    if why is None:
        return
    if doc is None:
        raise LedgerspecError(why, rule="shard", hint=HINT, exit_code=EXIT_USAGE)
    raise _err(doc, ("parallelism", "strategy"), why, HINT)


@contextlib.contextmanager
def fake_storage_checks() -> Iterator[None]:
    """FSDP1's storage checks asked of the storages, not of ``data_ptr()`` (used with fake tensors only).

    torch 2.13 FSDP1 tells storages apart by their data pointers: ``_runtime_utils._catch_all_reshard`` decides a
    handle is "already resharded" when ``flat_param.data_ptr() == flat_param._local_shard.data_ptr()`` ("This
    already-resharded check is brittle", pytorch#83956), ``_flat_param._same_storage`` compares
    ``untyped_storage().data_ptr()`` and ``_data_ptr_allocated`` tests ``data_ptr() > 0``. Fake tensors all have
    data pointer 0: under ``FakeTensorMode`` every frozen unit gathered in backward (the root, the last layer: no
    gradient hook reshards them) looked resharded and stayed gathered through the optimizer step (812,448 B above
    the real run on the tiny test model), and ``SHARD_GRAD_OP`` failed ("the unsharded flat parameter should be
    allocated"). Here the same questions are asked of the storage objects and their sizes, which is what the
    pointers mean on real tensors.

    The replaced functions are checked first (:func:`refuse_unchecked_torch`): a torch whose functions are not the
    ones read here is refused, never simulated with replacements written for other code.
    """
    refuse_unchecked_torch()
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.distributed.fsdp._runtime_utils as runtime

    def same(a: Any, b: Any) -> bool:
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
        return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)

    def allocated(t: Any) -> bool:
        return bool(t.untyped_storage().nbytes() > 0)

    def catch_all_reshard(state: Any) -> None:
        handle = state._handle
        if handle:
            flat = handle.flat_param
            if same(flat, flat._local_shard) and not handle._skipped_use_sharded_views:
                return
            runtime._reshard(state, handle, runtime._should_free_in_backward(state, handle))

    with patched(
        (runtime, "_catch_all_reshard", catch_all_reshard),
        (flat_param, "_same_storage", same),
        (flat_param, "_data_ptr_allocated", allocated),
    ):
        yield


__all__ = ["CHECKED", "HINT", "REPLACED", "fake_storage_checks", "refuse_unchecked_torch", "unchecked_function"]
