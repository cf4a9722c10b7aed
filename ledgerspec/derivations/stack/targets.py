"""Which names of ``method.target_modules`` match nothing in the model.

PEFT matches a list of target names by suffix: a module (or, for fused MoE experts, a parameter) whose full name is
the name or ends in ``.name`` (``check_target_module_exists``, ``peft/tuners/tuners_utils.py``, PEFT 0.21). It raises
only when no name matches at all: a misspelt name among correct ones (``[q_prj, v_proj]``) injects fewer adapters
than the ledger says, silently. A string is one regular expression matched against each whole name, and
``all-linear`` is PEFT's shorthand only as a string; neither is checked here (PEFT raises when a string matches
nothing). Pure: reads names, imports nothing heavy. The caller asks after PEFT's injection, so that PEFT's own
conversion of transformers 4's expert names (Mixtral's ``w1``/``w3``, which transformers 5 fuses into one
``gate_up_proj`` parameter that PEFT then targets: ``peft/utils/transformers_weight_conversion.py``) counts as a
match.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: PEFT's shorthand for every linear layer but the output head, a string value only
ALL_LINEAR = "all-linear"


def matches(target: str, name: str) -> bool:
    """PEFT's rule for one name of a list: the whole name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def unmatched(targets: Iterable[str], names: Iterable[str]) -> list[str]:
    """The targets that no name matches, in the order given."""
    names = list(names)
    return [t for t in targets if not any(matches(t, n) for n in names)]


def problem(missing: list[str], names: Iterable[str], model: str) -> tuple[str, str]:
    """The message and hint for the targets of a list that adapt nothing in ``model``, whose module and parameter
    names are ``names`` (for the guesses)."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
    guesses = []
    for t in missing:
        close = difflib.get_close_matches(t, leaves, n=1, cutoff=0.6)
        if t.strip().lower() == ALL_LINEAR:
            guesses.append(f"{t!r} is PEFT's shorthand only as a string (target_modules: all-linear)")
        elif close:
            guesses.append(f"{t!r}: did you mean {close[0]!r}?")
    listed = ", ".join(repr(t) for t in missing)
    verb = "matches" if len(missing) == 1 else "match"
    message = (
        f"method.target_modules: {listed} {verb} no module of {model} (PEFT adapts a module whose name is the target "
        "or ends in '.' + target, and skips a target that matches nothing, so the adapter would be smaller than "
        "declared)"
    )
    hint = "; ".join(guesses) if guesses else "correct the name or remove it; `print(model)` lists the modules"
    return message, hint


__all__ = ["ALL_LINEAR", "matches", "problem", "unmatched"]
