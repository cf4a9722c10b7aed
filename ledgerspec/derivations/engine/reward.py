"""A reward model's training step as TRL 1.16's ``RewardTrainer`` runs it, micro-step by micro-step
(``training.objective: reward``).

Read in ``trl/trainer/reward_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named:

1. the model (built in :mod:`ledgerspec.derivations.stack.build`): ``AutoModelForSequenceClassification`` with
   ``num_labels=1`` (:396-398), the score head ``score`` (``nn.Linear(hidden, 1, bias=False)``, transformers'
   ``GenericForSequenceClassification``) in place of the LM head, the config's pad token id set (:563-572); the LoRA
   of a ``SEQ_CLS`` PEFT config, which makes ``score`` a ``modules_to_save`` (a trainable copy); a quantized base's
   trainable parameters cast to bfloat16 (:549-554); dropout off when ``disable_dropout`` (:556-558, default true,
   reward_config.py:128);
2. the batch (``DataCollatorForPreference.torch_call``, :203-229): the chosen rows, then the rejected ones, padded
   on the right to the longest: ``input_ids`` and ``attention_mask``, int64, ``(2 x microbatch, length)``; the
   Trainer fetches a step's micro-batches together (:class:`~ledgerspec.derivations.engine.step.TrainerLoop`); no
   ``labels``, so no ``num_items_in_batch``;
3. ``compute_loss`` (:778-817): the model on the batch with ``use_cache=False`` (one forward: the score of every
   position, then each row's score at its last non-pad token, transformers' code), the scores split into chosen and
   rejected, ``-logsigmoid(chosen - rejected).mean()``, plus ``center_rewards_coefficient * mean((chosen +
   rejected) ** 2)`` when the coefficient is set, then the metrics TRL logs (the tokens of the batch, the min, mean
   and max reward, the accuracy and the margin), each a small reduction whose value goes to the host; the outputs go
   when it returns;
4. ``training_step``: the loss divided by the accumulation steps (``loss_is_scaled_for_ga = False``, :330),
   ``accelerator.backward``, the optimizer step as for SFT (``training_step`` only adds TRL's activation offloading
   context, :820-822).

The host reads (``.item()``) are left out: each reduction is made and dropped at once, as TRL's ``.item()`` leaves
it (as in :mod:`ledgerspec.derivations.engine.preference`).
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.engine.step import TrainerLoop


class RewardLoop(TrainerLoop):
    """``RewardTrainer``'s step (see the module docstring for the source it follows)."""

    name = "reward"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.outputs: Any = None
        self.patched = False

    def start(self, seq: int, micro_steps: int) -> None:
        import torch

        if not self.patched:
            if self.spec.disable_dropout:  # `disable_dropout_in_model` (trainer/utils.py:194-197), :556-558
                for module in self.w.model.modules():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0
            self.patched = True
        super().start(seq, micro_steps)

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """The preference collator's micro-batches; no ``labels``, so no ``num_items_in_batch``."""
        return [self.w.reward_batch(seq) for _ in range(micro_steps)], None

    def forward(self, i: int) -> Any:
        """``compute_loss`` up to the model's outputs (:781-783): the one model call of a micro-step."""
        inputs = self.w.model_inputs(self.batches[i])
        self.outputs = self.call({**inputs, "use_cache": False})
        return None

    def loss(self, out: Any, i: int) -> Any:
        """The pairwise loss and TRL's metrics (:785-815); the outputs go when ``compute_loss`` returns, then the
        Trainer divides the loss by the accumulation steps."""
        import torch
        import torch.nn.functional as nnf

        outputs, self.outputs = self.outputs, None
        batch = self.batches[i]
        rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)  # :786
        loss = -nnf.logsigmoid(rewards_chosen - rewards_rejected).mean()  # :792 (no `margin` column)
        if self.spec.center_rewards is not None:  # :794-795
            loss += self.spec.center_rewards * torch.mean((rewards_chosen + rewards_rejected) ** 2)
        # :798: gather_for_metrics returns its input on one process; `.sum().item()`
        batch["attention_mask"].sum().sum()
        with torch.no_grad():  # :803-815
            all_rewards = outputs.logits  # accelerator.gather: its input on one process
            all_rewards.min()
            all_rewards.mean()
            all_rewards.max()
            del all_rewards
            mean_accuracy = (rewards_chosen > rewards_rejected).float().mean()
            mean_accuracy.mean()
            del mean_accuracy
            mean_margin = (rewards_chosen - rewards_rejected).mean()
            mean_margin.mean()
            del mean_margin
        del outputs, rewards_chosen, rewards_rejected, batch
        # training_step: `loss / current_gradient_accumulation_steps` (the reward loss is not scaled for accumulation)
        return loss / self.spec.accumulation

    def finish(self) -> None:
        super().finish()
        self.outputs = None


__all__ = ["RewardLoop"]
