"""TRL's ``SFTTrainer`` step with its default loss (``software.kernels.cross_entropy: trl_chunked_nll``) where TRL's
fused LM head runs as it is: on the CPU, through TRL's own code.

Read in ``trl/trainer/sft_trainer.py`` (TRL 1.16.0): ``SFTTrainer.__init__`` patches the base model with
``add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1"))`` (:1142-1147); ``compute_loss`` (:1560-1660) calls
``model(**inputs, fused_lm_head=True)`` with ``use_cache=False``, takes ``-log_probs`` as the per-token loss, divides
its sum by ``num_items_in_batch`` (the Trainer's count of label tokens), then computes its metrics (the label count,
the entropy sum, the top-1 count, the batch's token count: reductions whose values go to the host). The batch is
TRL's ``DataCollatorForLanguageModeling`` (:87-230): ``input_ids``, ``labels`` and ``attention_mask``, as
:meth:`~ledgerspec.derivations.engine.workload.Workload.trainer_batch` makes them. The rest is the Trainer's step
(:class:`~ledgerspec.derivations.engine.step.TrainerLoop`).

On a CUDA GPU TRL's head runs Triton kernels that do not run here: the estimate for that target keeps the
allocation model of :mod:`ledgerspec.derivations.kernels.trl` in the model's loss instead.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.engine.step import TrainerLoop
from ledgerspec.derivations.kernels.trl import SFT_OUTPUTS


class TRLSFTLoop(TrainerLoop):
    """``SFTTrainer``'s step through TRL's own fused LM head (see the module docstring)."""

    name = "trl-sft"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.outputs: Any = None
        self.batch: dict[str, Any] = {}
        self.patched = False

    def start(self, seq: int, micro_steps: int) -> None:
        if not self.patched:
            self.w.fused_lm_head(SFT_OUTPUTS)
            self.patched = True
        super().start(seq, micro_steps)

    def forward(self, i: int) -> Any:
        inputs = dict(self.w.model_inputs(self.batches[i]))
        inputs["use_cache"] = False  # :1563
        outputs = self.call(inputs, fused_lm_head=True)  # :1597
        self.outputs, self.batch = outputs, inputs
        return None

    def loss(self, out: Any, i: int) -> Any:
        import torch

        outputs, inputs = self.outputs, self.batch
        self.outputs, self.batch = None, {}
        per_token_loss = -outputs.log_probs  # :1598
        loss = per_token_loss.sum() / torch.as_tensor(self.num_items).clamp(min=1)  # :1601-1602
        del per_token_loss
        # the metrics (:1629-1640): gather_for_metrics returns its input on one process; the host reads are left out
        num_valid = outputs.label_mask.sum().sum()
        entropy_sum = outputs.entropy.detach().sum().sum()
        num_correct = outputs.is_top1.sum().sum()
        _ = num_valid > 0
        _ = entropy_sum / num_valid
        _ = num_valid > 0
        _ = num_correct / num_valid
        del num_valid, entropy_sum, num_correct
        if "attention_mask" in inputs:
            _ = inputs["attention_mask"].sum().sum()
        del outputs, inputs
        return loss

    def finish(self) -> None:
        super().finish()
        self.outputs, self.batch = None, {}


__all__ = ["TRLSFTLoop"]
