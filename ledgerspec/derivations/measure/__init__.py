"""``measure``: the measurement protocol on a real step, in a child process (or per rank under torchrun).

- :mod:`.measurer`: :func:`measure` (one device) and the write-back of what it saw;
- :mod:`.dist`: :func:`measure_dist`, the same protocol on every FSDP2 rank;
- :mod:`.triage`: the OOM Triage Worksheet from controlled measurements (:func:`.triage.triage`).
"""

from ledgerspec.derivations.measure.dist import measure_dist
from ledgerspec.derivations.measure.measurer import measure

__all__ = ["measure", "measure_dist"]
