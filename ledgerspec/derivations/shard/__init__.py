"""``shard``: per-rank memory under FSDP2, FSDP1 (hybrid sharding, CPU offload, mixed precision) and DeepSpeed
ZeRO-1/2/3 (CPU offload), calculated and simulated.

The base every strategy imports:

- :mod:`.state`: the per-rank state formulas (FSDP2 padding and gathered units, FSDP1 flat parameters, ZeRO 1/2/3);
- :mod:`.model`: the sharded units and parameter descriptors of a model, and the adapters in their declared dtype;
- :mod:`.options`: what the document declares about parallelism (rank count, shard group, mixed precision, CPU
  offload, FSDP1 options, ZeRO stage and options) and the refusals it implies;
- :mod:`.patching`: library attributes replaced for a block (what fake tensors cannot answer);
- :mod:`.simulation`: what every per-rank simulation shares (the estimates, the fake process group, the probes);
- :mod:`.plans`: the FSDP plan a document declares (``shard``'s and ``measure --nproc``'s calculated rows).

The strategies, each a room that imports only the base (and :mod:`.offload`):

- :mod:`.fsdp`: FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``): the workloads and the simulation;
- :mod:`.zero`: DeepSpeed ZeRO-1/2/3 run by DeepSpeed's own engine, and its simulation;
- :mod:`.offload`: CPU offload: which side of the bus each storage is on (FSDP's and ZeRO's rules).

On top, :mod:`.sharder`: :func:`shard`, which dispatches to the strategy declared and writes the per-rank figures
into a ledger.
"""

from ledgerspec.derivations.shard.sharder import ShardResult, shard

__all__ = ["ShardResult", "shard"]
