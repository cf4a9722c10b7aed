"""Layer extrapolation: trace two shallow copies of the model, extend every figure linearly to the real depth.

Decoder layers of one type are identical, so every memory figure of a training step (each phase peak,
each category) is an affine function of the number of layers ``n`` once ``n`` is past the first
layers: ``f(n) = f(n1) + (n - n1) / p * (f(n2) - f(n1))``, with ``p`` the period of the layer pattern
(1 for uniform stacks; 2 for Gemma2's sliding/full alternation). The probes are ``n1 = 2p + r`` and
``n2 = 3p + r`` layers (``r = L mod p``), so every probe holds whole periods plus the same remainder
as the real model. ``tests/derivations/estimate/test_estimate_extrapolate.py`` checks the extrapolation against
full traces.

Architectures whose layers are not periodic (dense-then-MoE stacks, per-layer MLP lists, Mllama's cross-attention
layers) are traced in full: slower, never a guess. The layers are those of the language model's config
(:func:`ledgerspec.derivations.stack.build.text_config`: the ``text_config`` of a vision-language model, whose
vision tower keeps its depth); pure logic apart from copying the config.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: config attributes that make layers differ in a way the period of ``layer_types`` does not describe
_IRREGULAR = (
    "first_k_dense_replace",
    "mlp_only_layers",
    "moe_layer_freq",
    "decoder_sparse_step",
    "cross_attention_layers",
    "no_rope_layers",
)


@dataclass(frozen=True)
class Plan:
    """How to trace a model of ``layers`` layers: two probes, or the full depth (``probes`` is None)."""

    layers: int
    period: int
    probes: tuple[int, int] | None
    reason: str

    def describe(self) -> str:
        if self.probes is None:
            return f"full trace of all {self.layers} layers ({self.reason})"
        n1, n2 = self.probes
        return (
            f"traced with {n1} and {n2} decoder layers and extrapolated linearly to {self.layers} "
            f"(layer pattern period {self.period})"
        )


def _text(config: Any) -> Any:
    """The language model's config (lazy import: the stack room imports transformers only inside functions)."""
    from ledgerspec.derivations.stack.build import text_config

    return text_config(config)


def layer_count(config: Any) -> int | None:
    n = getattr(_text(config), "num_hidden_layers", None)
    return n if isinstance(n, int) and n > 0 else None


def layer_period(config: Any) -> int | None:
    """The smallest period of the layer pattern, 1 for a uniform stack, None when not periodic/known."""
    config = _text(config)
    for attr in _IRREGULAR:
        value = getattr(config, attr, None)
        if value not in (None, 0, 1, [], (), False):
            return None
    n = layer_count(config)
    types = getattr(config, "layer_types", None)
    if not types or n is None:
        return 1
    types = list(types)[:n]
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return None


def plan(config: Any) -> Plan:
    n = layer_count(config)
    if n is None:
        raise ValueError("the config has no num_hidden_layers")
    p = layer_period(config)
    if p is None:
        return Plan(n, 0, None, "layers are not a periodic stack")
    r = n % p
    n1, n2 = 2 * p + r, 3 * p + r
    if n2 >= n:
        return Plan(n, p, None, "the model is shallow enough")
    return Plan(n, p, (n1, n2), "periodic stack")


def with_layers(config: Any, n: int) -> Any:
    """A copy of ``config`` with ``n`` decoder layers in its language model (the layer pattern truncated
    accordingly); a vision tower keeps its depth."""
    c = copy.deepcopy(config)
    text = _text(c)
    types = getattr(text, "layer_types", None)
    text.num_hidden_layers = n
    if types:
        text.layer_types = list(types)[:n]
    return c


def extend(v1: int, v2: int, n1: int, n2: int, n: int) -> int:
    """The affine extension of two probes to ``n`` layers (exact integer arithmetic)."""
    span = n2 - n1
    steps, rest = divmod((n - n1) * (v2 - v1), span)
    if rest:
        # (n - n1) is a whole number of periods: the division is exact; keep the integer anyway
        return v1 + steps + (1 if 2 * rest >= span else 0)
    return v1 + steps


def extend_all(a: Mapping[str, int], b: Mapping[str, int], n1: int, n2: int, n: int) -> dict[str, int]:
    """Every figure of two probe traces, extended to ``n`` layers (keys must agree)."""
    if set(a) != set(b):
        raise ValueError(f"probe traces disagree on their figures: {sorted(set(a) ^ set(b))}")
    return {k: extend(a[k], b[k], n1, n2, n) for k in a}
