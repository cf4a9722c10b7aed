"""Qwen2-MoE's and Qwen3-MoE's MoE blocks as transformers 4 built and ran them (Qwen2-MoE 4.40-4.57.6, Qwen3-MoE
4.51-4.57.6; fused into ``Qwen2MoeExperts``/``Qwen3MoeExperts`` with a ``TopKRouter`` in 5.0.0).

transformers 4.48.1 ``src/transformers/models/qwen2_moe/modeling_qwen2_moe.py`` lines 603-617
(https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/models/qwen2_moe/modeling_qwen2_moe.py#L603-L662):
the router ``gate`` (``nn.Linear`` hidden -> experts), the experts an ``nn.ModuleList`` of ``Qwen2MoeMLP``
(``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear`` of ``moe_intermediate_size``; the installed class, unchanged),
the shared expert (``Qwen2MoeMLP`` of ``shared_expert_intermediate_size``) and its sigmoid gate, added after the loop
(lines 656-659); Qwen3-MoE's block (4.57.6 ``models/qwen3_moe/modeling_qwen3_moe.py``, ``Qwen3MoeSparseMoeBlock``)
is the same without the shared expert. The forward is :func:`..loop.experts_forward` (top-k renormalised when
``norm_topk_prob``). The block stays at ``mlp``; dense layers (``mlp_only_layers``, ``decoder_sparse_step``) are not
touched. Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[str, Any] = {}


def block_class(shared: bool) -> Any:
    """transformers 4's ``Qwen2MoeSparseMoeBlock`` (``shared``) or ``Qwen3MoeSparseMoeBlock``."""
    key = "qwen2" if shared else "qwen3"
    if key in _CLASSES:
        return _CLASSES[key]
    import torch.nn.functional as F
    from torch import nn

    from ledgerspec.derivations.stack.legacy_moe.loop import experts_forward

    ExpertMLP: Any
    if shared:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP

        ExpertMLP = Qwen2MoeMLP
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

        ExpertMLP = Qwen3MoeMLP

    class SparseMoeBlock(nn.Module):
        def __init__(self, config: Any, layer: int = 0) -> None:
            super().__init__()
            self.num_experts = config.num_experts
            self.top_k = config.num_experts_per_tok
            self.norm_topk_prob = config.norm_topk_prob
            self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
            self.experts = nn.ModuleList(
                [ExpertMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(self.num_experts)]
            )
            if shared:
                self.shared_expert = ExpertMLP(config, intermediate_size=config.shared_expert_intermediate_size)
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            self.layer = layer

        def forward(self, hidden_states: Any) -> Any:
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            hidden_states = hidden_states.view(-1, hidden_dim)
            final_hidden_states = experts_forward(self, hidden_states, normalise=bool(self.norm_topk_prob))
            if shared:
                shared_expert_output = self.shared_expert(hidden_states)
                shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
                final_hidden_states = final_hidden_states + shared_expert_output
            return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)

    SparseMoeBlock.__name__ = SparseMoeBlock.__qualname__ = (
        "Qwen2MoeSparseMoeBlock" if shared else "Qwen3MoeSparseMoeBlock"
    )
    _CLASSES[key] = SparseMoeBlock
    return SparseMoeBlock


def swap_qwen2(model: Any) -> int:
    from ledgerspec.derivations.stack.legacy_moe.loop import swap_blocks

    return swap_blocks(model, "Qwen2MoeSparseMoeBlock", block_class(shared=True))


def swap_qwen3(model: Any) -> int:
    from ledgerspec.derivations.stack.legacy_moe.loop import swap_blocks

    return swap_blocks(model, "Qwen3MoeSparseMoeBlock", block_class(shared=False))


__all__ = ["block_class", "swap_qwen2", "swap_qwen3"]
