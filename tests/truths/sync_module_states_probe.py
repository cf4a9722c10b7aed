"""Observe FSDP1's ``sync_module_states`` broadcasts on the CPU: two gloo ranks, real tensors, real FSDP1.

The document's model (random weights, the exact adapters injected with PEFT, as ``fsdp1_probe.py`` builds it) is
wrapped by ``FullyShardedDataParallel`` as accelerate wraps a PEFT model (PEFT's ``fsdp_auto_wrap_policy``,
``use_orig_params``, ``FULL_SHARD``) with ``sync_module_states=True``. FSDP1 refuses that for CPU tensors
(``_init_utils._check_module_states_for_sync_module_states``); that one check is lifted here, so the rest runs as
on a GPU: ``_sync_module_params_and_buffers`` per unit, ``dist._broadcast_coalesced`` over gloo, the C++
``broadcast_coalesced`` with its buckets and its two broadcasts in flight. ``PARAM_BROADCAST_BUCKET_SIZE`` is set to
``--bucket`` bytes (250 MiB in torch) so that the tiny model's units make several buckets.

For every call of ``_sync_params_and_buffers`` (one per unit with states), each rank writes: the tensors broadcast
(bytes, dtype, whether a buffer), the buckets ``torch._C._distributed_c10d._compute_bucket_assignment_by_size``
gives for them, and the allocations and frees made inside the call, in order, as a ``TorchDispatchMode`` of its own
sees them (a new storage in an op's output; its release through a ``weakref.finalize`` on the storage). After the
wrapping, rank 1's gathered unsharded parameters are compared with rank 0's (``summon_full_params``): equal when the
broadcasts happened (every rank drew different random weights).

    torchrun --nproc_per_node 2 tests/truths/sync_module_states_probe.py DOC OUT.json [--bucket 65536]

No ledgerspec code wraps the model or logs the allocations: torch, transformers and PEFT do, as the Trainer would.
"""

from __future__ import annotations

import argparse
import json
import platform
import weakref
from pathlib import Path
from typing import Any


def _logger() -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        """Every new storage an op returns (allocated), and when it is released (freed)."""

        def __init__(self, known: set[int]) -> None:
            super().__init__()
            self.known = known  # storages that existed before (the tensors being broadcast)
            self.events: list[list[Any]] = []
            self.ids: dict[int, int] = {}  # live storage -> its number
            self.count = 0

        def _seen(self, t: Any) -> None:
            storage = t.untyped_storage()
            key = int(storage._cdata)
            if key in self.known or key in self.ids:
                return
            ident = self.count
            self.count += 1
            self.ids[key] = ident
            self.events.append(["alloc", ident, int(storage.nbytes())])
            weakref.finalize(storage, self._freed, key, ident)

        def _freed(self, key: int, ident: int) -> None:
            self.ids.pop(key, None)  # a later storage may get the same address
            self.events.append(["free", ident])

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, list | tuple) else [out]:
                if isinstance(t, torch.Tensor):
                    self._seen(t)
            return out

    return Log


def probe(doc_path: str, out: str, bucket: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._init_utils as init_utils
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from transformers import AutoModelForCausalLM

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.stack import build

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    doc = load(doc_path)
    source = build.load_config(doc, offline=True)
    dtype = build.torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    adapter = build.torch_dtype(doc, ("adapter", "dtype"), "float32")
    torch.manual_seed(seed + rank)  # different weights on every rank: the broadcast makes them rank 0's
    model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    model = build.inject_adapters(doc, model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter)

    Log = _logger()
    calls: list[dict[str, Any]] = []
    original = init_utils._sync_params_and_buffers
    buffers = {int(b.untyped_storage()._cdata) for b in model.buffers()}

    def logged(process_group: Any, states: list[Any], size: int, src: int) -> None:
        known = {int(t.untyped_storage()._cdata) for t in states}
        buckets, _ = torch._C._distributed_c10d._compute_bucket_assignment_by_size(states, [size])
        with Log(known) as log:
            original(process_group, states, size, src)
        calls.append(
            {
                "tensors": [
                    {
                        "bytes": int(t.numel() * t.element_size()),
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "buffer": int(t.untyped_storage()._cdata) in buffers,
                    }
                    for t in states
                ],
                "buckets": [list(b) for b in buckets],
                "events": log.events,
            }
        )

    init_utils._sync_params_and_buffers = logged  # type: ignore[assignment]
    init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    init_utils.PARAM_BROADCAST_BUCKET_SIZE = bucket
    wrapped = FSDP(
        model,
        auto_wrap_policy=fsdp_auto_wrap_policy(model),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
        sync_module_states=True,
    )
    with FSDP.summon_full_params(wrapped):
        flat = torch.cat([p.detach().reshape(-1).float() for p in wrapped.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "bucket_size": bucket,
        "same_weights_as_rank0": bool(torch.equal(gathered[0], flat)),
        "calls": calls,
        "versions": {
            "torch": torch.__version__,
            "torch_git": torch.version.git_version,
            "python": platform.python_version(),
        },
    }
    all_results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, result)
    if rank == 0:
        command = (
            "torchrun --nproc_per_node 2 tests/truths/sync_module_states_probe.py "
            f"{doc_path} {out} --bucket {bucket} --seed {seed}"
        )
        Path(out).write_text(json.dumps({"command": command, "ranks": all_results}, indent=1) + "\n", encoding="utf-8")
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sync_module_states_probe", description=__doc__.splitlines()[0])
    ap.add_argument("doc")
    ap.add_argument("out")
    ap.add_argument("--bucket", type=int, default=65536, help="PARAM_BROADCAST_BUCKET_SIZE in bytes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    probe(args.doc, args.out, args.bucket, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
