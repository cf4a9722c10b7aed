"""Does one FSDP1 training micro-step with ``MixedPrecision(param_dtype=...)`` run? Run under ``torchrun``.

The tiny Llama of ``tests/data/sharding/tiny`` with PEFT LoRA on every projection, wrapped as transformers' Trainer +
accelerate wrap a PEFT model (``FullyShardedDataParallel``, PEFT's ``fsdp_auto_wrap_policy``, ``use_orig_params=True``,
``limit_all_gathers=True``, ``FULL_SHARD``, the policy as accelerate builds it: ``MixedPrecision(param_dtype,
reduce_dtype)``, no ``cast_forward_inputs``), one forward and backward on a synthetic batch, optionally under CPU
autocast (what accelerate's ``mixed_precision: bf16`` adds) and with gradient checkpointing. Rank 0 writes a JSON:
``{"ok": true}`` or the exception, its message and the innermost frame (file:line) that raised it.

    torchrun --nproc_per_node 2 tests/truths/fsdp1_mixed_precision_probe.py CONFIG_DIR OUT.json \
        [--param-dtype bfloat16] [--adapter-dtype float32] [--autocast bfloat16] [--checkpointing reentrant]

No ledgerspec code: transformers, PEFT and torch do it all. The ground truth for
``tests/derivations/shard/test_fsdp1_mixed_precision.py`` (which documents ``shard --estimate`` and ``measure`` refuse).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import traceback
from pathlib import Path
from typing import Any


def main() -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from transformers import AutoConfig, AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--param-dtype", default="bfloat16")
    ap.add_argument("--adapter-dtype", default="float32")
    ap.add_argument("--autocast", default=None)
    ap.add_argument("--checkpointing", default=None, choices=("reentrant", "non-reentrant"))
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), attn_implementation="sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    model: Any = get_peft_model(base, LoraConfig(r=5, lora_alpha=10, lora_dropout=0.0, target_modules=targets))
    adapter_dtype = getattr(torch, args.adapter_dtype)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    if args.checkpointing:
        model.get_base_model().gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"}
        )
        model.enable_input_require_grads()
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=fsdp_auto_wrap_policy(model),
        use_orig_params=True,
        limit_all_gathers=True,
        mixed_precision=MixedPrecision(param_dtype=getattr(torch, args.param_dtype)),
        device_id=torch.device("cpu"),
    )
    wrapped.train()
    ids = torch.randint(0, 1000, (2, 32))
    autocast = torch.autocast("cpu", dtype=getattr(torch, args.autocast)) if args.autocast else contextlib.nullcontext()
    result: dict[str, object]
    try:
        with autocast:
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        result = {"ok": True}
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        result = {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc),
            "where": f"{frame.filename}:{frame.lineno}",
        }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
