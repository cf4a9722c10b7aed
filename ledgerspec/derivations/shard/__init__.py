"""``shard``: per-rank memory under FSDP2 (and ZeRO for comparison), calculated and simulated.

- :mod:`.state`: the per-rank state formulas (FSDP2 padding and gathered units, ZeRO 1/2/3);
- :mod:`.model`: the sharded units and parameter descriptors of a model;
- :mod:`.workload`: the workload with ``fully_shard`` applied (measurement and simulation);
- :mod:`.simulate`: each rank's step simulated under fake tensors and a fake process group;
- :mod:`.sharder`: :func:`shard`, which writes the per-rank figures into a ledger.
"""

from ledgerspec.derivations.shard.sharder import ShardResult, shard

__all__ = ["ShardResult", "shard"]
