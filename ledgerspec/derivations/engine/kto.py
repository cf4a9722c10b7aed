"""KTO's training step as TRL 1.16's ``KTOTrainer`` runs it, micro-step by micro-step (``training.objective: kto``).

Read in ``trl/trainer/kto_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named:

1. the batch (``DataCollatorForUnpairedPreference.torch_call``, :161-206): ``microbatch`` unpaired rows (prompt +
   completion, padded on the right) with their ``label`` (desirable or not) and the KL rows, the same prompts with the
   previous row's completion (rotated within the batch, :1140-1157): ``input_ids``, ``attention_mask``,
   ``completion_mask`` and their ``KL_`` twins, int64; ``label``, bool; with precomputed reference log-probs
   ``ref_logps`` and ``ref_KL_logps`` (float32) (:meth:`~ledgerspec.derivations.engine.workload.Workload.kto_batch`);
2. ``_compute_loss`` (:1370-1563): the policy's log-probs of the KL rows without grad, through TRL's fused LM head
   (``_compute_kl_logps``, :1337-1368; checkpointing stays on), the policy's forward of the rows through the head
   (fields ``log_probs``, ``entropy``, ``mean_logits``, :967-970), the per-row log-probs split by label
   (``nonzero``, ``index_select``, :1410-1415); the reference's, without grad and with checkpointing switched off:
   precomputed (read from the batch), or the same PEFT model with its adapters off (or its ``ref`` copy active), the
   KL rows then the rows (:1417-1440); the KL estimate (:1442-1446), the KTO loss of the desirable and undesirable rows
   (``loss_type: kto``, TRL's default, :1448-1482), the metrics TRL logs (:1484-1546), the mean loss (:1548);
3. ``training_step``: the loss divided by the accumulation steps (``loss_is_scaled_for_ga = False``, :550), backward,
   the optimizer step as for SFT.

What a fake tensor cannot do is replaced by what the real one would allocate, as in
:mod:`ledgerspec.derivations.engine.preference`: the host reads (``.item()``, ``if total > 0``) are left out (their
tensors are made), and the value-dependent selections (``nonzero`` of the labels, ``mean_logits[mask]``) allocate the
number of elements the synthetic batch selects (:meth:`~ledgerspec.derivations.engine.workload.Workload.kto_rows`).
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.engine.preference import DPOLoop

#: KTOConfig's defaults (kto_config.py): ``beta`` 0.1, both weights 1.0; memory does not depend on them
BETA = 0.1
_KL_NON_MODEL = {"input_ids", "attention_mask", "completion_mask", "KL_completion_mask", "label", "ref_logps"}
_NON_MODEL = {
    "completion_mask",
    "KL_input_ids",
    "KL_attention_mask",
    "KL_completion_mask",
    "label",
    "ref_logps",
    "ref_KL_logps",
}


class KTOLoop(DPOLoop):
    """``KTOTrainer``'s step (see the module docstring for the source it follows); the reference adapter and the
    switched-off checkpointing are DPO's (TRL's ``use_adapter`` and ``disable_gradient_checkpointing``)."""

    name = "kto"
    head_outputs = ("log_probs", "entropy", "mean_logits")  # :967-970

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """The unpaired collator's micro-batches; no ``labels``, so no ``num_items_in_batch``."""
        return [self.w.kto_batch(seq) for _ in range(micro_steps)], None

    def precompute(self, model: Any, seq: int) -> None:
        """One batch of KTO's precomputation of the reference log-probs (``_precompute_ref_logps`` ->
        ``compute_ref_log_probs``, :1220-1346), run in the trainer's ``__init__``: the rows' and then the KL rows'
        forwards through ``model`` (under DeepSpeed the inference engine TRL builds of the policy and keeps,
        :1248-1252) with the adapters off, no grad, the policy's checkpointing off and TRL's fused head, the first
        one's log-probs held across the second; the summed log-probs read back to the host, everything freed."""
        import torch

        self._patch()
        batch = self.w.kto_batch(seq)
        rows = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        kl_rows = {"input_ids": batch["KL_input_ids"], "attention_mask": batch["KL_attention_mask"]}
        with torch.no_grad(), self._no_checkpointing(), self._reference_adapter(), self.autocast():  # :1310-1315
            labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
            per_token = model(**self.w.model_inputs(rows), labels=labels, fused_lm_head=True).log_probs
            kl_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
            kl_per_token = model(**self.w.model_inputs(kl_rows), labels=kl_labels, fused_lm_head=True).log_probs
        completion = per_token[:, -(batch["input_ids"].size(1) - 1) :].sum(-1)  # :1335
        kl = kl_per_token[:, -(batch["KL_input_ids"].size(1) - 1) :].sum(-1)
        _ = (completion.cpu(), kl.cpu())  # :1263-1268
        del per_token, kl_per_token, completion, kl, labels, kl_labels, batch, rows, kl_rows

    def _kl_logps(self, batch: dict[str, Any], reference: bool = False) -> Any:
        """``_compute_kl_logps`` (:1337-1368): the KL rows' summed log-probs; its labels and outputs go with it."""
        kwargs = {k: v for k, v in batch.items() if k not in _KL_NON_MODEL | {"ref_KL_logps"}}
        kwargs["input_ids"] = kwargs.pop("KL_input_ids")
        kwargs["attention_mask"] = kwargs.pop("KL_attention_mask")
        kwargs["use_cache"] = False
        kl_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
        import torch

        with torch.no_grad():
            call = self.call_reference if reference else self.call
            kl_per_token_logps = call(self.w.model_inputs(kwargs), labels=kl_labels, fused_lm_head=True).log_probs
        return kl_per_token_logps[:, -(kl_labels.size(1) - 1) :].sum(-1)

    def forward(self, i: int) -> Any:
        """``_compute_loss`` up to its last model call (the reference's forward of the rows)."""
        import torch

        batch = self.batches[i]
        labels = batch["label"]
        num_chosen = labels.sum().to(self.w.device)  # :1376-1377
        num_rejected = (len(labels) - num_chosen).to(self.w.device)
        kl_logps = self._kl_logps(batch)  # :1379
        model_kwargs = {k: v for k, v in batch.items() if k not in _NON_MODEL}
        model_kwargs["use_cache"] = False
        completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)  # :1396
        outputs = self.call(self.w.model_inputs(model_kwargs), labels=completion_labels, fused_lm_head=True)
        seq_len = batch["input_ids"].size(1) - 1
        per_token_logps = outputs.log_probs[:, -seq_len:]
        completion_logps = per_token_logps.sum(-1)  # :1401
        del per_token_logps
        bool_labels = torch.as_tensor(labels, dtype=torch.bool, device=completion_logps.device)  # :1410
        chosen_idx, rejected_idx = self._label_indices(bool_labels)  # :1411-1412
        chosen_logps = completion_logps.index_select(0, chosen_idx)
        rejected_logps = completion_logps.index_select(0, rejected_idx)
        h: dict[str, Any] = {  # what `_compute_loss` holds from here on
            "batch": batch,
            "num_chosen": num_chosen,
            "num_rejected": num_rejected,
            "kl_logps": kl_logps,
            "labels": completion_labels,
            "outputs": outputs,
            "seq_len": seq_len,
            "completion_logps": completion_logps,
            "chosen_idx": chosen_idx,
            "rejected_idx": rejected_idx,
            "chosen_logps": chosen_logps,
            "rejected_logps": rejected_logps,
        }
        if self.spec.reference == "precomputed":  # :1417-1423
            h["ref_chosen_logps"] = batch["ref_logps"].index_select(0, chosen_idx)
            h["ref_rejected_logps"] = batch["ref_logps"].index_select(0, rejected_idx)
            h["ref_kl_logps"] = batch["ref_KL_logps"]
        else:  # :1424-1433: no grad, checkpointing off, the adapters off (or the `ref` copy active)
            with torch.no_grad(), self._no_checkpointing(), self._reference_adapter():
                h["ref_kl_logps"] = self._kl_logps(batch, reference=True)
                h["ref_outputs"] = self.call_reference(
                    self.w.model_inputs(model_kwargs), labels=completion_labels, fused_lm_head=True
                )
        self.held = h
        return None

    def _label_indices(self, bool_labels: Any) -> tuple[Any, Any]:
        """``torch.nonzero(bool_labels).view(-1)`` and of its negation; on fake tensors (whose count a fake tensor
        cannot know) index tensors of the synthetic batch's counts (:meth:`Workload.kto_chosen`)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(bool_labels):
            return (
                torch.nonzero(bool_labels, as_tuple=False).view(-1),
                torch.nonzero(~bool_labels, as_tuple=False).view(-1),
            )
        chosen = self.w.kto_chosen()  # at least one row of each kind: the step needs two rows or more
        rejected = int(bool_labels.shape[0]) - chosen
        chosen_idx = torch.empty((chosen, 1), dtype=torch.long, device=bool_labels.device).view(-1)
        negated = ~bool_labels
        rejected_idx = torch.empty((rejected, 1), dtype=torch.long, device=negated.device).view(-1)
        del negated
        return chosen_idx, rejected_idx

    def loss(self, out: Any, i: int) -> Any:
        """The reference log-probs, the KL estimate, the KTO loss and TRL's metrics; the outputs go on return."""
        import torch
        import torch.nn.functional as nnf

        h, self.held = self.held, {}
        seq_len = h["seq_len"]
        chosen_idx, rejected_idx = h["chosen_idx"], h["rejected_idx"]
        if "ref_outputs" in h:  # :1437-1440
            ref_per_token_logps = h["ref_outputs"].log_probs[:, -seq_len:]
            ref_completion_logps = ref_per_token_logps.sum(-1)
            del ref_per_token_logps
            h["ref_chosen_logps"] = ref_completion_logps.index_select(0, chosen_idx)
            h["ref_rejected_logps"] = ref_completion_logps.index_select(0, rejected_idx)
            h["ref_completion_logps"] = ref_completion_logps
            del ref_completion_logps
        chosen_logps, rejected_logps = h["chosen_logps"], h["rejected_logps"]
        ref_chosen_logps, ref_rejected_logps = h["ref_chosen_logps"], h["ref_rejected_logps"]
        kl = (h["kl_logps"] - h["ref_kl_logps"]).mean().detach()  # :1442-1444
        kl = kl.mean().clamp(min=0)
        device = chosen_logps.device
        if chosen_logps.shape[0] != 0 or ref_chosen_logps.shape[0] != 0:  # :1448-1465
            chosen_logratios = chosen_logps - ref_chosen_logps
            chosen_losses = 1 - nnf.sigmoid(BETA * (chosen_logratios - kl))
            chosen_rewards = BETA * chosen_logratios.detach()
            del chosen_logratios
        else:
            chosen_losses = torch.Tensor([]).to(device)
            chosen_rewards = torch.Tensor([]).to(device)
        if rejected_logps.shape[0] != 0 or ref_rejected_logps.shape[0] != 0:  # :1466-1478
            rejected_logratios = rejected_logps - ref_rejected_logps
            rejected_losses = 1 - nnf.sigmoid(BETA * (kl - rejected_logratios))
            rejected_rewards = BETA * rejected_logratios.detach()
            del rejected_logratios
        else:
            rejected_losses = torch.Tensor([]).to(device)
            rejected_rewards = torch.Tensor([]).to(device)
        losses = torch.cat((1.0 * chosen_losses, 1.0 * rejected_losses), 0)  # :1479-1482
        del chosen_losses, rejected_losses
        self._kto_metrics(h, chosen_rewards, rejected_rewards)
        loss = losses.nanmean()  # :1548
        del losses, chosen_rewards, rejected_rewards, kl, h, chosen_logps, rejected_logps
        del ref_chosen_logps, ref_rejected_logps, chosen_idx, rejected_idx
        # training_step: `loss / current_gradient_accumulation_steps` (KTO's loss is not scaled for accumulation)
        return loss / self.spec.accumulation

    def _kto_metrics(self, h: dict[str, Any], chosen_rewards: Any, rejected_rewards: Any) -> None:
        """:1484-1546, the tensors each metric makes (``gather_for_metrics`` returns its input on one process); the
        host reads are left out."""
        batch, outputs, seq_len = h["batch"], h["outputs"], h["seq_len"]
        per_token_entropy = outputs.entropy[:, -seq_len:].detach()  # :1486-1496
        mask = batch["completion_mask"][:, 1:]
        entropy_sum = (per_token_entropy * mask).sum()
        total_tokens = mask.sum()
        entropy_sum = entropy_sum.sum()
        total_tokens = total_tokens.sum()
        _ = total_tokens > 0
        _ = entropy_sum / total_tokens
        del per_token_entropy, entropy_sum, total_tokens, mask
        batch["attention_mask"].sum().sum()  # :1499-1501
        shift_completion_mask = batch["completion_mask"][:, 1:]  # :1504-1522
        mean_logits = outputs.mean_logits[:, -seq_len:]
        chosen_mean_logits = mean_logits.index_select(0, h["chosen_idx"])
        rejected_mean_logits = mean_logits.index_select(0, h["rejected_idx"])
        chosen_mask = shift_completion_mask.index_select(0, h["chosen_idx"])
        rejected_mask = shift_completion_mask.index_select(0, h["rejected_idx"])
        chosen_n, rejected_n = self._completion_counts(seq_len + 1)
        total_chosen_logits = self._selected(chosen_mean_logits, chosen_mask, chosen_n).sum()
        total_chosen_tokens = chosen_mask.sum()
        total_rejected_logits = self._selected(rejected_mean_logits, rejected_mask, rejected_n).sum()
        total_rejected_tokens = rejected_mask.sum()
        for t in (total_chosen_logits, total_chosen_tokens, total_rejected_logits, total_rejected_tokens):
            t.sum()
        del total_chosen_logits, total_chosen_tokens, total_rejected_logits, total_rejected_tokens
        del chosen_mean_logits, rejected_mean_logits, chosen_mask, rejected_mask, mean_logits, shift_completion_mask
        h["num_chosen"].sum()  # :1524-1525
        h["num_rejected"].sum()
        if h["chosen_logps"].shape[0] > 0:  # :1527-1533 (all_num_chosen > 0)
            chosen_rewards.nansum().nansum()
            h["chosen_logps"].nansum().nansum()
        if h["rejected_logps"].shape[0] > 0:  # :1535-1541
            rejected_rewards.nansum().nansum()
            h["rejected_logps"].nansum().nansum()

    def _completion_counts(self, width: int) -> tuple[int, int]:
        """The completion positions of the desirable and of the undesirable rows of a synthetic micro-batch."""
        completions, _, _ = self.w.kto_rows(width)
        chosen = self.w.kto_chosen()
        return sum(completions[:chosen]), sum(completions[chosen:])

    @staticmethod
    def _selected(values: Any, mask: Any, count: int) -> Any:
        """``values[mask.bool()]``: on fake tensors a tensor of the synthetic batch's ``count`` elements."""
        import torch
        from torch._subclasses.fake_tensor import is_fake

        sel = mask.bool()
        if not is_fake(sel):
            return values[sel]
        return torch.empty((count,), dtype=values.dtype, device=sel.device)


__all__ = ["KTOLoop"]
