"""Cut Cross-Entropy's ``linear_cross_entropy`` (impl ``cce``) as the simulated step allocates it.

The kernel is Triton (it does not run on this CPU; the package does not even import without Triton). This is an
allocation model of axolotl's fork (``axolotl-ai-cloud/ml-cross-entropy`` at 5f0c7a7, the package axolotl's
``CutCrossEntropyPlugin`` requires, ``cut_cross_entropy/cce.py``, ``cce_lse_forward.py``, ``indexed_dot.py``,
``cce_backward.py``; the forward is that of cut-cross-entropy 25.1.1): the logits are computed blockwise in SRAM and
never stored; forward keeps a float32 log-sum-exp per valid token and a float32 average logit per vocabulary entry;
backward allocates the gradient of the hidden states (all rows) and, for a frozen classifier, nothing for it.

The number of valid tokens is data-dependent (``(targets != ignore_index).nonzero()``): the model takes every
position whose next label is a token, ``batch x (length - 1)`` for full rows (per row one position fewer per padded
token: a few bytes per token, left out).
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

    class LinearCrossEntropy(torch.autograd.Function):
        """``LinearCrossEntropyFunction`` with a frozen classifier, no bias, ``filter_eps`` on (the default)."""

        @staticmethod
        def forward(ctx: Any, e: Any, c: Any, targets: Any, n_valid: int) -> Any:
            dev = e.device
            # _build_flat_valids (utils.py:28-48): `(targets != ignore).nonzero()` (N, 1) int64, then int32 (N,)
            ne = targets != IGNORE_INDEX
            idx = torch.empty((n_valid, 1), dtype=torch.int64, device=dev)
            del ne
            valids = idx.view(-1).to(torch.int32)
            del idx
            lse = torch.full((n_valid,), float("-inf"), dtype=torch.float32, device=dev)  # cce_lse_forward.py:168
            locks = torch.empty(((n_valid + 127) // 128,), dtype=torch.int32, device=dev)  # :169 (uint32)
            logit_avg = torch.empty((c.shape[0],), dtype=torch.float32, device=dev)  # :176 (grads needed, filter_eps)
            del locks
            neg_dot = torch.zeros((n_valid,), dtype=torch.float32, device=dev)  # indexed_dot.py:101
            nll = neg_dot.add_(lse)
            loss = nll.sum()  # reduction "sum" (apply_lce with num_items_in_batch), "mean" divides a scalar
            del nll, neg_dot
            ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)  # cce.py:77 (fork: :132)
            return loss

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            e, c, _lse, _targets, _valids, logit_avg = ctx.saved_tensors
            # cce.py:83-117: `vocab_ordering = torch.argsort(logit_avg).to(torch.int32)`
            order = torch.empty(logit_avg.shape, dtype=torch.int64, device=e.device)
            ordering = order.to(torch.int32)
            del order
            de = torch.zeros_like(e)  # cce_backward.py: every row, the embeddings' dtype
            # a trainable classifier: `dc = zeros_like(c)` (accum_c_fp32 off), returned as `dc.to(c.dtype)`
            dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
            dc_locks = torch.empty((c.shape[0] // 64 + 1,), dtype=torch.int32, device=e.device)  # per vocabulary block
            del dc_locks, ordering
            return de, dc, None, None

    def linear_cross_entropy_loss(hidden: Any, weight: Any, labels: Any, num_items_in_batch: Any) -> Any:
        """``apply_lce`` (fork ``transformers/utils.py:97-165``): reduction ``sum`` divided by
        ``num_items_in_batch`` when given (else ``mean``), labels shifted by one inside the kernel (``shift=True``)."""
        batch, length = labels.shape[0], labels.shape[-1]
        e = hidden.contiguous().flatten(0, -2)
        targets = labels.contiguous().view(-1)
        loss = LinearCrossEntropy.apply(e, weight, targets, batch * max(length - 1, 0))
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "torch"})


__all__ = ["functions"]
