"""gpt-oss's MoE forward as transformers 4 ran it in training (4.55.0-4.57.6; the parameters are the same in 5.x).

gpt-oss's experts were 3-D parameters from its first release (4.55.0 ``models/gpt_oss/modeling_gpt_oss.py`` line 69,
``GptOssExperts.gate_up_proj`` experts x hidden x 2·intermediate, with biases; the same shapes in 5.24): bitsandbytes
never quantized them and the frozen base is the same on both stacks. What changed in 5.0.0 is the forward: transformers
5 runs the experts through ``@use_experts_implementation`` (``grouped_mm`` by default) and its router returns the
``tokens x top_k`` weights; 4.55-4.57.6's router scattered them into a dense ``tokens x experts`` tensor
(``GptOssTopKRouter.forward``, 4.57.6 line 157) and the experts looped in Python in training and on the CPU
(``GptOssExperts.forward``, 4.57.6 lines 81-140: one-hot mask, ``expert_hit``, per expert ``torch.where``, the
matrix products with the 3-D slices, ``index_add_``). :func:`swap` gives the installed modules (same parameters)
those forwards. Under fake tensors the tokens each expert receives come from :mod:`.routing`. Imports torch only inside
functions.
"""

from __future__ import annotations

from typing import Any


def _router_forward(self: Any, hidden_states: Any) -> Any:
    """4.57.6 ``GptOssTopKRouter.forward``: dense ``tokens x experts`` routing scores."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
    router_top_value = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
    router_scores = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
    return router_scores, router_indices


def _experts_forward(self: Any, hidden_states: Any, router_indices: Any = None, routing_weights: Any = None) -> Any:
    """4.57.6 ``GptOssExperts.forward``, its training (and CPU) branch."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    num_experts = routing_weights.shape[1]
    tokens = int(hidden_states.shape[0])
    next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
    fake = is_fake(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        hit_mask = torch.greater(expert_mask.sum(dim=(-1, -2)), 0)
        if fake:  # the (n, 1) int64 nonzero: the experts that got tokens, from stack.legacy_moe.routing
            from ledgerspec.derivations.stack.legacy_moe import routing

            counts = routing.counts(self._ledgerspec_layer, tokens, router_indices.shape[1], num_experts)
            hits = [e for e, n in enumerate(counts) if n > 0]
            torch.empty((len(hits), 1), dtype=torch.long, device=hit_mask.device)
        else:
            hits = [int(e) for e in hit_mask.nonzero()[:, 0].tolist() if int(e) != num_experts]
    for expert_idx in hits:
        with torch.no_grad():
            if fake:
                token_idx = torch.empty((counts[expert_idx], 2), dtype=torch.long, device=hit_mask.device)[:, 1]
            else:
                _, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        gated_output = (up + 1) * glu
        out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
        weighted_output = out * routing_weights[token_idx, expert_idx, None]
        next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
    return next_states.view(batch_size, -1, self.hidden_size)


def _mlp_forward(self: Any, hidden_states: Any) -> Any:
    """4.57.6 ``GptOssMLP.forward``."""
    router_scores, router_indices = self.router(hidden_states)
    routed_out = self.experts(hidden_states, router_indices=router_indices, routing_weights=router_scores)
    return routed_out, router_scores


_CLASSES: dict[type, type] = {}


def _v4(cls: type, forward: Any) -> type:
    if cls not in _CLASSES:
        sub = type(cls.__name__, (cls,), {"forward": forward, "_ledgerspec_v4_moe": True})
        sub.__module__, sub.__qualname__ = cls.__module__, cls.__qualname__
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def swap(model: Any) -> int:
    """Each decoder layer's ``mlp`` (the installed ``GptOssMLP``, its router and experts: the same parameters) runs
    4.57.6's forwards. Returns the number of blocks changed."""
    from ledgerspec.derivations.stack.build import decoder_layers

    found = decoder_layers(model)
    swapped = 0
    for layer_idx, layer in enumerate(list(found[1]) if found else []):
        mlp = layer._modules.get("mlp")
        if mlp is None or type(mlp).__name__ != "GptOssMLP" or getattr(mlp, "_ledgerspec_v4_moe", False):
            continue
        mlp.__class__ = _v4(type(mlp), _mlp_forward)
        mlp.router.__class__ = _v4(type(mlp.router), _router_forward)
        mlp.experts.__class__ = _v4(type(mlp.experts), _experts_forward)
        mlp.experts._ledgerspec_layer = layer_idx
        swapped += 1
    return swapped


__all__ = ["swap"]
