"""Read the real per-rank FSDP1 state: run under ``torchrun``, one JSON per rank.

FSDP1 as transformers' Trainer + accelerate wrap a PEFT model (``FullyShardedDataParallel``, ``FULL_SHARD`` or
``SHARD_GRAD_OP``, ``use_orig_params=True``, ``limit_all_gathers=True``, the auto-wrap policy of PEFT's
``fsdp_auto_wrap_policy``: decoder layers + every leaf module with a trainable weight). Builds the document's
model with random weights, injects the exact adapters with PEFT, wraps it, runs one forward/backward/AdamW
step on a synthetic batch and writes, for its rank, what it really holds: every flat parameter (its unit, padded
numel, local shard, dtype, gradient), the optimizer state tensors, the buffers and the gathered (unsharded)
flat parameters seen when each decoder layer starts its forward.

    torchrun --nproc_per_node 2 tests/truths/fsdp1_probe.py DOC OUTDIR [--shard-grad-op] [--pretrained CHECKPOINT]

With ``--pretrained`` (QLoRA) the model is loaded from a checkpoint by transformers with the document's
``BitsAndBytesConfig`` (bitsandbytes quantizing on the CPU) and the bytes of every ``QuantState`` are reported.

This is the ground truth ``tests/derivations/shard/test_fsdp1.py`` compares
:func:`ledgerspec.derivations.shard.state.fsdp1` with (gloo on the CPU). No ledgerspec code builds or wraps
the model: transformers, PEFT and torch do, as the Trainer would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

ROOT = "<root>"


def _storage_bytes(t: Any) -> int:
    return int(t.untyped_storage().nbytes()) if t is not None else 0


def _quant_state_bytes(model: Any) -> int:
    """The bytes of every bitsandbytes ``QuantState`` tensor (absmax, code, nested state) on the model, each storage
    once: not parameters, so FSDP1 leaves them whole on every rank."""
    import torch

    seen: dict[int, int] = {}

    def walk(state: Any) -> None:
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                seen[id(value.untyped_storage())] = _storage_bytes(value)
            elif type(value).__name__ == "QuantState":
                walk(value)

    for m in model.modules():
        state = getattr(m, "quant_state", None)
        if state is not None:
            walk(state)
    return sum(seen.values())


def _pretrained_4bit(doc: Any, path: str, dtype: Any) -> Any:
    """The document's 4-bit model as transformers loads it (``BitsAndBytesConfig`` from ``base_model.quantization``)
    from the checkpoint at ``path``, on the CPU (bitsandbytes >= 0.49 quantizes there)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = ("base_model", "quantization")
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=doc.get(*q, "type").text() or "nf4",
        bnb_4bit_use_double_quant=bool(doc.get(*q, "double_quant").switch()),
        bnb_4bit_compute_dtype=getattr(torch, doc.get(*q, "compute_dtype").text() or "bfloat16"),
        bnb_4bit_quant_storage=getattr(torch, doc.get(*q, "storage_dtype").text() or "uint8"),
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype, device_map="cpu")
    return model.train()  # from_pretrained returns eval mode; the Trainer trains (bitsandbytes' CPU path differs)


def _transformer_policy(model: Any) -> Any:
    """What accelerate wraps a model that is not a PEFT model with (``fsdp_auto_wrap_policy:
    TRANSFORMER_BASED_WRAP``, the Trainer's default): each ``_no_split_modules`` class is a unit, the rest the root."""
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    classes = {type(m) for m in model.modules() if type(m).__name__ in set(model._no_split_modules or ())}
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)


