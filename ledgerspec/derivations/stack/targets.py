"""Which names of ``method.target_modules``, ``modules_to_save`` and ``exclude_modules`` (lists) match nothing in the
model.

PEFT matches a list of target names by suffix: a module (or, for fused MoE experts, a parameter) whose full name is
the name or ends in ``.name`` (``check_target_module_exists``, ``peft/tuners/tuners_utils.py``, PEFT 0.21). It raises
only when no name matches at all: a misspelt name among correct ones (``[q_prj, v_proj]``) injects fewer adapters
than the ledger says, silently. ``modules_to_save`` is matched as a plain ending of a module's name
(``_set_trainable``, ``peft/utils/other.py``: ``key.endswith(target_key)``) and skipped in silence too: a misspelt
one drops a whole trainable copy and its optimizer state. ``exclude_modules`` is matched as the targets are; a
misspelt one adapts what it was to leave alone. A string is one regular expression matched against each whole name,
and ``all-linear`` is PEFT's shorthand only as a string; neither is checked here (PEFT raises when a string target
matches nothing). Pure: reads names, imports nothing heavy.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable

#: PEFT's shorthand for every linear layer but the output head, a string value only
ALL_LINEAR = "all-linear"
#: the head names PEFT's sequence classifier adds to modules_to_save, both, whichever the model has
#: (``PeftModelForSequenceClassification.__init__``, ``peft/peft_model.py``, PEFT 0.21)
CLASSIFIER_HEADS = ("classifier", "score")


def matches(target: str, name: str) -> bool:
    """PEFT's rule for one name of a target (or exclude) list: the whole name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def ends(target: str, name: str) -> bool:
    """PEFT's rule for one name of ``modules_to_save``: any ending of the module's name."""
    return name.endswith(target)


def unmatched(targets: Iterable[str], names: Iterable[str], rule: Callable[[str, str], bool] = matches) -> list[str]:
    """The targets that no name matches (by ``rule``), in the order given, each once."""
    names = list(names)
    return [t for t in dict.fromkeys(targets) if not any(rule(t, n) for n in names)]


def pattern_matches(key: str, name: str) -> bool:
    """PEFT's rule for a key of ``rank_pattern``/``alpha_pattern``: a regular expression for the name's last dotted
    parts (``get_pattern_key``; the same test warns of unmatched keys in ``inject_adapter``, PEFT 0.21); a key that
    is no regular expression matches nothing."""
    try:
        return re.match(rf"(.*\.)?({key})$", name) is not None
    except re.error:
        return False


def plain_name(text: str) -> bool:
    """A module name (letters, digits, ``_``, ``.``, ``-``), not a regular expression."""
    return re.fullmatch(r"[\w.\-]+", text) is not None


def guesses(missing: list[str], names: Iterable[str]) -> list[str]:
    """A did-you-mean for each missing name that resembles a module's last name (never the name itself)."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
    out = []
    for t in missing:
        if t.strip().lower().replace("_", "-") == ALL_LINEAR:
            out.append(f"{t!r} is PEFT's shorthand only as a string (target_modules: all-linear)")
            continue
        close = [c for c in difflib.get_close_matches(t.rsplit(".", 1)[-1], leaves, n=2, cutoff=0.6) if c != t]
        if close:
            out.append(f"{t!r}: did you mean {close[0]!r}?")
    return out


def problem(field: str, missing: list[str], names: Iterable[str], model: str, others_match: bool) -> tuple[str, str]:
    """The message and hint for the names of ``method.FIELD`` that match nothing in ``model`` (whose module and
    parameter names, before PEFT's injection, are ``names``); ``others_match``: other names of the list did match,
    so PEFT went on without these."""
    listed = ", ".join(repr(t) for t in missing)
    verb = "matches" if len(missing) == 1 else "match"
    why = {
        "target_modules": "PEFT adapts a module whose name is the target or ends in '.' + target"
        + (
            ", and skips a target that matches nothing, so the adapter would be smaller than declared"
            if others_match
            else ""
        ),
        "modules_to_save": "PEFT trains a full copy of each module whose name ends in it and skips a name that matches "
        "nothing, so the trainable copy and its optimizer state would be missing",
        "exclude_modules": "PEFT leaves out a module whose name is it or ends in '.' + it, and ignores a name that "
        "matches nothing, so what it was to leave out would be adapted",
        "rank_pattern": "PEFT gives a pattern's rank to the adapted modules whose name ends in a match of it and "
        "ignores a pattern that matches none of them: misspelt, or a module the targets do not adapt",
        "alpha_pattern": "PEFT gives a pattern's alpha to the adapted modules whose name ends in a match of it and "
        "ignores a pattern that matches none of them: misspelt, or a module the targets do not adapt",
    }[field]
    whose = "no adapted module" if field in ("rank_pattern", "alpha_pattern") else "no module"
    message = f"method.{field}: {listed} {verb} {whose} of {model} ({why})"
    found = guesses(missing, names)
    hint = "; ".join(found) if found else "correct the name or remove it; `print(model)` lists the modules"
    return message, hint


def string_hint(value: str) -> str | None:
    """The hint for a string ``target_modules`` that matched nothing: a misspelt ``all-linear``, or a plain name that
    PEFT read as a regular expression of the whole module name (None: a pattern, left as PEFT's message says)."""
    text = value.strip()
    if difflib.get_close_matches(text.lower(), [ALL_LINEAR], n=1, cutoff=0.8):
        return f"did you mean {ALL_LINEAR!r}?"
    if plain_name(text):
        return (
            f"a string is one regular expression PEFT matches against each module's whole name: write a list "
            f"([{text}]) to match by name, or a pattern such as '.*\\.{text}'"
        )
    return None


__all__ = [
    "ALL_LINEAR",
    "CLASSIFIER_HEADS",
    "ends",
    "guesses",
    "matches",
    "pattern_matches",
    "plain_name",
    "problem",
    "string_hint",
    "unmatched",
]
