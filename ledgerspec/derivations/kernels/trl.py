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

from functools import cache
from types import SimpleNamespace
from typing import Any

#: ``TOKEN_CHUNK_SIZE`` (kernels/chunked_logprob.py:29) and ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (trainer/utils.py:1506)
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768


@cache
def functions() -> Any:
    """The module's autograd functions and helpers, built on first use (torch is imported here, not on import)."""
    import torch

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
        """``ChunkedLogProbFunction`` with ``outputs=("log_probs", "entropy", "is_top1")`` and a frozen LM head, on a
        Triton device (the tiles folded in registers)."""

        @staticmethod
        def forward(ctx: Any, hidden: Any, weight: Any, targets: Any, compute_dtype: Any) -> Any:
            ctx.set_materialize_grads(False)
            n, dev = hidden.shape[0], hidden.device
            f32 = torch.float32
            stats = [torch.empty((n,), dtype=f32, device=dev) for _ in range(7)]  # :352-358
            running_max, sum_exp, x_sum_exp, _sq, _z, max_before_target, target_logit = stats
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
            entropy = log_z - x_sum_exp / sum_exp
            is_top1 = (target_logit >= running_max) & (target_logit > max_before_target)
            del stats, running_max, sum_exp, x_sum_exp, _sq, _z, max_before_target, target_logit
            ctx.save_for_backward(hidden, weight, targets, log_z, entropy)  # :399
            ctx.compute_dtype = compute_dtype
            ctx.mark_non_differentiable(is_top1)
            return logprobs, entropy, is_top1

        @staticmethod
        def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any, _top1: Any) -> Any:
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
            del mm_buf, grad_logprobs
            hidden_grad = grad_hidden.to(hidden.dtype)  # :455
            del grad_hidden
            weight_grad = grad_weight.to(_weight.dtype) if grad_weight is not None else None
            return hidden_grad, weight_grad, None, None

    def chunked_nll_loss(hidden: Any, weight: Any, labels: Any, num_items_in_batch: Any, autocast_dtype: Any) -> Any:
        """``_fused_forward`` from the backbone's last hidden state, and ``SFTTrainer.compute_loss``'s loss."""
        h = hidden[:, :-1]
        shifted = labels[:, 1:]
        mask = shifted != -100  # (batch, length - 1) bool
        n_valid = int(shifted.shape[0] * shifted.shape[1])
        gathered = GatherValid.apply(h, n_valid)
        targets = torch.empty((n_valid,), dtype=shifted.dtype, device=shifted.device)  # `labels[mask]`
        compute_dtype = autocast_dtype or hidden.dtype
        logprobs, entropy, is_top1 = ChunkedLogProb.apply(gathered, weight, targets, compute_dtype)
        del gathered, targets
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

    return SimpleNamespace(
        GatherValid=GatherValid,
        ScatterValid=ScatterValid,
        ChunkedLogProb=ChunkedLogProb,
        chunked_nll_loss=chunked_nll_loss,
    )


__all__ = ["TOKEN_CHUNK_SIZE", "VOCAB_CHUNK_SIZE", "functions"]