def probe(
    doc_path: str, out_dir: str, shard_grad_op: bool = False, seed: int = 0, pretrained: str | None = None
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from transformers import AutoModelForCausalLM

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.stack import build

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    doc = load(doc_path)
    source = build.load_config(doc, offline=True)
    dtype = build.torch_dtype(doc, ("base_model", "loaded_dtype"), "float32")
    adapter = build.torch_dtype(doc, ("adapter", "dtype"), "float32")
    torch.manual_seed(seed)
    if pretrained:  # QLoRA: transformers loads and quantizes the checkpoint (every rank the same weights)
        model = _pretrained_4bit(doc, pretrained, dtype)
    else:
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    full = doc.get("method", "kind").text() == "full"  # full fine-tuning: the model itself, every weight trained
    if not full:
        model = build.inject_adapters(doc, model)
        for p in model.parameters():  # the adapter dtype the ledger declares (PEFT upcasts to float32 by default)
            if p.requires_grad:
                p.data = p.data.to(adapter)
    names = {id(m): n for n, m in model.named_modules()}
    mp = {
        key: getattr(torch, text)
        for key in ("param_dtype", "reduce_dtype")
        if (text := doc.get("parallelism", "mixed_precision_policy", key).text())
    }
    wrapped = FSDP(
        model,
        auto_wrap_policy=_transformer_policy(model) if full else fsdp_auto_wrap_policy(model),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP if shard_grad_op else ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        limit_all_gathers=True,
        mixed_precision=MixedPrecision(**mp) if mp else None,
        device_id=torch.device("cpu"),
    )
    handles = [(m, m._handle) for m in wrapped.modules() if isinstance(m, FSDP) and m._handle is not None]

    def gathered() -> int:  # the padded unsharded flat parameters allocated now
        return sum(_storage_bytes(getattr(h.flat_param, "_full_param_padded", None)) for _, h in handles)

    seen: list[int] = []
    layer_classes = set(getattr(model if full else model.get_base_model(), "_no_split_modules", None) or [])
    for m in wrapped.modules():
        if type(m).__name__ in layer_classes:
            m.register_forward_pre_hook(lambda _m, _a: seen.append(gathered()))

    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    micro = doc.get("workload", "microbatch").integer() or 1
    seq = doc.get("workload", "max_length").integer() or 16
    ids = torch.randint(0, int(source.config.vocab_size), (micro, seq))
    # accelerate runs FSDP1's MixedPrecision together with autocast (`Accelerator.prepare_model`); without it a
    # nested unit (a LoRA Linear) receives the input PEFT cast to its still-sharded float32 weight's dtype
    region = torch.autocast("cpu", dtype=mp["param_dtype"]) if "param_dtype" in mp else contextlib.nullcontext()
    with region:
        out = wrapped(input_ids=ids, labels=ids)
    after_forward = gathered()
    out.loss.backward()
    optimizer.step()

    units = []
    for m, h in handles:
        fp = h.flat_param
        inner = m.module
        units.append(
            {
                "unit": ROOT if m is wrapped else names[id(inner)],
                "numel": int(fp._unpadded_unsharded_size.numel()),
                "local_numel": int(fp._local_shard.numel()),
                "local_bytes": _storage_bytes(fp._local_shard),
                "dtype": str(fp.dtype).removeprefix("torch."),
                "requires_grad": bool(fp.requires_grad),
                "grad_bytes": _storage_bytes(fp.grad),
                "fqns": list(fp._fqns),
            }
        )
    state: dict[str, dict[str, int]] = {}
    for name, p in wrapped.named_parameters():
        tensors = optimizer.state.get(p, {})
        if tensors:
            state[name] = {k: int(t.numel() * t.element_size()) for k, t in tensors.items()}
    result = {
        "rank": rank,
        "world_size": world,
        "units": units,
        "optimizer_state": state,
        "buffers_bytes": sum(_storage_bytes(b) for b in {id(b): b for b in wrapped.buffers()}.values()),
        "quant_state_bytes": _quant_state_bytes(wrapped),
        "gathered_at_layer_forward_max": max(seen) if seen else 0,
        "gathered_after_forward": after_forward,
        "loss": float(out.loss.detach()),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fsdp1_probe", description=__doc__.splitlines()[0])
    ap.add_argument("doc")
    ap.add_argument("out_dir")
    ap.add_argument("--shard-grad-op", action="store_true", help="SHARD_GRAD_OP instead of FULL_SHARD")
    ap.add_argument("--pretrained", help="load this checkpoint quantized as the document declares (QLoRA)")
    args = ap.parse_args(argv)
    probe(args.doc, args.out_dir, shard_grad_op=args.shard_grad_op, pretrained=args.pretrained)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
