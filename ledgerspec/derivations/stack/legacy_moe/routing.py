"""How many tokens each expert receives in a simulated step (fake tensors carry no router values).

By default an even split: ``tokens x top_k`` assignments, ``floor`` each and one more for the first
``remainder`` experts (every expert gets at most ``tokens`` of them: a token picks an expert at most once). A caller
that knows the real routing (the truth test: the counts the real run's router gave, layer by layer and call by call)
supplies them with :func:`given`: then every call of the MoE block of layer ``l`` on ``n`` tokens takes the first
counts given for that layer and token count. Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

_GIVEN: dict[tuple[int, int], list[int]] = {}


def even(tokens: int, top_k: int, experts: int) -> list[int]:
    """The even split of ``tokens x top_k`` assignments over ``experts``."""
    total = tokens * top_k
    base, extra = divmod(total, experts)
    return [min(tokens, base + (1 if e < extra else 0)) for e in range(experts)]


def counts(layer: int, tokens: int, top_k: int, experts: int) -> list[int]:
    """The tokens each expert of layer ``layer`` receives in this call of its block."""
    given = _GIVEN.get((layer, tokens))
    return list(given) if given is not None and len(given) == experts else even(tokens, top_k, experts)


@contextlib.contextmanager
def given(calls: Sequence[tuple[int, int, Sequence[int]]]) -> Iterator[None]:
    """The real routing, ``(layer, tokens, counts per expert)`` in call order, for the simulations inside."""
    saved = dict(_GIVEN)
    _GIVEN.clear()
    for layer, tokens, per_expert in calls:
        _GIVEN.setdefault((layer, tokens), [int(c) for c in per_expert])
    try:
        yield
    finally:
        _GIVEN.clear()
        _GIVEN.update(saved)


__all__ = ["counts", "even", "given"]
