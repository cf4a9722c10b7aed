"""RLOO's training step as TRL 1.16's ``RLOOTrainer`` runs it with transformers' ``generate`` or vLLM (GRPO's weight
sync, no importance-sampling correction), micro-step by micro-step (``training.objective: rloo``).

The generation, its buffering and the training forward are GRPO's (:mod:`ledgerspec.derivations.engine.grpo`: the
two trainers share ``_prepare_inputs``, ``_generate_single_turn`` and ``_get_per_token_logps_and_entropies``). What
differs, read in ``trl/trainer/rloo_trainer.py`` (TRL 1.16.0; every line cited below is of that file):

1. the generation phase (``_generate_and_score_completions``, :1458-1787): the old policy's per-token log-probs are
   always computed (without grad and checkpointing, in chunks of ``microbatch`` rows, :1579-1587) and summed per
   sequence (``old_logps``, held with the batch); the reference's with ``beta > 0`` (RLOOConfig's default ``beta``
   is 0.05, rloo_config.py:502: the same PEFT model with its adapters off, :1589-1609); the KL of each sequence is
   taken from the rewards (:1625-1629); the advantages are the rewards less the leave-one-out mean of the other
   completions of the prompt (:1631-1650); no ``num_items_in_batch``;
2. the training forward (``_compute_loss``, :1794-1863): prompt + completion through the fused LM head (``log_probs``
   and ``entropy``), the sequence log-probs, the clipped sequence-level ratio loss (its mean), TRL's metrics; the loss
   is not scaled for accumulation (``loss_is_scaled_for_ga = False``, :219): the Trainer divides it.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.engine.grpo import EPSILON, GRPOLoop


class RLOOLoop(GRPOLoop):
    """``RLOOTrainer``'s step (see the module docstring for the source it follows)."""

    name = "rloo"

    @property
    def importance_sampling(self) -> bool:
        """RLOO takes no log-probs from vLLM (rloo_trainer.py:1306-1313: ignored): no correction."""
        return False

    def _generate_and_score(self) -> dict[str, Any]:
        """``_generate_and_score_completions`` (:1458-1787) for text prompts, one reward function."""
        import torch

        rows, completion, g = self._rows(), int(self.spec.completion), self.generations
        prompt_ids, prompt_mask, completion_ids, completion_mask = self._generated_tensors()
        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        ref_per_token_logps = None
        with torch.no_grad(), self._no_checkpointing():  # :1578
            old_per_token_logps, _ = self._logps(prompt_completion_ids, attention_mask, completion, False)
            old_logps = (old_per_token_logps * completion_mask).sum(1)  # :1586
            if self.beta != 0.0:  # :1589-1609
                with self._reference_adapter():
                    ref_per_token_logps, _ = self._logps(prompt_completion_ids, attention_mask, completion, False)
        del prompt_completion_ids, attention_mask
        advantages = self._rloo_advantages(rows, g, old_per_token_logps, ref_per_token_logps, completion_mask)
        del old_per_token_logps, ref_per_token_logps
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "old_logps": old_logps,
            "advantages": advantages,
        }

    def _rloo_advantages(self, rows: int, g: int, old: Any, ref: Any, completion_mask: Any) -> Any:
        """The rewards with the KL term and the leave-one-out advantages, with TRL's metrics (:1612-1700)."""
        import torch
        from trl.trainer.utils import nanstd

        device = self.w.device
        rewards_per_func = self._rewards_per_func(rows)
        weights = torch.ones(1, dtype=torch.float32, device=device)  # self.reward_weights, made at __init__
        unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)  # :1616
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        self._select_none(rewards)  # rewards[unscorable_mask] = nan: no row is unscorable
        per_token_kl = None
        if self.beta != 0.0:  # :1625-1629
            per_token_kl = old - ref
            kl = (per_token_kl * completion_mask).sum(-1)
            rewards = rewards - self.beta * kl
            del kl
        grouped_rewards = rewards.view(-1, g)  # :1631
        _mean_grouped_rewards = torch.nanmean(grouped_rewards, dim=1)
        std_rewards = nanstd(grouped_rewards, dim=1)
        scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
        grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        baselines = baselines.view(-1)
        advantages = rewards - baselines
        del baselines, grouped_sum, scorable_counts, grouped_rewards, _mean_grouped_rewards
        advantages = torch.nan_to_num(advantages, nan=0.0)  # :1654
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
        all_process_advantages = advantages.clone()  # :1663
        advantages = advantages[slice(0, rows)]
        if per_token_kl is not None:  # :1666-1670, `accelerator.reduce` clones on one process
            kl_stats = torch.stack([(per_token_kl * completion_mask).sum(), completion_mask.sum().float()]).clone()
            _ = kl_stats[0] / kl_stats[1].clamp(min=1.0)
            del kl_stats
        _ = torch.nanmean(rewards_per_func[:, 0])  # :1672-1677, read on the host
        _ = nanstd(rewards_per_func[:, 0])
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        self._select_none(rewards)
        _ = torch.nanmean(rewards)
        _ = nanstd(rewards)
        _ = is_std_zero.float().mean()
        del rewards, std_rewards, is_std_zero, all_process_advantages, unscorable_mask, weights, rewards_per_func
        return advantages

    def loss(self, out: Any, i: int) -> Any:
        """RLOO's loss and metrics (:1822-1862); the Trainer divides the loss by the accumulation steps."""
        import torch

        h, self.held = self.held, {}
        inputs, per_token_logps, entropies = h["inputs"], h["per_token_logps"], h["entropies"]
        completion_mask = inputs["completion_mask"]
        logps = (per_token_logps * completion_mask).sum(1)  # :1822
        log_ratio = logps - inputs["old_logps"]
        advantages = inputs["advantages"]
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
        per_sequence_loss1 = coef_1 * advantages
        per_sequence_loss2 = coef_2 * advantages
        per_sequence_loss = -torch.min(per_sequence_loss1, per_sequence_loss2)
        del per_sequence_loss1, per_sequence_loss2
        loss = per_sequence_loss.mean()  # :1832
        del per_sequence_loss
        entropy_stats = torch.stack([(entropies * completion_mask).sum(), completion_mask.sum().float()]).clone()
        _ = entropy_stats[0] / entropy_stats[1].clamp(min=1.0)  # :1841-1844
        del entropy_stats
        is_low_clipped = (coef_1 < 1 - EPSILON) & (advantages < 0)  # :1847-1862
        is_high_clipped = (coef_1 > 1 + EPSILON) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        gathered_low_clip = is_low_clipped.float()
        _ = gathered_low_clip.nanmean()
        self._nan_reduce(gathered_low_clip)
        gathered_high_clip = is_high_clipped.float()
        _ = gathered_high_clip.nanmean()
        self._nan_reduce(gathered_high_clip)
        gathered_clip_ratio = is_region_clipped.float()
        _ = gathered_clip_ratio.nanmean()
        del h, inputs, per_token_logps, entropies, coef_1, coef_2, log_ratio, logps, advantages, completion_mask
        del is_low_clipped, is_high_clipped, is_region_clipped, gathered_low_clip, gathered_high_clip
        del gathered_clip_ratio
        # training_step: `loss / current_gradient_accumulation_steps` (loss_is_scaled_for_ga = False)
        return loss / self.spec.accumulation


__all__ = ["RLOOLoop"]
