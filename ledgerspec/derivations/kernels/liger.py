"""Liger-Kernel's autograd functions as the simulated step allocates them (liger-kernel 0.8.5).

Liger's kernels are Triton kernels: they do not run on this CPU, and under fake tensors nothing runs anyway. Each
class below is an allocation model: its forward and backward allocate, keep and free the tensors the Liger function
of the same name does, in the same order and of the same shapes and dtypes, and write nothing (the Triton kernels'
in-place writes allocate nothing). Every line cites the source it follows, in the liger-kernel 0.8.5 wheel
(``liger_kernel/ops/...``). The values are garbage: these classes are for the estimate's fake tensors only.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any


@cache
def functions() -> Any:
    """The module's autograd functions and helpers, built on first use (torch is imported here, not on import)."""
    import torch

    IGNORE_INDEX = -100
    #: ``_CHUNK_MEM_CONST`` (ops/fused_linear_cross_entropy.py:27): the chunk's logits are bounded by this many
    #: times the chunk's hidden states
    CHUNK_MEM_CONST = 1

    def _cdiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()

    def flce_chunk_size(bt: int, hidden: int, vocab: int) -> int:
        """The tokens per chunk (ops/fused_linear_cross_entropy.py:102-105, verbatim)::

        inc_factor = triton.cdiv(V, chunk_mem_const * H)
        chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor))
        chunk_size = min(chunk_size, BT)
        """
        inc_factor = _cdiv(vocab, CHUNK_MEM_CONST * hidden)
        return min(_next_power_of_2(_cdiv(bt, inc_factor)), bt)

    def can_use_mm_out(x: Any, weight: Any, on_cuda: bool, autocast_dtype: Any) -> bool:
        """``_can_use_mm_out`` (ops/fused_linear_cross_entropy.py:32-48): on CUDA (not HIP), with the input and the
        weight of one 16/32-bit dtype and autocast off or in that dtype, the chunk's logits go into one reused buffer
        and its gradient straight into ``grad_input`` (``torch.mm(..., out=...)``)."""
        same = x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        return on_cuda and same and (autocast_dtype is None or autocast_dtype == x.dtype)

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """``LigerFusedLinearCrossEntropyFunction`` with a frozen ``lm_head`` (LoRA/QLoRA: no ``grad_weight``), no bias,
        no z-loss, reduction ``sum`` (transformers passes ``num_items_in_batch``) or ``mean``."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, target: Any, on_cuda: bool, autocast_dtype: Any) -> Any:
            bt, hidden = x.shape
            vocab = weight.shape[0]
            chunk = flce_chunk_size(bt, hidden, vocab)
            grad_input = torch.zeros_like(x)  # :108, saved: the input's gradient, computed in forward
            grad_weight = None
            if weight.requires_grad:  # :114-120 (full fine-tuning of lm_head): the weight's gradient, param dtype
                grad_weight = torch.zeros_like(weight)
            loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)  # :125
            target_mask = target != IGNORE_INDEX  # :131-132, `total_n_non_ignore = target_mask.sum().item()`
            total = target_mask.sum()
            del target_mask, total
            mm_out = can_use_mm_out(x, weight, on_cuda, autocast_dtype)
            storage = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if mm_out else None  # :150-154
            for start in range(0, bt, chunk):
                end = min(start + chunk, bt)
                x_chunk = x[start:end]
                if storage is not None:  # :160-166 `torch.mm(_input_chunk, weight.t(), out=logits_chunk)`
                    logits_chunk = storage[: end - start]
                else:  # :168 `logits_chunk = _input_chunk @ weight.t()` (autocast casts as it does there)
                    logits_chunk = x_chunk @ weight.t()
                # :212-250 the cross-entropy kernel writes the loss into loss_1d and d(loss)/d(logits) into the chunk
                if storage is not None:  # :319 `torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])`
                    pass
                else:  # :321 `grad_input[start_idx:end_idx] = grad_logits_chunk @ weight`
                    grad_input[start:end] = logits_chunk @ weight
                if grad_weight is not None:  # :324-375 addmm into grad_weight in place (bf16 params, sm80+)
                    pass
                del logits_chunk  # :388 the chunk goes before the next one's logits
            del storage  # :391
            loss = torch.sum(loss_1d)  # :404
            del loss_1d
            ctx.save_for_backward(grad_input.detach(), grad_weight)  # :554-578
            return loss

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            grad_input, grad_weight = ctx.saved_tensors
            # fused_linear_cross_entropy_backward (:418-464): `torch.equal(grad_output, torch.tensor(1.0, ...))`, then
            # element_mul in place on grad_input (and grad_weight): no other allocation
            one = torch.tensor(1.0, dtype=grad_output.dtype, device=grad_output.device)
            del one
            return grad_input, grad_weight, None, None, None

    def fused_linear_cross_entropy_loss(
        hidden: Any,
        weight: Any,
        labels: Any,
        num_items_in_batch: Any,
        on_cuda: bool,
        autocast_dtype: Any,
    ) -> Any:
        """``LigerForCausalLMLoss`` (transformers/model/loss_utils.py:67-106): the labels padded by one ignored position
        and shifted, the hidden states flattened, reduction ``sum`` divided by ``num_items_in_batch`` when given."""
        import torch.nn.functional as nnf

        labels = nnf.pad(labels, (0, 1), value=IGNORE_INDEX)
        shift_labels = labels[..., 1:].contiguous()
        del labels
        x = hidden.view(-1, hidden.shape[-1])
        loss = FusedLinearCrossEntropy.apply(x, weight, shift_labels.view(-1), on_cuda, autocast_dtype)
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss

    class RMSNorm(torch.autograd.Function):
        """``LigerRMSNormFunction`` (ops/rms_norm.py): the output and a float32 reciprocal RMS per row; saves the input
        itself (a view, no copy), the weight and the RMS; backward writes dX into dY in place (``in_place=True``, the
        llama casting mode's default) and, for a weight that trains, sums float32 partial gradients per SM."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, in_place: bool, sm_count: int) -> Any:
            shape = x.shape
            x2 = x.contiguous().view(-1, shape[-1])  # ensure_contiguous, `X.view(-1, dim)` (:449-460)
            y = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)  # :462
            rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)  # :465-466 (llama/gemma: fp32)
            ctx.in_place, ctx.sm_count = in_place, sm_count
            ctx.save_for_backward(x2, weight, rstd)  # :674-676
            return y.view(shape)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x2, weight, _rstd = ctx.saved_tensors
            shape = dy.shape
            dy2 = dy.contiguous().view(-1, shape[-1])
            dx = dy2 if ctx.in_place else torch.zeros_like(dy2)  # :555-558
            dw = None
            if ctx.needs_input_grad[1]:  # :541-546 `_dW` (sm_count, n_cols) fp32, then `.sum(dim=0).to(W.dtype)` (:622)
                partial = torch.empty((ctx.sm_count, x2.shape[-1]), dtype=torch.float32, device=x2.device)
                dw = partial.sum(dim=0).to(weight.dtype)
                del partial
            return dx.view(shape), dw, None, None

    class GatedActivation(torch.autograd.Function):
        """``LigerSiLUMulFunction`` (ops/swiglu.py:240-306) and ``LigerGELUMulFunction`` (ops/geglu.py:133-146): the
        product ``act(a) * b`` in a new tensor; saves ``a`` and ``b`` only; backward recomputes the activation and
        writes the gradients into ``a`` and ``b`` in place, and returns them."""

        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            a2 = a.contiguous().view(-1, a.shape[-1])  # ensure_contiguous
            b2 = b.contiguous().view(-1, b.shape[-1])
            c = torch.empty_like(a2)  # swiglu.py:165 / geglu.py:93
            ctx.save_for_backward(a2, b2)  # swiglu.py:272 / geglu.py:138
            ctx.shape = a.shape
            return c.view(a.shape)

        @staticmethod
        def backward(ctx: Any, dc: Any) -> Any:
            a2, b2 = ctx.saved_tensors
            dc.contiguous()  # a copy only when the incoming gradient is not contiguous
            return a2.view(ctx.shape), b2.view(ctx.shape)  # the kernel wrote da into a, db into b

    class Rope(torch.autograd.Function):
        """``LigerRopeFunction`` (ops/rope.py): rotates q and k in place (no new tensor), saves the model's cos and sin
        (shared by every layer); backward makes ``dq.transpose(1, 2).contiguous()`` (a copy when the attention's
        gradient is not laid out as (batch, tokens, heads, dim)) and rotates it in place."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, cos: Any, sin: Any) -> Any:
            qt = q.transpose(1, 2).contiguous()  # :153-154, :169-172: no-ops in the HF layout
            kt = k.transpose(1, 2).contiguous()
            ctx.save_for_backward(cos, sin)  # :289
            return qt.transpose(1, 2), kt.transpose(1, 2)  # :198

        @staticmethod
        def backward(ctx: Any, dq: Any, dk: Any) -> Any:
            dqt = dq.transpose(1, 2).contiguous()  # :216-217, :233-234
            dkt = dk.transpose(1, 2).contiguous()
            return dqt.transpose(1, 2), dkt.transpose(1, 2), None, None

    def rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        """``liger_rotary_pos_emb`` in place of transformers' ``apply_rotary_pos_emb``."""
        return Rope.apply(q, k, cos, sin)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "torch"})


__all__ = ["functions"]
