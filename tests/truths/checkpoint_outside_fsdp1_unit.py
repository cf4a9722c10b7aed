"""Ground truth for the known difference ``transformers-checkpoint-outside-fsdp-unit`` (issue 16), with real tensors.

    python tests/truths/checkpoint_outside_fsdp1_unit.py outside|inside

One process, gloo with world size 1, FSDP1 (``use_orig_params=True``) over frozen blocks, each its own unit, and a
trainable input projection in the root (so each block's input requires grad, as the embedding's output does under
PEFT with ``enable_input_require_grads``). The blocks are checkpointed (``use_reentrant=True``) either as transformers
4.48.1's loop did, ``checkpoint(unit.__call__, h)`` (outside), or inside the unit as ``GradientCheckpointingLayer``
does from 4.52.0 (inside). Prints one JSON line: how many hidden-state-sized storages are alive when the
first block is recomputed (the last block backward reaches), the most alive at once during backward, and the bytes
of one.
Written by hand from the two transformers versions' structure; it uses nothing of ledgerspec.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from typing import Any

import torch
from torch import nn


def main(where: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.utils.checkpoint import checkpoint

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    hidden, layers, tokens = 64, 6, 256
    x = torch.randn(tokens, hidden)
    one = tokens * hidden * 4
    live: dict[int, int] = {}
    state = {"backward": False, "max": 0, "at_first": -1}

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
            self.inside = where == "inside"
            self.first = False

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if self.inside and torch.is_grad_enabled():
                return checkpoint(self._body, h, use_reentrant=True)
            return self._body(h)

        def _body(self, h: torch.Tensor) -> torch.Tensor:
            if self.first and state["backward"] and torch.is_grad_enabled():  # the recompute of the last block backward
                state["at_first"] = sum(1 for n in live.values() if n == one)
            return h + self.down(torch.relu(self.up(h)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(hidden, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            for block in self.blocks:
                h = checkpoint(block.__call__, h, use_reentrant=True) if where == "outside" else block(h)
            return h

    net = Net()
    first = net.blocks[0]
    assert isinstance(first, Block)
    first.first = True
    for block in net.blocks:
        block.requires_grad_(False)
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))

    from torch.utils._python_dispatch import TorchDispatchMode

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in live:
                    s = t.untyped_storage()
                    live[s._cdata] = s.nbytes()
                    weakref.finalize(s, live.pop, s._cdata, None)
            if state["backward"]:
                state["max"] = max(state["max"], sum(1 for n in live.values() if n == one))
            return out

    with Track():
        loss = model(x).float().pow(2).mean()
        state["backward"] = True
        loss.backward()
    alive = sum(1 for n in live.values() if n == one)
    print(
        json.dumps(
            {
                "where": where,
                "max_in_backward": state["max"],
                "at_first_block": state["at_first"],
                "after": alive,
                "bytes": one,
                "layers": layers,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
