"""Mixtral's MoE block as transformers 4 built and ran it (4.36 to 4.57.6; fused into ``MixtralExperts`` in 5.0.0).

The modules and the forward are those of transformers 4.48.1, ``src/transformers/models/mixtral/modeling_mixtral.py``
lines 67-151 (https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/models/mixtral/modeling_mixtral.py#L67-L151):
``MixtralBlockSparseTop2MLP`` (``w1``, ``w3``: hidden -> intermediate, ``w2``: intermediate -> hidden, ``nn.Linear``
without bias) and ``MixtralSparseMoeBlock`` (the router ``gate``, an ``nn.Linear`` hidden -> experts, and the loop
``for expert_idx in range(self.num_experts)`` that gathers each expert's tokens, runs the expert, scales by the
routing weight and ``index_add_``s into the output). The block sat at ``MixtralDecoderLayer.block_sparse_moe``
(transformers 5 calls it ``mlp``). 4.5x loops only over the experts that got tokens (``expert_hit``, 4.57.6 lines
124-126): an expert without tokens allocates nothing in 4.48.1's loop either, so the tensors are the same.

Under fake tensors, ``torch.where(expert_mask[expert_idx])`` (a ``nonzero``: one ``(n, 2)`` int64 tensor of which
``idx`` and ``top_x`` are the columns) takes ``n`` from :mod:`.routing`. The block returns its output only (transformers
5's decoder layer takes one tensor; 4.48.1 returned ``(output, router_logits)`` and the layer dropped the logits unless
``output_router_logits``, false in Mixtral's configs). Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[str, Any] = {}


def classes() -> tuple[Any, Any]:
    """``(MixtralBlockSparseTop2MLP, MixtralSparseMoeBlock)`` of transformers 4.48.1 (built once)."""
    if _CLASSES:
        return _CLASSES["mlp"], _CLASSES["block"]
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers.activations import ACT2FN

    from ledgerspec.derivations.stack.legacy_moe import routing

    class MixtralBlockSparseTop2MLP(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.ffn_dim = config.intermediate_size
            self.hidden_dim = config.hidden_size
            self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
            self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
            self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states: Any) -> Any:
            current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
            current_hidden_states = self.w2(current_hidden_states)
            return current_hidden_states

    class MixtralSparseMoeBlock(nn.Module):
        def __init__(self, config: Any, layer: int = 0) -> None:
            super().__init__()
            self.hidden_dim = config.hidden_size
            self.ffn_dim = config.intermediate_size
            self.num_experts = config.num_local_experts
            self.top_k = config.num_experts_per_tok
            self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
            self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(config) for _ in range(self.num_experts)])
            self.jitter_noise = config.router_jitter_noise
            self.layer = layer

        def _where(self, row: Any, expert_idx: int, tokens: int) -> Any:
            from torch._subclasses.fake_tensor import is_fake

            if not is_fake(row):
                return torch.where(row)
            n = routing.counts(self.layer, tokens, self.top_k, self.num_experts)[expert_idx]
            nz = torch.empty((n, 2), dtype=torch.long, device=row.device)
            return nz.unbind(1)

        def forward(self, hidden_states: Any) -> Any:
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            if self.training and self.jitter_noise > 0:
                hidden_states *= torch.empty_like(hidden_states).uniform_(
                    1.0 - self.jitter_noise, 1.0 + self.jitter_noise
                )
            hidden_states = hidden_states.view(-1, hidden_dim)
            router_logits = self.gate(hidden_states)
            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
            routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
            routing_weights = routing_weights.to(hidden_states.dtype)
            final_hidden_states = torch.zeros(
                (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
            )
            expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
            tokens = batch_size * sequence_length
            for expert_idx in range(self.num_experts):
                expert_layer = self.experts[expert_idx]
                idx, top_x = self._where(expert_mask[expert_idx], expert_idx, tokens)
                current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
                current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
                final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
            final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
            return final_hidden_states

    _CLASSES.update(mlp=MixtralBlockSparseTop2MLP, block=MixtralSparseMoeBlock)
    return MixtralBlockSparseTop2MLP, MixtralSparseMoeBlock


def swap(model: Any) -> int:
    """Each decoder layer's ``mlp`` (transformers 5's fused block) becomes 4.48.1's ``block_sparse_moe``, built on the
    device and in the dtype of the block it replaces. Returns the number of blocks swapped."""
    import torch

    _, block_cls = classes()
    text = getattr(model.config, "text_config", None) or model.config
    swapped = 0
    for layer_idx, layer in enumerate(_layers(model)):
        fused = getattr(layer, "_modules", {}).get("mlp")
        if fused is None or type(fused).__name__ != "MixtralSparseMoeBlock":
            continue
        p = next(fused.parameters())
        with torch.device(p.device):
            block = block_cls(text, layer_idx).to(p.dtype)
        del layer._modules["mlp"]
        layer._modules["block_sparse_moe"] = block
        layer.__class__ = _renamed_layer_class(type(layer))
        swapped += 1
    return swapped


def _layers(model: Any) -> list[Any]:
    from ledgerspec.derivations.stack.build import decoder_layers

    found = decoder_layers(model)
    return list(found[1]) if found else []


_LAYER_CLASSES: dict[type, type] = {}


def _renamed_layer_class(cls: type) -> type:
    """The installed decoder layer's class (same name, for FSDP's wrap policy and checkpointing), whose ``mlp`` is
    the ``block_sparse_moe`` submodule, so that its forward calls 4.48.1's block."""
    if cls in _LAYER_CLASSES or getattr(cls, "_ledgerspec_v4_moe", False):
        return _LAYER_CLASSES.get(cls, cls)
    sub = type(cls.__name__, (cls,), {"mlp": property(lambda self: self.block_sparse_moe), "_ledgerspec_v4_moe": True})
    sub.__module__ = cls.__module__
    sub.__qualname__ = cls.__qualname__
    _LAYER_CLASSES[cls] = sub
    return sub


__all__ = ["classes", "swap"]
