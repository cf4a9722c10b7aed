"""DeepSpeed ZeRO-1/2/3 per rank, run by DeepSpeed's own engine (CPU offload included).

- :mod:`.engine`: the workload trained by DeepSpeed's engine, its config, and what fake tensors cannot answer;
- :mod:`.simulate`: :func:`estimate_zero_per_rank`, each rank's ZeRO step simulated under fake tensors.
"""

from ledgerspec.derivations.shard.zero.simulate import estimate_zero_per_rank

__all__ = ["estimate_zero_per_rank"]
