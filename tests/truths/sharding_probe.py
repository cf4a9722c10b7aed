"""Read the real per-rank FSDP2 state: run under ``torchrun``, one JSON per rank.

Builds the document's model with random weights (memory does not depend on weight values), injects the
exact adapters with PEFT, applies ``fully_shard`` to every decoder layer and then to the root, runs one
forward/backward/optimizer step on a synthetic batch and writes, for its rank, the bytes it really holds:
each sharded parameter's local storage (padding included), the gradient storages, the optimizer state
tensors, the buffers, and the unsharded (gathered) parameter storages seen while layers compute.

    torchrun --nproc_per_node 2 tests/truths/sharding_probe.py DOC OUTDIR [--reshard-after-forward false]

This is the ground truth ``tests/derivations/shard/test_sharding_fsdp2.py`` compares
:mod:`ledgerspec.derivations.shard.state` with; it uses gloo on the CPU and nccl on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ledgerspec.derivations.engine.tracker import local_tensor, storage_key, storage_nbytes


def _unique_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        seen[storage_key(t)] = storage_nbytes(t)
    return sum(seen.values())


def probe(doc_path: str, out_dir: str, reshard_after_forward: bool | None = None, seed: int = 0) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.shard.model import decoder_layers
    from ledgerspec.derivations.stack import build

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    doc = load(doc_path)
    source = build.load_config(doc, offline=True)
    dtype = build.torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    if doc.get("method", "kind").text() != "full":  # full fine-tuning: the model itself, every weight trained
        model = build.inject_adapters(doc, model)
    layers = decoder_layers(model)
    # parallelism.mixed_precision_policy, read as plain text: torch's own MixedPrecisionPolicy does the rest
    policy = {
        key: getattr(torch, text)
        for key in ("param_dtype", "reduce_dtype")
        if (text := doc.get("parallelism", "mixed_precision_policy", key).text())
    }
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy(**policy))

    gathered_seen: list[int] = []
    gathered_dtypes: set[str] = set()

    def unsharded_bytes() -> int:
        return _unique_bytes([p for p in model.parameters() if not isinstance(p, DTensor)])

    def record(_module: Any, _args: Any) -> None:
        gathered_seen.append(unsharded_bytes())
        gathered_dtypes.update(str(p.dtype).removeprefix("torch.") for p in _module.parameters())

    for layer in layers:  # registered after fully_shard's: runs once the layer is gathered
        layer.register_forward_pre_hook(record)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    micro = doc.get("workload", "microbatch").integer() or 1
    seq = doc.get("workload", "max_length").integer() or 16
    vocab = int(source.config.vocab_size)
    ids = torch.randint(0, vocab, (micro, seq), device=device)
    out = model(input_ids=ids, labels=ids)
    after_forward = unsharded_bytes()
    out.loss.backward()
    optimizer.step()

    params: dict[str, Any] = {}
    for name, p in model.named_parameters():
        local = local_tensor(p)
        state = optimizer.state.get(p, {})
        tensors = {k: local_tensor(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        params[name] = {
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "trainable": bool(p.requires_grad),
            "local_rows": int(local.shape[0]) if local.dim() else 1,
            "storage_bytes": _unique_bytes([local]),
            "grad_storage": storage_key(p.grad) if p.grad is not None else None,
            "grad_dtype": str(p.grad.dtype).removeprefix("torch.") if p.grad is not None else None,
            "optimizer_state_dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
            "optimizer_state_bytes": {k: int(t.numel() * t.element_size()) for k, t in tensors.items()},
            "optimizer_state_devices": {k: t.device.type for k, t in tensors.items()},
        }
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    result = {
        "rank": rank,
        "world_size": world,
        "reshard_after_forward": reshard_after_forward,
        "params": params,
        "buffers_bytes": _unique_bytes(list(model.buffers())),
        "grads_bytes": _unique_bytes(grads),
        "gathered_during_forward_max": max(gathered_seen) if gathered_seen else 0,
        "gathered_after_forward": after_forward,
        "gathered_dtypes": sorted(gathered_dtypes),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sharding_probe", description=__doc__.splitlines()[0])
    ap.add_argument("doc")
    ap.add_argument("out_dir")
    ap.add_argument(
        "--reshard-after-forward",
        choices=("auto", "true", "false"),
        default="auto",
        help="fully_shard's reshard_after_forward (auto: FSDP2's default, the root stays gathered)",
    )
    args = ap.parse_args(argv)
    choice = {"auto": None, "true": True, "false": False}[args.reshard_after_forward]
    probe(args.doc, args.out_dir, reshard_after_forward=choice)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
