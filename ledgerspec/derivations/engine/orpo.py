"""ORPO's training step as TRL 1.16's ``trl.experimental.orpo.ORPOTrainer`` runs it, micro-step by micro-step
(``training.objective: orpo``).

Read in ``trl/experimental/orpo/orpo_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named.
TRL's own code runs where it can be called apart: ``concatenated_inputs`` (a static method, :605-668),
``get_batch_logps`` (static, :704-743) and ``odds_ratio_loss`` (:670-702, on this step as its ``self``):

1. the batch (``experimental.utils.DPODataCollatorWithPadding`` over ``tokenize_row``'s rows, :458-603): the
   chosen rows (prompt + chosen completion) ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels`` (-100 on
   the prompt), the rejected rows' three, and the prompts' ``prompt_input_ids`` and ``prompt_attention_mask``, int64,
   each padded to its own longest (:meth:`~ledgerspec.derivations.engine.workload.Workload.orpo_batch`); no reference;
2. ``concatenated_forward`` (:745-822): the chosen and rejected rows concatenated (``concatenated_inputs``), **one
   forward of the model to its full logits** (TRL's fused head is not used: the logits are held, converted to fp32
   under mixed precision by accelerate), then the chosen rows' cross-entropy over prompt and completion (``logits[...,
   :-1, :].contiguous()``, ``nn.CrossEntropyLoss``), the average log-probs of every row (``get_batch_logps``:
   ``selective_log_softmax``) and the chosen and rejected logits (views);
3. ``get_batch_loss_metrics`` (:824-877): the odds-ratio loss, ``nll - losses.mean()``, the metrics TRL logs (reduced
   0-d tensors, held in a dict until their values go to the host), then ``compute_loss`` (:879-901) and the Trainer's
   division by the accumulation steps (no ``loss_is_scaled_for_ga``: the Trainer divides when the loss was not
   normalised by ``num_items_in_batch``; none is passed).

The forward phase is the model's call; the logits' processing after it is the loss's, as the real run's phases are.

On a bitsandbytes 4-bit base the trainer is handed (with its ``peft_config``, :220-265) TRL calls PEFT's
``prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)`` (:220-232: the ledger's
``base_model.prepare_for_kbit_training``), wraps it with ``get_peft_model`` at PEFT's default
``autocast_adapter_dtype=True`` (float32 adapters, :243-261), and with ``bf16`` casts modules with
``peft_module_casting_to_bf16`` (:262-265, ``experimental/utils.py:950-957``: norms to float32, ``lm_head`` and
``embed_tokens`` weights that are float32 to bfloat16; the ledger's ``base_model.module_dtypes``). It then runs
``get_batch_loss_metrics``, the forward included, in ``autocast(self.accelerator.device.type)`` (:886-891): the device's
default autocast dtype (bfloat16 on the CPU, float16 on CUDA) around accelerate's own bf16 region, which stays the
innermost around the model call. Its one effect on memory: the autocast cache of the float32 adapters' lower-precision
copies lives until the outermost region ends, after the loss, not at the model call's end
(:attr:`~ledgerspec.derivations.engine.workload.WorkloadSpec.loss_autocast`; the loss's own ops see float32 logits).
The truths cannot tell it apart: a few cast adapter copies held through the loss stay below the backward's peak
(leaving the region out passes them too); the casts and the preparation they do see.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ledgerspec.derivations.engine.autocast import autocast_region
from ledgerspec.derivations.engine.step import TrainerLoop

#: ORPOConfig's default ``beta`` (orpo_config.py:90); memory does not depend on it
BETA = 0.1
PAD = 0  # any id: the padding value allocates the same


def _orpo_trainer() -> Any:
    """``trl.experimental.orpo.ORPOTrainer`` (its import warns that the experimental API may change: the truths say
    when it does)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.orpo import ORPOTrainer
    return ORPOTrainer


class _Device:
    def __init__(self, device: Any) -> None:
        self.device = device


