"""ledgerspec: the Training Memory Ledger for LoRA/QLoRA fine-tuning.

The light core (``load``, ``validate``, the schema) imports only the standard library,
jsonschema and ruamel.yaml. ``resolve``, ``estimate`` and ``measure`` import torch & co. lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ledgerspec.version import __version__

if TYPE_CHECKING:
    from ledgerspec.checks.validate import Report
    from ledgerspec.contract.document import Document


def load(path: str) -> Document:
    """Load a ledger or intake YAML file (comments kept for write-back)."""
    from ledgerspec.contract.document import load as _load

    return _load(path)


def validate(doc: Document) -> Report:
    """Validate a loaded document: schema, rules LS001-LS090, and the supported status."""
    from ledgerspec.checks.validate import validate as _validate

    return _validate(doc)


def resolve(doc: Document, **options: Any) -> Any:
    """Fill every derivable figure by instantiating the model on the meta device (needs ``[resolve]``)."""
    from ledgerspec.derivations.resolve.resolver import resolve as _resolve

    return _resolve(doc, **options)


def intake_from_trainer(trainer: Any, output: str | None = None) -> Document:
    """The ``intake/v1`` of a live ``transformers.Trainer`` (model, PEFT adapters, quantization, dtypes,
    ``TrainingArguments``), every value with where it was read (needs ``[resolve]``)."""
    from ledgerspec.derivations.integrations.trainer_intake import intake_from_trainer as _intake

    return _intake(trainer, output)


__all__ = ["__version__", "intake_from_trainer", "load", "resolve", "validate"]
