"""The optimizer names the ledger knows, and what each name means for memory (data, no torch).

The names are transformers' ``TrainingArguments.optim`` spelling (plus plain ``adam``, ``sgd_momentum``).
The checks wing reads this catalogue to tell whether ``optimizer.bits`` and ``optimizer.paged``
follow from a name; :mod:`ledgerspec.derivations.stack.optimizer_state` turns a spec into exact state bytes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer name means for memory."""

    name: str
    family: str  # adam | sgd | adafactor | bnb
    states: int  # moment tensors per parameter (adam 2, sgd-momentum 1, lion 1)
    bits: int = 32  # bits per state value for bitsandbytes; torch states follow the param dtype
    paged: bool = False
    fused: bool = False
    library: str = "torch"

    def describe(self) -> str:
        if self.family == "adam":
            step = "device fp32 step per tensor (fused)" if self.fused else "step scalar on the host"
            return f"2 x zeros_like(param) moments, {step}"
        if self.family == "sgd":
            return "1 x momentum buffer like the gradient" if self.states else "no state (SGD without momentum)"
        if self.family == "adafactor":
            return "factored second moment: row + column vectors per matrix, full vector per 1-D tensor"
        paged = "paged (unified memory), " if self.paged else ""
        if self.bits == 8:
            return f"{paged}{self.states} x uint8 blockwise + fp32 absmax per 256 values; fp32 under min_8bit_size"
        return f"{paged}{self.states} x fp32"


def _bnb(name: str, states: int, bits: int, paged: bool) -> OptimizerSpec:
    return OptimizerSpec(name, "bnb", states, bits=bits, paged=paged, library="bitsandbytes")


#: optimizer names (transformers ``TrainingArguments.optim`` spelling) and what they allocate
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw_torch": OptimizerSpec("adamw_torch", "adam", 2),
    "adamw": OptimizerSpec("adamw", "adam", 2),
    "adam": OptimizerSpec("adam", "adam", 2),
    "adamw_torch_fused": OptimizerSpec("adamw_torch_fused", "adam", 2, fused=True),
    "sgd": OptimizerSpec("sgd", "sgd", 0),
    "sgd_momentum": OptimizerSpec("sgd_momentum", "sgd", 1),
    "adafactor": OptimizerSpec("adafactor", "adafactor", 1, library="transformers"),
    "adamw_8bit": _bnb("adamw_8bit", 2, 8, False),
    "adamw_bnb_8bit": _bnb("adamw_bnb_8bit", 2, 8, False),
    "adam_8bit": _bnb("adam_8bit", 2, 8, False),
    "paged_adamw_8bit": _bnb("paged_adamw_8bit", 2, 8, True),
    "paged_adam_8bit": _bnb("paged_adam_8bit", 2, 8, True),
    "paged_adamw_32bit": _bnb("paged_adamw_32bit", 2, 32, True),
    "paged_adam_32bit": _bnb("paged_adam_32bit", 2, 32, True),
    "paged_adamw": _bnb("paged_adamw", 2, 32, True),
    "lion_8bit": _bnb("lion_8bit", 1, 8, False),
    "lion_32bit": _bnb("lion_32bit", 1, 32, False),
    "paged_lion_8bit": _bnb("paged_lion_8bit", 1, 8, True),
    "paged_lion_32bit": _bnb("paged_lion_32bit", 1, 32, True),
}


def optimizer_spec(name: str) -> OptimizerSpec | None:
    """The spec of an optimizer name (case-insensitive), or None when it is not supported."""
    return OPTIMIZERS.get(name.strip().lower())


def suggest(name: str) -> str | None:
    """The known name closest to ``name`` (for a did-you-mean), or None: first a known name of the same words in
    another order (``adamw_8bit_paged`` is ``paged_adamw_8bit``), else the closest spelling."""
    key = name.strip().lower()
    words = sorted(w for w in key.replace("-", "_").split("_") if w)
    same = [known for known in OPTIMIZERS if sorted(w for w in known.split("_") if w) == words]
    if same:
        return same[0]
    close = difflib.get_close_matches(key, list(OPTIMIZERS), n=1, cutoff=0.6)
    return close[0] if close else None
