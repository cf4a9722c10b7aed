"""DeepSeek-V3's and DeepSeek-V2's MoE blocks as transformers 4 built and ran them (DeepSeek-V3 4.51-4.57.6,
DeepSeek-V2 4.52-4.57.6; fused into ``DeepseekV3Experts``/``DeepseekV2Experts`` in 5.0.0).

transformers 4.57.6 ``src/transformers/models/deepseek_v3/modeling_deepseek_v3.py`` lines 109-207
(https://github.com/huggingface/transformers/blob/v4.57.6/src/transformers/models/deepseek_v3/modeling_deepseek_v3.py#L109-L207):
``DeepseekV3TopkRouter`` (a ``weight`` parameter experts x hidden, no ``nn.Linear``, so bitsandbytes leaves it in the
loaded dtype: 5.x keeps it in float32, ``_keep_in_fp32_modules_strict``; and the ``e_score_correction_bias`` buffer,
loaded dtype too), ``DeepseekV3MoE`` (the routed experts an ``nn.ModuleList`` of ``DeepseekV3MLP`` of
``moe_intermediate_size``, ``nn.Linear`` ``gate_proj``/``up_proj``/``down_proj`` that bitsandbytes quantizes; the
shared experts one ``DeepseekV3MLP`` of ``moe_intermediate_size x n_shared_experts``) and its loop ``moe``: the output
accumulates in the routing weights' dtype (``torch.zeros_like(hidden_states, dtype=topk_weights.dtype)``), each
expert's tokens by ``torch.where`` of its one-hot mask, skipped when it has none, ``index_add_`` without a cast.

``src/transformers/models/deepseek_v2/modeling_deepseek_v2.py`` lines 45-157 of 4.57.6
(https://github.com/huggingface/transformers/blob/v4.57.6/src/transformers/models/deepseek_v2/modeling_deepseek_v2.py#L45-L157):
``DeepseekV2MoEGate`` (a ``weight`` parameter, softmax scores, greedy or group-limited top-k) and ``DeepseekV2MoE``,
whose loop is DeepSeek's own: the tokens sorted by expert (``argsort`` of the chosen experts, one gathered copy of
``tokens x top_k`` rows), each expert run on its slice, the outputs concatenated, scattered back, weighted in the
routing weights' dtype and summed over ``top_k``.

Both blocks stay at ``mlp``; the first ``first_k_dense_replace`` layers are dense and not touched. The MLP class is the
installed one (the same modules and forward). Under fake tensors the tokens each expert receives come from
:mod:`.routing`. Imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[str, Any] = {}


def _fake_counts(block: Any, tensor: Any, tokens: int) -> list[int] | None:
    """The tokens each expert receives in this call when ``tensor`` is fake (:mod:`.routing`), None when real."""
    from torch._subclasses.fake_tensor import is_fake

    if not is_fake(tensor):
        return None
    from ledgerspec.derivations.stack.legacy_moe import routing

    return routing.counts(block.layer, tokens, block.top_k, block.num_experts)


def v3_block() -> Any:
    """transformers 4.57.6's ``DeepseekV3MoE`` (built once)."""
    if "v3" in _CLASSES:
        return _CLASSES["v3"]
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    class DeepseekV3TopkRouter(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.top_k = config.num_experts_per_tok
            self.n_routed_experts = config.n_routed_experts
            self.routed_scaling_factor = config.routed_scaling_factor
            self.n_group = config.n_group
            self.topk_group = config.topk_group
            self.norm_topk_prob = config.norm_topk_prob
            self.weight = nn.Parameter(torch.empty((self.n_routed_experts, config.hidden_size)))
            self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

        @torch.no_grad()
        def get_topk_indices(self, scores: Any) -> Any:
            scores_for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)  # type: ignore[operator]
            group_scores = (
                scores_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
                .topk(2, dim=-1)[0]
                .sum(dim=-1)
            )
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(-1, self.n_routed_experts)
            )
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
            return torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]

        def forward(self, hidden_states: Any) -> Any:
            hidden_states = hidden_states.view(-1, self.config.hidden_size)
            router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
            scores = router_logits.sigmoid()
            topk_indices = self.get_topk_indices(scores)
            topk_weights = scores.gather(1, topk_indices)
            if self.norm_topk_prob:
                denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
                topk_weights /= denominator
            topk_weights = topk_weights * self.routed_scaling_factor
            return topk_indices, topk_weights

    class DeepseekV3MoE(nn.Module):
        def __init__(self, config: Any, layer: int = 0) -> None:
            super().__init__()
            self.config = config
            self.experts = nn.ModuleList(
                [
                    DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
                    for _ in range(config.n_routed_experts)
                ]
            )
            self.gate = DeepseekV3TopkRouter(config)
            self.shared_experts = DeepseekV3MLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
            )
            self.layer, self.top_k, self.num_experts = layer, config.num_experts_per_tok, config.n_routed_experts

        def moe(self, hidden_states: Any, topk_indices: Any, topk_weights: Any) -> Any:
            final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
            expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts))
            expert_mask = expert_mask.permute(2, 0, 1)
            fake = _fake_counts(self, expert_mask, int(hidden_states.shape[0]))
            for expert_idx in range(len(self.experts)):
                expert = self.experts[expert_idx]
                mask = expert_mask[expert_idx]
                if fake is None:
                    token_indices, weight_indices = torch.where(mask)
                else:  # the (n, 2) int64 nonzero of torch.where, n from stack.legacy_moe.routing
                    token_indices, weight_indices = torch.empty(
                        (fake[expert_idx], 2), dtype=torch.long, device=mask.device
                    ).unbind(1)
                if token_indices.numel() > 0:
                    expert_weights = topk_weights[token_indices, weight_indices]
                    expert_input = hidden_states[token_indices]
                    expert_output = expert(expert_input)
                    weighted_output = expert_output * expert_weights.unsqueeze(-1)
                    final_hidden_states.index_add_(0, token_indices, weighted_output)
            return final_hidden_states.type(hidden_states.dtype)

        def forward(self, hidden_states: Any) -> Any:
            residuals = hidden_states
            orig_shape = hidden_states.shape
            topk_indices, topk_weights = self.gate(hidden_states)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
            hidden_states = hidden_states + self.shared_experts(residuals)
            return hidden_states

    _CLASSES["v3"] = DeepseekV3MoE
    return DeepseekV3MoE


