"""CPO's training step as TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` runs it, at ``CPOConfig``'s defaults
(``training.objective: cpo``: ``loss_type: sigmoid``, ``cpo_alpha: 1.0``, ``alpha: 0.0``).

Read in ``trl/experimental/cpo/cpo_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named. The
step is ORPO's (:mod:`ledgerspec.derivations.engine.orpo`: the same collator and ``concatenated_inputs``, one forward
to the full logits, TRL's own ``get_batch_logps``) with CPO's differences:

- ``concatenated_forward`` (:792-863): the NLL term's labels are ``concatenated_labels`` (-100 on the prompt), its
  cross-entropy (``cpo_alpha != 0``) on a contiguous copy of the chosen rows' shifted logits; the rows' summed
  log-probs (``average_log_prob`` only for ``ipo``/``simpo``); the chosen and rejected logits (views of all
  positions);
- ``get_batch_loss_metrics`` (:865-917): TRL's own ``cpo_loss`` (:678-750, on this step as its ``self``),
  ``losses.mean() + cpo_alpha * nll``, each metric's value sent to the host as it is made;
- ``compute_loss`` (:919-938) returns the loss; the Trainer divides it by the accumulation steps.

On a bitsandbytes 4-bit base CPOTrainer prepares, wraps and casts the model as ORPOTrainer does (:210-255: PEFT's
``prepare_model_for_kbit_training``, float32 adapters, ``peft_module_casting_to_bf16`` with ``bf16``) and runs
``get_batch_loss_metrics`` in ``autocast(self.accelerator.device.type)`` (:926-931), as ORPO's step models it.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.engine.orpo import ORPOLoop

#: CPOConfig's defaults (cpo_config.py): memory depends on cpo_alpha only through its NLL term (on at 1.0)
CPO_ALPHA = 1.0


def _cpo_trainer() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOTrainer
    return CPOTrainer


class CPOLoop(ORPOLoop):
    """``CPOTrainer``'s step (see the module docstring for the source it follows)."""

    name = "cpo"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        # what cpo_loss reads of its trainer (CPOConfig's defaults, cpo_config.py)
        self.alpha = 0.0
        self.loss_type = "sigmoid"
        self.label_smoothing = 0.0
        self.simpo_gamma = 0.5
        self.cpo_alpha = CPO_ALPHA

    def _after_forward(self, h: dict[str, Any]) -> tuple[Any, ...]:
        """``concatenated_forward`` after the model call (:825-863); its locals go when it returns."""
        from torch import nn

        concatenated, len_chosen = h["concatenated"], h["len_chosen"]
        all_logits = h["outputs"].logits
        h.clear()

        def cross_entropy_loss(logits: Any, labels: Any) -> Any:  # :826-838
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
            loss_fct = nn.CrossEntropyLoss()
            logits = logits.view(-1, logits.shape[-1])
            labels = labels.view(-1)
            labels = labels.to(logits.device)
            return loss_fct(logits, labels)

        labels = concatenated["concatenated_labels"].clone()  # :840
        nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])  # :842-845 (cpo_alpha 1.0)
        all_logps = _cpo_trainer().get_batch_logps(  # :847-852
            all_logits,
            concatenated["concatenated_labels"],
            average_log_prob=self.loss_type in ["ipo", "simpo"],
            is_encoder_decoder=False,
        )
        chosen_logps = all_logps[:len_chosen]
        rejected_logps = all_logps[len_chosen:]
        chosen_logits = all_logits[:len_chosen]
        rejected_logits = all_logits[len_chosen:]
        return chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss

    def loss(self, out: Any, i: int) -> Any:
        """``get_batch_loss_metrics`` (:865-917) and ``compute_loss`` (:919-938)."""
        h, self.held = self.held, {}
        forward_output = self._after_forward(h)
        del h
        chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss = forward_output
        del forward_output
        losses, chosen_rewards, rejected_rewards = _cpo_trainer().cpo_loss(self, chosen_logps, rejected_logps)
        loss = losses.mean() + self.cpo_alpha * nll_loss  # :890
        reward_accuracies = (chosen_rewards > rejected_rewards).float()
        # :891-911: each metric made and sent to the host at once (gather_for_metrics returns its input)
        chosen_rewards.mean()
        rejected_rewards.mean()
        reward_accuracies.mean()
        (chosen_rewards - rejected_rewards).mean()
        rejected_logps.detach().mean()
        chosen_logps.detach().mean()
        rejected_logits.detach().mean().mean()
        chosen_logits.detach().mean().mean()
        nll_loss.detach().mean()
        del losses, chosen_rewards, rejected_rewards, reward_accuracies
        del chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss
        self.region.close()  # compute_loss's autocast ends (:926-931)
        # training_step: `loss / current_gradient_accumulation_steps`
        return loss / self.spec.accumulation


__all__ = ["CPOLoop"]
