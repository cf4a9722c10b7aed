"""``from ledgerspec.integrations.transformers import LedgerCallback``: a ``transformers.TrainerCallback`` that
records a real run into a ledger (docs "From your setup").

A thin face over :mod:`ledgerspec.derivations.integrations.transformers` (where the work is, with torch imported
lazily): the callback made here also sets the ledger's declared status to what the evidence supports before each
save, as ``ledgerspec measure`` does (``keep_status=True`` keeps it). Importing this module imports neither torch
nor transformers; the class is made on first access.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.integrations.trainer_intake import intake_from_trainer


def _settle(doc: Any, keep: bool) -> None:
    from ledgerspec.faces.status import settle

    settle(doc, keep=keep)


def __getattr__(name: str) -> Any:
    if name == "LedgerCallback":
        from ledgerspec.derivations.integrations.transformers import callback_class

        return callback_class(_settle)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["intake_from_trainer"]  # and LedgerCallback, made on first access
