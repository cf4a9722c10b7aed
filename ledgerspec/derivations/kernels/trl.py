"""TRL's fused LM head (``trl_chunked_nll``): the loss ``SFTTrainer`` computes by default, as a CUDA GPU runs it.

TRL 1.16's ``SFTTrainer`` patches the model with ``add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1"))``
(``trainer/sft_trainer.py:1142-1147``) and trains on ``model(**inputs, fused_lm_head=True)`` (``:1611``):
``_fused_forward`` (``trainer/utils.py:1593-1698``) runs the backbone, drops the last position, and on a Triton
device scores only the positions whose next label is not ignored (``hidden_states[mask]``: a gathered copy), through
``ChunkedLogProbFunction`` (``kernels/chunked_logprob.py:299-465``): the projection in ``(4096 tokens, 32768
vocabulary)`` tiles of one reused buffer, folded by a Triton kernel into seven float32 per-token statistics; the
logits are never held. It keeps the gathered hidden states, the targets, ``log_z`` and the entropy for backward;
backward accumulates the hidden states' gradient in float32 and returns it in their dtype. The per-token outputs are
scattered back to ``(batch, length - 1)`` and the loss is ``-log_probs.sum() / num_items_in_batch``.

The ``torch`` fallback TRL runs where Triton is absent (this CPU) folds each tile with float32 temporaries of the
tile's size; that is not what a GPU allocates, so this is an allocation model of the Triton path. The number of valid
positions is data-dependent: the model takes every position whose next token is a label, ``batch x (length - 1)``
for full rows.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

#: the per-token fields ``SFTTrainer`` asks of the head (sft_trainer.py:1142-1147) and ``DPOTrainer`` (dpo_trainer.py:
#: 955)
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
#: ``TOKEN_CHUNK_SIZE`` (kernels/chunked_logprob.py:29) and ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (trainer/utils.py:1506)
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768


@cache
def functions() -> Any:
    """The module's autograd functions and helpers, built on first use (torch is imported here, not on import)."""
    import torch
    from transformers.utils import ModelOutput

    class GatherValid(torch.autograd.Function):
        """``hidden_states[mask]`` (``_fused_forward``): a ``(valid, hidden)`` copy; its backward puts the gradient
        into zeros of the masked tensor's shape (``index_put_`` on ``zeros_like``)."""

        @staticmethod
        def forward(ctx: Any, hidden: Any, n_valid: int) -> Any:
            ctx.shape, ctx.dtype = hidden.shape, hidden.dtype
            return torch.empty((n_valid, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device), None

    class ScatterValid(torch.autograd.Function):
        """``x.new_zeros(mask.shape).masked_scatter(mask, x)``: zeros, then the scattered copy; backward selects the
        gradient of the valid positions."""

        @staticmethod
        def forward(ctx: Any, x: Any, shape: Any) -> Any:
            zeros = torch.zeros(shape, dtype=x.dtype, device=x.device)
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            del zeros
            ctx.n = x.shape[0]
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return torch.empty((ctx.n,), dtype=grad.dtype, device=grad.device), None

    class ChunkedLogProb(torch.autograd.Function):
        """``ChunkedLogProbFunction`` with the per-token fields asked (``outputs``) and a frozen LM head, on a Triton
        device (the tiles folded in registers)."""

        @staticmethod
        def forward(
            ctx: Any, hidden: Any, weight: Any, targets: Any, compute_dtype: Any, outputs: tuple[str, ...] = SFT_OUTPUTS
        ) -> Any:
            ctx.set_materialize_grads(False)
            n, dev = hidden.shape[0], hidden.device
            f32 = torch.float32
            stats = [torch.empty((n,), dtype=f32, device=dev) for _ in range(7)]  # :352-358
            running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit = stats
            mm_buf = torch.empty((min(n, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), dtype=compute_dtype, device=dev)
            for start in range(0, n, TOKEN_CHUNK_SIZE):  # :361-389
                chunk = hidden[start : start + TOKEN_CHUNK_SIZE].to(compute_dtype)  # a copy when the dtype differs
                for v in range(0, weight.shape[0], VOCAB_CHUNK_SIZE):
                    w = weight[v : v + VOCAB_CHUNK_SIZE].to(compute_dtype)  # `torch.mm(..., out=tile)`: no new tensor
                    del w
                del chunk
            del mm_buf
            log_z = running_max + torch.log(sum_exp)  # :391-396
            logprobs = target_logit - log_z
            entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
            log_sum_sq = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
            mean_logits = z_sum / weight.shape[0] if "mean_logits" in outputs else None
            is_top1 = (
                (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
            )
            del stats, running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit
            ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)  # :399
            ctx.compute_dtype = compute_dtype
            ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
            return logprobs, entropy, log_sum_sq, mean_logits, is_top1

        @staticmethod
        def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any, *_: Any) -> Any:
            hidden, _weight, _targets, _log_z, _entropy = ctx.saved_tensors
            n, dev = hidden.shape[0], hidden.device
            grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=dev)  # :418-420
            mm_buf = torch.empty((min(n, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), dtype=ctx.compute_dtype, device=dev)
            grad_weight = None
            if ctx.needs_input_grad[1]:  # a trainable lm_head: its gradient accumulated in float32 too (:421-423)
                grad_weight = torch.zeros(_weight.shape, dtype=torch.float32, device=dev)
            if grad_logprobs is not None:
                grad_logprobs = grad_logprobs.float().contiguous()
            # per tile: the projection into mm_buf, the Triton kernel turns it into the logits' gradient in place,
            # `torch.addmm(acc, tile, w, out_dtype=float32, out=acc)` into grad_hidden (CUDA, 16-bit inputs)
            for start in range(0, n, TOKEN_CHUNK_SIZE):
                chunk = hidden[start : start + TOKEN_CHUNK_SIZE].to(ctx.compute_dtype)  # :420, a copy if it casts
                for v in range(0, _weight.shape[0], VOCAB_CHUNK_SIZE):
                    w = _weight[v : v + VOCAB_CHUNK_SIZE].to(ctx.compute_dtype)  # :423, a copy if it casts
                    del w
                del chunk
            del mm_buf, grad_logprobs
            hidden_grad = grad_hidden.to(hidden.dtype)  # :455
            del grad_hidden
            weight_grad = grad_weight.to(_weight.dtype) if grad_weight is not None else None
            return hidden_grad, weight_grad, None, None, None

    def scored(
        hidden: Any, shifted: Any, weight: Any, n_valid: int, compute_dtype: Any, outputs: tuple[str, ...] = SFT_OUTPUTS
    ) -> Any:
        """The head's per-token fields of the ``n_valid`` positions whose next label is not ignored: their hidden
        states gathered (``hidden_states[mask]``, :1660) with their labels (``labels[mask]``), scored in tiles."""
        gathered = GatherValid.apply(hidden, n_valid)
        targets = torch.empty((n_valid,), dtype=shifted.dtype, device=shifted.device)
        fields = ChunkedLogProb.apply(gathered, weight, targets, compute_dtype, outputs)
        del gathered, targets
        return fields

    def chunked_nll_loss(hidden: Any, weight: Any, labels: Any, num_items_in_batch: Any, autocast_dtype: Any) -> Any:
        """``_fused_forward`` from the backbone's last hidden state, and ``SFTTrainer.compute_loss``'s loss."""
        h = hidden[:, :-1]
        shifted = labels[:, 1:]
        mask = shifted != -100  # (batch, length - 1) bool
        n_valid = int(shifted.shape[0] * shifted.shape[1])
        logprobs, entropy, _, _, is_top1 = scored(h, shifted, weight, n_valid, autocast_dtype or hidden.dtype)
        shape = mask.shape
        log_probs = ScatterValid.apply(logprobs, shape)
        entropy_full = ScatterValid.apply(entropy.detach(), shape)
        top1_full = torch.zeros(shape, dtype=torch.bool, device=mask.device)
        del logprobs, entropy, is_top1
        denominator = num_items_in_batch if num_items_in_batch is not None else mask.sum()
        fused_loss = -log_probs.sum() / denominator  # FusedCausalLMOutput.loss (:1675)
        per_token_loss = -log_probs  # compute_loss (:1611-1618)
        loss = per_token_loss.sum() / torch.as_tensor(denominator).clamp(min=1)
        del fused_loss, per_token_loss, entropy_full, top1_full, mask
        return loss

    @dataclass
    class FusedCausalLMOutput(ModelOutput):
        """TRL's ``FusedCausalLMOutput`` (trainer/utils.py:1509-1540): its fields, for the steps that read them."""

        loss: Any = None
        log_probs: Any = None
        entropy: Any = None
        log_sum_sq_probs: Any = None
        mean_logits: Any = None
        is_top1: Any = None
        label_mask: Any = None
        aux_loss: Any = None

    def gathered_under_zero3(*params: Any) -> Any:
        """TRL's ``maybe_gather_lm_head_ctx`` (trainer/utils.py:200-231): under DeepSpeed ZeRO-3, the head's
        partitioned parameters gathered for the kernel's direct read (``GatheredParameters``), unless already
        available; else nothing."""
        import contextlib

        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return contextlib.nullcontext()
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        to_gather = {id(p): p for p in params if p is not None and p.ds_status != ZeroParamStatus.AVAILABLE}
        return deepspeed.zero.GatheredParameters(list(to_gather.values())) if to_gather else contextlib.nullcontext()

    def add_fused_lm_head(model: Any, outputs: tuple[str, ...], autocast_dtype: Any, valid: Any) -> None:
        """``add_fused_lm_head(model, outputs=...)`` (trainer/utils.py:1548-1700) as a Triton device runs it: the
        patched forward, with ``fused_lm_head=True``, runs the backbone, scores the positions whose next label is not
        ignored (``valid(labels)``: how many, which a fake tensor cannot count) through the head in tiles, scatters
        each per-token field back to ``(batch, length - 1)`` and returns the mean negative log-likelihood."""
        original = model.forward

        def fused_forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, **kwargs: Any) -> Any:
            if not fused_lm_head:
                return original(*args, labels=labels, **kwargs) if labels is not None else original(*args, **kwargs)
            kwargs["use_cache"] = False  # :1627
            backbone = self.base_model(*args, **kwargs)
            hidden = backbone.last_hidden_state[:, :-1]  # :1631-1633
            shifted = labels[:, 1:]
            weight = self.get_output_embeddings().weight  # looked up at each call (:1637-1646)
            mask = shifted != -100  # :1643
            with gathered_under_zero3(weight):  # `maybe_gather_lm_head_ctx(weight, bias)` around the kernel (:1643)
                fields = scored(hidden, shifted, weight, int(valid(shifted)), autocast_dtype or hidden.dtype, outputs)
            # `x.new_zeros(mask.shape).masked_scatter(mask, x)` for each field computed (:1671-1674)
            per_token = [None if x is None else ScatterValid.apply(x, mask.shape) for x in fields]
            del fields
            log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
            del per_token
            assert log_probs is not None  # always computed (:1572-1573)
            loss = -log_probs.sum() / mask.sum().clamp(min=1)  # :1678
            return FusedCausalLMOutput(
                loss=loss,
                log_probs=log_probs,
                entropy=entropy,
                log_sum_sq_probs=log_sum_sq_probs,
                mean_logits=mean_logits,
                is_top1=is_top1,
                label_mask=mask,
            )

        model.forward = types.MethodType(fused_forward, model)

    return SimpleNamespace(
        add_fused_lm_head=add_fused_lm_head,
        FusedCausalLMOutput=FusedCausalLMOutput,
        GatherValid=GatherValid,
        ScatterValid=ScatterValid,
        ChunkedLogProb=ChunkedLogProb,
        chunked_nll_loss=chunked_nll_loss,
    )


__all__ = ["DPO_OUTPUTS", "SFT_OUTPUTS", "TOKEN_CHUNK_SIZE", "VOCAB_CHUNK_SIZE", "functions"]
