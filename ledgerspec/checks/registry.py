"""The rule registry: each rule is data (id, severity, title, hint) plus a pure check function.

It records rules and imports none: :mod:`ledgerspec.checks.rules` registers them with :func:`rule`, and
:func:`ledgerspec.checks.catalogue.all_rules` (above both) lists them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ledgerspec.checks.findings import Hit

if TYPE_CHECKING:
    from ledgerspec.checks.context import Context

Check = Callable[["Context"], Iterable[Hit]]


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # the default; "error / warning" rules pick per hit
    title: str  # what it catches, one line
    hint: str  # how to fix
    check: Check
    example: str = ""  # a YAML fragment that triggers it (for the docs)


RULES: dict[str, Rule] = {}


def rule(id: str, severity: str, title: str, hint: str, example: str = "") -> Callable[[Check], Check]:
    """Register ``check`` as rule ``id``."""

    def register(check: Check) -> Check:
        if id in RULES:
            raise ValueError(f"rule {id} registered twice")
        RULES[id] = Rule(id, severity, title, hint, check, example)
        return check

    return register
