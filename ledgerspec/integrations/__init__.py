"""ledgerspec inside your own training script: :mod:`ledgerspec.integrations.transformers` (``LedgerCallback``)."""
