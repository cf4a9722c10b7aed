"""Mixtral's MoE block as transformers 4 built and ran it (4.36 to 4.57.6; fused into ``MixtralExperts`` in 5.0.0).

The modules are those of transformers 4.48.1, ``src/transformers/models/mixtral/modeling_mixtral.py`` lines 67-111
(https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/models/mixtral/modeling_mixtral.py#L67-L151):
``MixtralBlockSparseTop2MLP`` (``w1``, ``w3``: hidden -> intermediate, ``w2``: intermediate -> hidden, ``nn.Linear``
without bias) and ``MixtralSparseMoeBlock`` (the router ``gate``, an ``nn.Linear`` hidden -> experts, the experts in
an ``nn.ModuleList``), its forward :func:`..loop.experts_forward` (lines 112-151, renormalised top-2). The block sat
at ``MixtralDecoderLayer.block_sparse_moe`` (transformers 5 calls it ``mlp``). It returns its output only
(transformers 5's decoder layer takes one tensor; 4.48.1 returned ``(output, router_logits)`` and the layer dropped
the logits unless ``output_router_logits``, false in Mixtral's configs). Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[str, Any] = {}


def classes() -> tuple[Any, Any]:
    """``(MixtralBlockSparseTop2MLP, MixtralSparseMoeBlock)`` of transformers 4.48.1 (built once)."""
    if _CLASSES:
        return _CLASSES["mlp"], _CLASSES["block"]
    import torch
    from torch import nn
    from transformers.activations import ACT2FN

    from ledgerspec.derivations.stack.legacy_moe.loop import experts_forward

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

        def forward(self, hidden_states: Any) -> Any:
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            if self.training and self.jitter_noise > 0:
                hidden_states *= torch.empty_like(hidden_states).uniform_(
                    1.0 - self.jitter_noise, 1.0 + self.jitter_noise
                )
            hidden_states = hidden_states.view(-1, hidden_dim)
            final_hidden_states = experts_forward(self, hidden_states, normalise=True)
            return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)

    _CLASSES.update(mlp=MixtralBlockSparseTop2MLP, block=MixtralSparseMoeBlock)
    return MixtralBlockSparseTop2MLP, MixtralSparseMoeBlock


def swap(model: Any) -> int:
    """Each decoder layer's ``mlp`` (transformers 5's fused block) becomes 4.48.1's ``block_sparse_moe``."""
    from ledgerspec.derivations.stack.legacy_moe.loop import swap_blocks

    _, block = classes()
    return swap_blocks(model, "MixtralSparseMoeBlock", block, rename="block_sparse_moe")


__all__ = ["classes", "swap"]