def v2_block() -> Any:
    """transformers 4.57.6's ``DeepseekV2MoE`` (built once)."""
    if "v2" in _CLASSES:
        return _CLASSES["v2"]
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

    class DeepseekV2MoEGate(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.top_k = config.num_experts_per_tok
            self.num_experts = config.n_routed_experts
            self.routed_scaling_factor = config.routed_scaling_factor
            self.topk_method = config.topk_method
            self.num_group = config.n_group
            self.topk_group = config.topk_group
            self.norm_topk_prob = config.norm_topk_prob
            self.gating_dim = config.hidden_size
            self.weight = nn.Parameter(torch.empty((self.num_experts, self.gating_dim)))

        def forward(self, hidden_states: Any) -> Any:
            batch_size, seq_len, hidden_dim = hidden_states.shape
            hidden_states = hidden_states.view(-1, hidden_dim)
            logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.topk_method == "greedy":
                topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            elif self.topk_method == "group_limited_greedy":
                group_scores = scores.view(batch_size * seq_len, self.num_group, -1).max(dim=-1).values
                group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores)
                group_mask.scatter_(1, group_idx, 1)
                score_mask = (
                    group_mask.unsqueeze(-1)
                    .expand(batch_size * seq_len, self.num_group, self.num_experts // self.num_group)
                    .reshape(batch_size * seq_len, -1)
                )
                tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
                topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
            topk_weight = topk_weight * self.routed_scaling_factor
            return topk_idx, topk_weight

    class DeepseekV2MoE(nn.Module):
        def __init__(self, config: Any, layer: int = 0) -> None:
            super().__init__()
            self.config = config
            self.num_experts_per_tok = config.num_experts_per_tok
            self.experts = nn.ModuleList(
                [
                    (DeepseekV2MLP(config, intermediate_size=config.moe_intermediate_size))
                    for _ in range(config.n_routed_experts)
                ]
            )
            self.gate = DeepseekV2MoEGate(config)
            if config.n_shared_experts is not None:
                intermediate_size = config.moe_intermediate_size * config.n_shared_experts
                self.shared_experts = DeepseekV2MLP(config=config, intermediate_size=intermediate_size)
            self.ep_rank = 0
            self.experts_per_rank = config.n_routed_experts
            self.layer, self.top_k, self.num_experts = layer, config.num_experts_per_tok, config.n_routed_experts

        def moe(self, hidden_states: Any, topk_ids: Any, topk_weight: Any) -> Any:
            cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
            cnts.scatter_(1, topk_ids, 1)
            tokens_per_expert = cnts.sum(dim=0)
            indices = topk_ids.view(-1).argsort()
            sorted_tokens = hidden_states[indices // topk_ids.shape[1]]
            fake = _fake_counts(self, tokens_per_expert, int(topk_ids.shape[0]))
            outputs = []
            start_idx: Any = 0
            start = 0  # under fake tensors: the slice bounds as ints
            for i, num_tokens in enumerate(tokens_per_expert if fake is None else fake):
                if num_tokens == 0:
                    continue
                if fake is None:
                    end_idx = start_idx + num_tokens
                    tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
                else:  # 4.57.6's end_idx is a 0-d int64 tensor (start_idx + a 0-d element of tokens_per_expert)
                    end_idx = torch.empty((), dtype=torch.long, device=sorted_tokens.device)
                    tokens_for_this_expert = sorted_tokens[start : start + num_tokens]
                    start += num_tokens
                expert = self.experts[i + self.ep_rank * self.experts_per_rank]
                expert_out = expert(tokens_for_this_expert)
                outputs.append(expert_out)
                start_idx = end_idx
            outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
            new_x = torch.empty_like(outs)
            new_x[indices] = outs
            return (
                new_x.view(*topk_ids.shape, -1)
                .type(topk_weight.dtype)
                .mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1)
                .type(new_x.dtype)
            )

        def forward(self, hidden_states: Any) -> Any:
            residuals = hidden_states
            orig_shape = hidden_states.shape
            topk_indices, topk_weights = self.gate(hidden_states)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
            hidden_states = hidden_states + self.shared_experts(residuals)
            return hidden_states

    _CLASSES["v2"] = DeepseekV2MoE
    return DeepseekV2MoE


def swap_v3(model: Any) -> int:
    """Each MoE layer's ``mlp`` (transformers 5's ``DeepseekV3MoE`` with fused experts) becomes 4.57.6's."""
    from ledgerspec.derivations.stack.legacy_moe.loop import swap_blocks

    return swap_blocks(model, "DeepseekV3MoE", v3_block())


def swap_v2(model: Any) -> int:
    """Each MoE layer's ``mlp`` (transformers 5's ``DeepseekV2Moe``) becomes 4.57.6's ``DeepseekV2MoE``."""
    from ledgerspec.derivations.stack.legacy_moe.loop import swap_blocks

    return swap_blocks(model, "DeepseekV2Moe", v2_block())


__all__ = ["swap_v2", "swap_v3", "v2_block", "v3_block"]
