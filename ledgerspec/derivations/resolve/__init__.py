"""``resolve``: every figure that follows exactly from the configuration (counts, bytes of the resident parts).

- :mod:`.resolver`: :func:`resolve` and the figures it writes;
- :mod:`.record`: what resolve records about its own plain values and inputs (``x-resolve``).
"""

from ledgerspec.derivations.resolve.resolver import ResolveResult, resolve

__all__ = ["ResolveResult", "resolve"]
