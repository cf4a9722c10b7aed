"""``integrations``: ledgerspec inside the user's own training script.

- :mod:`.trainer_intake`: :func:`intake_from_trainer`, the intake of a live ``transformers.Trainer`` (its model,
  PEFT adapters, quantization, dtypes and ``TrainingArguments``), every value with where it was read;
- :mod:`.transformers`: ``LedgerCallback``, a ``transformers.TrainerCallback`` that records the phases of the
  real run into a ledger (the tensor tracker on the CPU, the caching allocator's counters on CUDA).

Imports torch & co. only inside functions (the callback class is made on first use).
"""

from ledgerspec.derivations.integrations.trainer_intake import intake_from_trainer

__all__ = ["intake_from_trainer"]
