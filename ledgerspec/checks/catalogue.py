"""The rule catalogue, assembled: every rule of :mod:`ledgerspec.checks.rules`, as recorded by
:mod:`ledgerspec.checks.registry`.

The registry says how a rule is recorded (:func:`~ledgerspec.checks.registry.rule`) and knows no rule; the rules
module registers each of its rules as it is imported. This module, above both, imports the rules and reads the
registry, so neither of the two imports the other back.
"""

from __future__ import annotations

from ledgerspec.checks import rules  # noqa: F401  (importing the rules registers them)
from ledgerspec.checks.registry import RULES, Rule


def all_rules() -> list[Rule]:
    """Every rule of the catalogue, by id."""
    return [RULES[k] for k in sorted(RULES)]


__all__ = ["all_rules"]
