"""DPO's training step as TRL 1.16's ``DPOTrainer`` runs it, micro-step by micro-step (``training.objective: dpo``).

Read in ``trl/trainer/dpo_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named:

1. the batch (``DataCollatorForPreference.torch_call``, :146-200): the chosen rows (prompt + chosen completion) then
   the rejected ones, padded to the longest: ``input_ids``, ``attention_mask`` and ``completion_mask``, int64,
   ``(2 x microbatch, length)``; with precomputed reference log-probs, ``ref_chosen_logps`` and
   ``ref_rejected_logps`` (float32, ``(microbatch,)``). The Trainer fetches the step's micro-batches together, as for
   SFT (:class:`~ledgerspec.derivations.engine.step.TrainerLoop`); no ``labels``, so no ``num_items_in_batch``;
2. ``_compute_loss`` (:1285-1612): the labels (``input_ids`` where the completion mask is set, else -100), the
   policy's forward through TRL's fused LM head (``fused_lm_head=True``; ``add_fused_lm_head`` with the fields
   ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, :955) on the chosen and rejected rows at once, the
   per-sequence log-probs; the reference's: precomputed (read from the batch), or the same PEFT model with its
   adapters off, under ``no_grad`` and with activation checkpointing switched off (:1318-1345); the sigmoid loss
   (``loss_type`` ``["sigmoid"]``, :1387-1388), then the metrics TRL logs (entropy, token counts, the chosen and
   rejected mean logits, the token accuracy, rewards, margins, log-probs: :1535-1597), each a small reduction
   whose value goes to the host;
3. ``training_step``: the loss divided by the accumulation steps (``loss_is_scaled_for_ga = False``, :494; the
   Trainer divides), ``accelerator.backward``, the optimizer step as for SFT.

What a fake tensor cannot do is replaced by what the real one would allocate: the host reads (``.item()``, ``if
total > 0``) are left out (their tensors are made), and the boolean selections of the metrics
(``mean_logits[mask]``) allocate the number of selected positions the synthetic batch has
(:meth:`~ledgerspec.derivations.engine.workload.Workload.preference_batch`).

The fused head is TRL's own on the CPU (``trl.trainer.utils.add_fused_lm_head``, its torch fallback: every position
scored) and its allocation model on a CUDA (Triton) device (:mod:`ledgerspec.derivations.kernels.trl`: the
completion positions gathered and scored).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ledgerspec.derivations.engine.step import TrainerLoop, convert_to_fp32

#: DPOConfig's default ``beta`` (dpo_config.py:297): memory does not depend on it
BETA = 0.1
#: the fields of a separate reference model's fused head: ``add_fused_lm_head``'s default (trainer/utils.py:1552)
REFERENCE_OUTPUTS = ("log_probs",)
_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")  # :1289


class DPOLoop(TrainerLoop):
    """``DPOTrainer``'s step (see the module docstring for the source it follows)."""

    name = "dpo"
    #: the per-token fields of TRL's fused head (None: DPO's, ``kernels.trl.DPO_OUTPUTS``)
    head_outputs: tuple[str, ...] | None = None

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.held: dict[str, Any] = {}
        self.patched = False

    def precompute(self, model: Any, seq: int) -> None:
        """One batch of TRL's precomputation of the reference log-probs (``_precompute_ref_logps`` ->
        ``compute_ref_log_probs``, dpo_trainer.py:1168-1283, TRL 1.16), run in the trainer's ``__init__`` before the
        training step exists: a preference batch of ``seq`` tokens through ``model`` (under DeepSpeed the inference
        engine TRL builds of the policy for it and keeps, :1196-1201) with the adapters off, no grad and the policy's
        checkpointing off, TRL's fused head; the per-sequence log-probs read back to the host, everything freed: what
        it leaves (the engine) is what the run then holds."""
        import torch

        self._patch()
        batch = self.w.preference_batch(seq)
        kwargs = self.w.model_inputs({k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS})
        kwargs["use_cache"] = False  # :1248
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)  # :1249
        with torch.no_grad(), self._no_checkpointing(), self._reference_adapter(), self.autocast():  # :1258-1263
            per_token = model(**kwargs, labels=labels, fused_lm_head=True).log_probs  # :1264
        shift_completion_mask = batch["completion_mask"][..., 1:]
        per_token = per_token[:, -shift_completion_mask.size(1) :]
        chosen, rejected = per_token.sum(dim=1).chunk(2, dim=0)  # :1269, :1283
        _ = (chosen.cpu(), rejected.cpu())  # :1213-1217 (gather_for_metrics of one process: the same tensors)
        del per_token, chosen, rejected, batch, kwargs, labels, shift_completion_mask

    def _patch(self) -> None:
        """TRL's ``__init__`` patches: the fused LM head (the reference model's too) and dropout off."""
        import torch

        if self.patched:
            return
        self.w.fused_lm_head(self.head_outputs)
        reference = self.w.reference
        if reference is not None:  # `add_fused_lm_head(self.ref_model)`: TRL's default fields (:961-962), before
            # prepare_fsdp wraps it (:984-990): an FSDP1 wrapper's module is patched, its forward stays FSDP1's
            self.w.fused_lm_head(REFERENCE_OUTPUTS, getattr(reference, "_fsdp_wrapped_module", reference))
        if self.spec.disable_dropout:  # `disable_dropout_in_model` (trainer/utils.py:194-197), dpo_trainer.py:932
            for model in (self.w.model, reference):  # the reference model's too (:934-935)
                for module in model.modules() if model is not None else ():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0
        self.patched = True

    def start(self, seq: int, micro_steps: int) -> None:
        self._patch()
        super().start(seq, micro_steps)

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """The preference collator's micro-batches; no ``labels``, so no ``num_items_in_batch``."""
        return [self.w.preference_batch(seq) for _ in range(micro_steps)], None

    def forward(self, i: int) -> Any:
        """The policy's forward and the reference's (the step's model calls), up to the reference's outputs."""
        import torch

        batch = self.batches[i]
        kwargs = self.w.model_inputs({k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS})
        kwargs["use_cache"] = False
        completion_mask = batch["completion_mask"]
        shift_completion_mask = completion_mask[..., 1:]
        labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)  # :1296
        outputs = self.call(kwargs, labels=labels, fused_lm_head=True)  # :1297
        seq_len = shift_completion_mask.size(1)
        per_token_logps = outputs.log_probs[:, -seq_len:]
        logps = per_token_logps.sum(dim=1)  # :1302
        del per_token_logps
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)  # :1316
        held = {
            "outputs": outputs,
            "labels": labels,
            "seq_len": seq_len,
            "mask": shift_completion_mask,
            "logps": logps,
            "chosen_logps": chosen_logps,
            "rejected_logps": rejected_logps,
            "batch": batch,
        }
        if self.spec.reference == "precomputed":  # :1318-1319
            held["ref_chosen_logps"], held["ref_rejected_logps"] = (
                batch["ref_chosen_logps"],
                batch["ref_rejected_logps"],
            )
        else:  # :1320-1338: adapters off (or the `ref` copy active, or the reference model), no grad, the policy's
            # checkpointing switched off around it
            with torch.no_grad(), self._no_checkpointing(), self._reference_adapter():
                held["ref_outputs"] = self.call_reference(kwargs, labels=labels, fused_lm_head=True)
        self.held = held
        return None

    def call_reference(self, inputs: dict[str, Any], **extra: Any) -> Any:
        """The reference's model call: the policy's (its adapters switched by :meth:`_reference_adapter`), or the
        separate reference model's: on one device prepared by accelerate as the policy is (``prepare_model(ref_model,
        evaluation_mode=True)``, dpo_trainer.py:990: under mixed precision its forward in the autocast region and its
        outputs converted to fp32, accelerator.py ``prepare_model``); sharded (``reference_autocast`` false) by TRL's
        ``prepare_fsdp``/``prepare_deepspeed``, which wrap no autocast around it."""
        reference = self.w.reference
        if reference is None:
            return self.call(inputs, **extra)
        if not self.w.reference_autocast:  # TRL's prepare_fsdp/prepare_deepspeed wrap no autocast
            return reference(**inputs, **extra)  # around it (trl/models/utils.py 246-342)
        with self.autocast():
            outputs = reference(**inputs, **extra)
        return convert_to_fp32(outputs) if self.spec.autocast_dtype is not None else outputs

    @contextlib.contextmanager
    def _reference_adapter(self) -> Any:
        """TRL's ``use_adapter`` (trainer/utils.py:1415-1451): ``disable_adapter()`` for ``adapter_disabled``, else
        ``set_adapter("ref")`` and back to the previous adapter; nothing for a separate reference model."""
        model = self.w.model
        if self.spec.reference == "model":
            yield
            return
        if self.spec.reference != "adapter_copy":
            with model.disable_adapter():
                yield
            return
        previous = model.active_adapter
        model.set_adapter("ref")
        try:
            yield
        finally:
            model.set_adapter(previous)

    @contextlib.contextmanager
    def _no_checkpointing(self) -> Any:
        """TRL's ``disable_gradient_checkpointing`` (models/utils.py:397-414): off, then on again with the kwargs."""
        import warnings

        if not self.spec.gradient_checkpointing:
            yield
            return
        base = self.w.model.get_base_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            base.gradient_checkpointing_disable()
        try:
            yield
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                base.gradient_checkpointing_enable({"use_reentrant": self.spec.reentrant})

    def loss(self, out: Any, i: int) -> Any:
        """The reference log-probs, the sigmoid loss and TRL's metrics; the outputs go when it returns."""
        import torch.nn.functional as nnf

        h, self.held = self.held, {}
        seq_len, mask = h["seq_len"], h["mask"]
        if "ref_outputs" in h:
            ref_per_token_logps = h["ref_outputs"].log_probs[:, -seq_len:]
            ref_logps = ref_per_token_logps.sum(dim=1)  # :1340
            del ref_per_token_logps
            ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)  # :1346
        else:
            ref_chosen_logps, ref_rejected_logps = h["ref_chosen_logps"], h["ref_rejected_logps"]
        chosen_logratios = h["chosen_logps"] - ref_chosen_logps  # :1349-1350
        rejected_logratios = h["rejected_logps"] - ref_rejected_logps
        delta_score = chosen_logratios - rejected_logratios  # reverse_kl (:1352-1354), :1382
        loss: Any = 0.0
        per_sequence_loss = -nnf.logsigmoid(BETA * delta_score)  # :1387-1388
        loss += per_sequence_loss.mean() * 1.0  # :1528
        del per_sequence_loss, delta_score
        self._metrics(h, mask, chosen_logratios, rejected_logratios)
        del h, ref_chosen_logps, ref_rejected_logps, chosen_logratios, rejected_logratios, mask
        # training_step: `loss / current_gradient_accumulation_steps` (DPO's loss is not scaled for accumulation);
        # the undivided loss goes (the Trainer rebinds it), then accelerate's backward as for SFT
        return loss / self.spec.accumulation

    def _metrics(self, h: dict[str, Any], mask: Any, chosen_logratios: Any, rejected_logratios: Any) -> None:
        """:1535-1597, the tensors each metric makes (``gather_for_metrics`` and ``gather`` return their input on
        one process); the host reads are left out."""
        import torch

        outputs, seq_len = h["outputs"], h["seq_len"]
        per_token_entropy = outputs.entropy[:, -seq_len:].detach()
        entropy_sum = (per_token_entropy * mask).sum()
        total_tokens = mask.sum()
        entropy_sum = entropy_sum.sum()
        total_tokens = total_tokens.sum()
        _ = total_tokens > 0
        _ = entropy_sum / total_tokens
        del per_token_entropy, entropy_sum, total_tokens
        batch_attention = h["batch"].get("attention_mask")
        if batch_attention is not None:  # num_tokens
            _ = batch_attention.sum().sum()
        chosen_mean_logits, rejected_mean_logits = outputs.mean_logits[:, -seq_len:].chunk(2, dim=0)
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        chosen_n, rejected_n = self.w.completion_counts(seq_len + 1)
        sel = chosen_mask.bool()
        total_chosen_logits = torch.empty((chosen_n,), dtype=chosen_mean_logits.dtype, device=sel.device).sum()
        del sel
        total_chosen_tokens = chosen_mask.sum()
        sel = rejected_mask.bool()
        total_rejected_logits = torch.empty((rejected_n,), dtype=rejected_mean_logits.dtype, device=sel.device).sum()
        del sel
        total_rejected_tokens = rejected_mask.sum()
        for t in (total_chosen_logits, total_chosen_tokens, total_rejected_logits, total_rejected_tokens):
            _ = t.sum()
        del total_chosen_logits, total_chosen_tokens, total_rejected_logits, total_rejected_tokens
        chosen_is_top1, _rejected_is_top1 = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)
        correct_predictions = chosen_is_top1 & chosen_mask.bool()
        total_tokens = chosen_mask.sum()
        correct_tokens = correct_predictions.sum()
        del correct_predictions
        total_sum = total_tokens.sum()
        _ = total_sum > 0
        _ = correct_tokens.sum() / total_sum
        del total_tokens, correct_tokens, total_sum
        chosen_rewards = BETA * chosen_logratios.detach()
        rejected_rewards = BETA * rejected_logratios.detach()
        _ = chosen_rewards.mean()
        _ = rejected_rewards.mean()
        reward_accuracies = (chosen_rewards > rejected_rewards).float()
        _ = reward_accuracies.mean()
        margins = chosen_rewards - rejected_rewards
        _ = margins.mean()
        _ = h["chosen_logps"].mean()
        _ = h["rejected_logps"].mean()

    def finish(self) -> None:
        super().finish()
        self.held = {}


__all__ = ["BETA", "REFERENCE_OUTPUTS", "DPOLoop"]