class ORPOLoop(TrainerLoop):
    """``ORPOTrainer``'s step (see the module docstring for the source it follows)."""

    name = "orpo"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.held: dict[str, Any] = {}
        self.patched = False
        self.beta = BETA  # odds_ratio_loss reads self.beta and self.accelerator.device
        self.accelerator: Any = None
        self.region = contextlib.ExitStack()  # TRL's autocast of compute_loss (quantized base, bf16)

    def start(self, seq: int, micro_steps: int) -> None:
        import torch

        if not self.patched:
            if self.spec.disable_dropout:  # `disable_dropout_in_model`, orpo_trainer.py:338-340
                for module in self.w.model.modules():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0
            self.accelerator = _Device(self.w.device)
            self.patched = True
        super().start(seq, micro_steps)

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """The collator's micro-batches; ``chosen_labels``, not ``labels``: no ``num_items_in_batch``."""
        return [self.w.orpo_batch(seq) for _ in range(micro_steps)], None

    def loss_region(self) -> Any:
        """``compute_loss``'s ``autocast(self.accelerator.device.type)`` when ``_peft_has_been_casted_to_bf16``
        (:886-891), else nothing: torch's default autocast dtype of the device TRL runs on (the estimate's target;
        on the CPU's fake tensors it casts as the emulated CUDA autocast does)."""
        if not self.spec.loss_autocast:
            return contextlib.nullcontext()
        import torch

        trl_device = getattr(self.w, "target", None) or self.w.device_type
        dtype = str(torch.get_autocast_dtype(trl_device)).removeprefix("torch.")
        return autocast_region(dtype, "cpu" if self.w.device_type == "cpu" else "cuda")

    def forward(self, i: int) -> Any:
        """``concatenated_forward`` (:745-777) up to the model's outputs (TRL's autocast of ``compute_loss`` entered
        first: it ends in :meth:`loss`)."""
        self.region.enter_context(self.loss_region())
        batch = self.batches[i]
        concatenated = _orpo_trainer().concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=PAD, device=self.w.device
        )
        inputs = {
            "input_ids": concatenated["concatenated_input_ids"],
            "attention_mask": concatenated["concatenated_attention_mask"],
        }
        outputs = self.call({**self.w.model_inputs(inputs), "use_cache": False})
        self.held = {"concatenated": concatenated, "outputs": outputs, "len_chosen": batch["chosen_labels"].shape[0]}
        return None

    def loss(self, out: Any, i: int) -> Any:
        """The rest of ``concatenated_forward`` (:777-822), ``get_batch_loss_metrics`` and ``compute_loss``."""
        h, self.held = self.held, {}
        forward_output = self._after_forward(h)
        del h
        chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss = forward_output
        del forward_output
        losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = _orpo_trainer().odds_ratio_loss(
            self, chosen_logps, rejected_logps
        )  # :834-836
        loss = nll_loss - losses.mean()  # :838
        reward_accuracies = (chosen_rewards > rejected_rewards).float()
        metrics = {  # :841-861: gather_for_metrics returns its input on one process
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": reward_accuracies.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/rejected": rejected_logps.detach().mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logits/rejected": rejected_logits.detach().mean().mean(),
            "logits/chosen": chosen_logits.detach().mean().mean(),
            "nll_loss": nll_loss.detach().mean(),
            "log_odds_ratio": log_odds_ratio.detach().mean(),
            "log_odds_chosen": log_odds_chosen.detach().mean(),
        }
        for k in list(metrics):  # :864-865: each value to the host, one at a time
            metrics[k] = 0.0
        del metrics, losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen, reward_accuracies
        del chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss
        self.region.close()  # compute_loss's autocast ends (:891): its cache of cast adapters goes
        loss = loss.to(self.w.device)  # compute_loss, :894
        # training_step: `loss / current_gradient_accumulation_steps` (the loss was not normalised by item counts)
        return loss / self.spec.accumulation

    def _after_forward(self, h: dict[str, Any]) -> tuple[Any, ...]:
        """``concatenated_forward`` after the model call (:777-822); its locals go when it returns."""
        import torch
        from torch import nn

        concatenated, len_chosen = h["concatenated"], h["len_chosen"]
        all_logits = h["outputs"].logits
        h.clear()

        def cross_entropy_loss(logits: Any, labels: Any) -> Any:  # :779-791
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
            loss_fct = nn.CrossEntropyLoss()
            logits = logits.view(-1, logits.shape[-1])
            labels = labels.view(-1)
            labels = labels.to(logits.device)
            return loss_fct(logits, labels)

        labels = concatenated["concatenated_input_ids"].clone()  # :796-798
        attention_mask = concatenated["concatenated_attention_mask"]
        labels = torch.where(attention_mask == 1, labels, -100)
        chosen_nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])  # :800
        all_logps = _orpo_trainer().get_batch_logps(  # :802-807
            all_logits, concatenated["concatenated_labels"], average_log_prob=True, is_encoder_decoder=False
        )
        chosen_logps = all_logps[:len_chosen]
        rejected_logps = all_logps[len_chosen:]
        chosen_logits = all_logits[:len_chosen, :-1, :]
        rejected_logits = all_logits[len_chosen:, :-1, :]
        return chosen_logps, rejected_logps, chosen_logits, rejected_logits, chosen_nll_loss

    def finish(self) -> None:
        super().finish()
        self.region.close()
        self.held = {}


__all__ = ["ORPOLoop"]
