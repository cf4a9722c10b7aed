"""FSDP per rank: FSDP2 (``fully_shard`` per decoder layer + root) and FSDP1 (``FullyShardedDataParallel`` as
transformers' Trainer and accelerate wrap a PEFT model), hybrid sharding included.

- :mod:`.workload`: the workloads sharded with FSDP2 or wrapped in FSDP1 (measurement and simulation);
- :mod:`.storage_checks`: FSDP1's data-pointer checks asked of the storages for fake tensors, and the guard that
  refuses a torch whose replaced functions are not the ones they were written against;
- :mod:`.legacy_checkpoint`: transformers < 4.52's checkpoint around an FSDP1 unit, when the ledger declares it;
- :mod:`.simulate`: :func:`estimate_per_rank`, each rank's FSDP step simulated under fake tensors.
"""

from ledgerspec.derivations.shard.fsdp.simulate import estimate_per_rank

__all__ = ["estimate_per_rank"]
