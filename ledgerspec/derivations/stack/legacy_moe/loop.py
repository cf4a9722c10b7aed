"""transformers 4's sparse MoE forward, shared by its families (Mixtral, Qwen2-MoE, Qwen3-MoE): route with the router
``gate`` (an ``nn.Linear``), softmax in float32, top-k, optionally renormalise, cast back; then loop over the experts,
gather each one's tokens, run it, scale by its routing weight and ``index_add_`` into the output.

transformers 4.48.1 ``models/mixtral/modeling_mixtral.py`` lines 112-151 (``MixtralSparseMoeBlock.forward``) and
``models/qwen2_moe/modeling_qwen2_moe.py`` lines 619-662 (``Qwen2MoeSparseMoeBlock.forward``: the same, with
``norm_topk_prob`` and the shared expert added after the loop); Qwen3-MoE (4.51-4.57) is Qwen2-MoE's without the
shared expert. 4.5x iterates only over the experts that got tokens (``expert_hit``: ``expert_mask.sum(...)`` and
its ``nonzero``, two index tensors of at most ``experts`` int64 each, not modelled); an expert without tokens
allocates nothing in 4.48.1's loop, so the experts' tensors are the same.

Under fake tensors ``torch.where(expert_mask[expert_idx])`` (a ``nonzero``: one ``(n, 2)`` int64 tensor whose columns
are ``idx`` and ``top_x``) takes ``n`` from :mod:`.routing`. Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any


def where(block: Any, row: Any, expert_idx: int, tokens: int) -> Any:
    """``torch.where(row)``; on a fake tensor, the ``(n, 2)`` int64 ``nonzero`` of :mod:`.routing`'s count, unbound."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if not is_fake(row):
        return torch.where(row)
    from ledgerspec.derivations.stack.legacy_moe import routing

    n = routing.counts(block.layer, tokens, block.top_k, block.num_experts)[expert_idx]
    return torch.empty((n, 2), dtype=torch.long, device=row.device).unbind(1)


def experts_forward(block: Any, hidden_states: Any, normalise: bool) -> Any:
    """The routed experts' output of ``hidden_states`` (tokens x hidden), as transformers 4.48.1 computes it."""
    import torch
    import torch.nn.functional as F

    tokens, hidden_dim = hidden_states.shape
    router_logits = block.gate(hidden_states)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, block.top_k, dim=-1)
    if normalise:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    final_hidden_states = torch.zeros((tokens, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
    expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=block.num_experts).permute(2, 1, 0)
    for expert_idx in range(block.num_experts):
        expert_layer = block.experts[expert_idx]
        idx, top_x = where(block, expert_mask[expert_idx], expert_idx, int(tokens))
        current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
        current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
        final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
    return final_hidden_states


def swap_blocks(model: Any, fused_name: str, build: Any, attribute: str = "mlp", rename: str | None = None) -> int:
    """Replace each decoder layer's ``attribute`` whose class is named ``fused_name`` by ``build(text_config,
    layer_idx)``, built on the device and in the dtype of the block it replaces; ``rename``: the name transformers 4
    gave the block (the layer's ``attribute`` then reads it). Returns the number of blocks swapped."""
    import torch

    from ledgerspec.derivations.stack.build import decoder_layers
    from ledgerspec.derivations.stack.legacy_moe import BLOCK_MARK

    text = getattr(model.config, "text_config", None) or model.config
    found = decoder_layers(model)
    swapped = 0
    for layer_idx, layer in enumerate(list(found[1]) if found else []):
        fused = layer._modules.get(attribute)
        if fused is None or type(fused).__name__ != fused_name:
            continue
        if isinstance(getattr(fused, "experts", None), torch.nn.ModuleList):  # transformers 4's already
            continue
        p = next(fused.parameters())
        with torch.device(p.device):
            block = build(text, layer_idx).to(p.dtype)
        setattr(block, BLOCK_MARK, True)
        if rename:
            del layer._modules[attribute]
            layer._modules[rename] = block
            layer.__class__ = _reading_class(type(layer), attribute, rename)
        else:
            layer._modules[attribute] = block
        swapped += 1
    return swapped


_CLASSES: dict[tuple[type, str, str], type] = {}


def _reading_class(cls: type, attribute: str, rename: str) -> type:
    """The installed decoder layer's class (same name and module, for FSDP's wrap policy and checkpointing), whose
    ``attribute`` reads the ``rename`` submodule."""
    if getattr(cls, "_ledgerspec_v4_moe", False):
        return cls
    key = (cls, attribute, rename)
    if key not in _CLASSES:
        sub = type(
            cls.__name__,
            (cls,),
            {attribute: property(lambda self: getattr(self, rename)), "_ledgerspec_v4_moe": True},
        )
        sub.__module__ = cls.__module__
        sub.__qualname__ = cls.__qualname__
        _CLASSES[key] = sub
    return _CLASSES[key]


__all__ = ["experts_forward", "swap_blocks", "where"]
