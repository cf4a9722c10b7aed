"""axolotl's fused LoRA kernels (``axolotl/kernels/lora.py``, axolotl 0.21.0) for the simulated step.

axolotl attaches them itself for LoRA/QLoRA unless told not to (``check_auto_enable_lora_kernels``): one autograd
function per attention's q/k/v, one for its output projection, one for the gated MLP, in place of PEFT's layers. They
are plain torch code but for two parts: the NF4 dequantization (bitsandbytes' CUDA library through ctypes) and the
MLP's gated activation (a Triton kernel). The classes below are those functions line for line (non-DoRA, no LoRA
bias: PEFT's defaults), with the two parts replaced by what they allocate:

- ``dequantize`` of a 4-bit weight (``kernels/quantize.py`` ``_ctypes_nf4_dequant``): the dense weight
  ``(out, in)`` in the weight's original dtype, then the float32 absmax per block (double quantization), freed at
  return; an unquantized weight is used as it is;
- ``swiglu_forward`` / ``geglu_forward`` (``kernels/swiglu.py:119``, ``geglu.py:60``): the product in a new tensor of
  the gate's shape and dtype; their backward writes ``h``, ``d gate`` and ``d up`` into the three inputs in place.

On real tensors with unquantized weights the q/k/v and output functions run the same torch ops as axolotl's own, so
their allocations are axolotl's to the byte (``tests/derivations/kernels/test_axolotl.py`` compares them with
figures measured from the real functions on this CPU).
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any


@cache
def functions() -> Any:
    """The module's autograd functions and helpers, built on first use (torch is imported here, not on import)."""
    import torch

    _fwd = torch.amp.custom_fwd(
        device_type="cpu"
    )  # axolotl: the accelerator's type; the simulation's autocast is CPU's
    _bwd = torch.amp.custom_bwd(device_type="cpu")

    def dequantize(layer: Any) -> Any:
        """The dense ``(out, in)`` weight of a base layer: the weight itself, or a 4-bit layer's dequantized copy."""
        nested = getattr(layer, "nested", None)
        if nested is None:  # not a (simulated) 4-bit layer
            return layer.weight
        dev = layer.absmax.device
        out = torch.empty((layer.out_features, layer.in_features), dtype=layer.weight_dtype, device=dev)
        if nested:
            out_absmax = torch.empty(layer.absmax.numel(), dtype=torch.float32, device=dev)
            del out_absmax
        return out

    def matmul_lora(X: Any, base: Any, A: Any, B: Any, s: float, X_drop: Any = None, transpose: bool = True) -> Any:
        """``matmul_lora`` (lora.py:309-363): ``X @ W`` (``W`` dequantized, then freed), plus ``s * X_lora @ A @ B`` in
        place, plus the bias. ``transpose=False``: the weight as ``(in, out)`` already (down projection in backward)."""
        dtype = X.dtype
        W = dequantize(base)
        W = W.t() if transpose else W
        reshape = X.dim() == 3
        if reshape:
            batch, seq_len, _ = X.shape
            X = X.view(-1, X.shape[-1])
            if X_drop is not None:
                X_drop = X_drop.view(-1, X_drop.shape[-1])
        out = torch.matmul(X, W)
        del W
        if A is not None:
            X_lora = X_drop if X_drop is not None else X
            At, Bt = A.t().to(dtype), B.t().to(dtype)
            out.addmm_(X_lora @ At, Bt, alpha=s)
        bias = getattr(base, "bias", None)
        if bias is not None and transpose:
            out += bias
        return out.view(batch, seq_len, -1) if reshape else out

    def _gradient_mm(left: Any, right: Any, dtype: Any, scale: float) -> Any:
        """``_gradient_mm`` (lora.py): a float32 product for float32 adapters under 16-bit activations."""
        if dtype == torch.float32 and left.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast(device_type=left.device.type, enabled=False):
                return torch.mm(left.float(), right.float()).mul_(scale)
        result = torch.empty((left.shape[0], right.shape[1]), device=left.device, dtype=left.dtype)
        return result.addmm_(left, right, alpha=scale, beta=0)

    def _lora_grads(X_t: Any, grad: Any, A: Any, grad_B: Any, scale: float, dtypes: Any) -> tuple[Any, Any]:
        return _gradient_mm(X_t, grad_B, dtypes[0], scale), _gradient_mm(A @ X_t, grad, dtypes[1], scale)

    class LoRA_O(torch.autograd.Function):
        """``LoRA_O`` (lora.py:1756-1906): ``X @ W + s X_drop A B``; saves A and B in the input's dtype and X."""

        @staticmethod
        @_fwd
        def forward(ctx: Any, X: Any, X_drop: Any, base: Any, A: Any, B: Any, s: float) -> Any:
            ctx.dtypes = (A.dtype, B.dtype)
            out = matmul_lora(X, base, A, B, s, X_drop)
            dtype = X.dtype
            ctx.save_for_backward(A.to(dtype), B.to(dtype), X, X_drop if X_drop is not None else X)
            ctx.base, ctx.s, ctx.has_dropout = base, s, X_drop is not None
            return out

        @staticmethod
        @_bwd
        def backward(ctx: Any, dY: Any) -> Any:
            A, B, X, X_lora = ctx.saved_tensors
            s = ctx.s
            batch, seq_len, hd = X.shape
            dY = dY.reshape(-1, dY.shape[-1])
            X_lora = X_lora.reshape(-1, X_lora.shape[-1])
            grad_B = dY @ B
            d_A, d_B = _lora_grads(X_lora.t(), dY, A, grad_B, s, ctx.dtypes)
            W = dequantize(ctx.base)
            dX = dY @ W  # `dY @ W_deq.t()` with W_deq = dequantize(W.t())
            del W
            dX_drop = None
            if ctx.has_dropout:
                dX_drop = (grad_B @ A * s).view(batch, seq_len, hd)
            else:
                dX.addmm_(grad_B, A, alpha=s)
            return dX.view(batch, seq_len, hd), dX_drop, None, d_A.t(), d_B.t(), None

    class LoRA_QKV(torch.autograd.Function):
        """``LoRA_QKV`` (lora.py:925-1326): Q, K and V by ``matmul_lora``; saves X (and the dropped-out X) and the six
        adapter matrices in the input's dtype, not Q, K, V. ``layers``: the (base layer, scale) of q, k and v."""

        @staticmethod
        @_fwd
        def forward(
            ctx: Any, X: Any, X_drop: Any, qA: Any, qB: Any, kA: Any, kB: Any, vA: Any, vB: Any, layers: Any
        ) -> Any:
            ab = (qA, qB, kA, kB, vA, vB)
            outs = tuple(
                matmul_lora(X, base, ab[2 * i], ab[2 * i + 1], s, X_drop) for i, (base, s) in enumerate(layers)
            )
            dtype = X.dtype
            ctx.dtypes = [t.dtype for t in ab]
            ctx.save_for_backward(X, X_drop if X_drop is not None else X, *(t.to(dtype) for t in ab))
            ctx.layers, ctx.has_dropout = layers, X_drop is not None
            return outs

        @staticmethod
        @_bwd
        def backward(ctx: Any, q_grad: Any, k_grad: Any, v_grad: Any) -> Any:
            X, X_lora, *ab = ctx.saved_tensors
            batch, seq_len = X.shape[:2]
            grads = (
                q_grad.view(-1, q_grad.shape[-1]),
                k_grad.reshape(-1, k_grad.shape[-1]),
                v_grad.view(-1, v_grad.shape[-1]),
            )
            X_lora = X_lora.view(-1, X_lora.shape[-1])
            X_lora_t = X_lora.t()
            grad_Bs, d_ab = [], []
            for i, grad in enumerate(grads):
                grad_B = grad @ ab[2 * i + 1]
                grad_Bs.append(grad_B)
                d_A, d_B = _lora_grads(
                    X_lora_t, grad, ab[2 * i], grad_B, ctx.layers[i][1], ctx.dtypes[2 * i : 2 * i + 2]
                )
                d_ab += [d_A, d_B]
            grad_X: Any = None
            for i, grad in enumerate(grads):
                W = dequantize(ctx.layers[i][0])
                if grad_X is None:
                    grad_X = torch.mm(grad, W)
                else:
                    grad_X.addmm_(grad, W)
                del W
            grad_X_drop = torch.zeros_like(X_lora) if ctx.has_dropout else None
            target = grad_X_drop if grad_X_drop is not None else grad_X
            for i in range(3):
                target.addmm_(grad_Bs[i], ab[2 * i], alpha=ctx.layers[i][1])
            drop = grad_X_drop.view(batch, seq_len, -1) if grad_X_drop is not None else None
            return (grad_X.view(batch, seq_len, -1), drop, *(t.t() for t in d_ab), None)

    class LoRA_MLP(torch.autograd.Function):
        """``LoRA_MLP`` (lora.py:366-801) with the gated activation's allocations: saves X, gate and up and the six
        adapter matrices in the input's dtype; the activation's output is not saved. ``layers``: the (base layer,
        scale) of gate, up and down."""

        @staticmethod
        @_fwd
        def forward(
            ctx: Any, X: Any, X_drop: Any, gA: Any, gB: Any, uA: Any, uB: Any, dA: Any, dB: Any, layers: Any
        ) -> Any:
            (gate, gs), (up, us), (down, ds) = layers
            g = matmul_lora(X, gate, gA, gB, gs, X_drop)
            u = matmul_lora(X, up, uA, uB, us, X_drop)
            hidden = torch.empty(g.shape, dtype=g.dtype, device=g.device)  # swiglu_forward / geglu_forward
            out = matmul_lora(hidden, down, dA, dB, ds)
            del hidden
            dtype = X.dtype
            ab = (gA, gB, uA, uB, dA, dB)
            ctx.dtypes = [t.dtype for t in ab]
            ctx.save_for_backward(X, X_drop if X_drop is not None else X, g, u, *(t.to(dtype) for t in ab))
            ctx.layers, ctx.has_dropout = layers, X_drop is not None
            return out

        @staticmethod
        @_bwd
        def backward(ctx: Any, grad_output: Any) -> Any:
            X, X_lora, g, u, gA, gB, uA, uB, dA, dB = ctx.saved_tensors
            (gate, gs), (up, us), (down, ds) = ctx.layers
            batch, seq_len, hd = X.shape
            grad_output = grad_output.view(-1, grad_output.shape[-1])
            X_lora = X_lora.view(-1, X_lora.shape[-1])
            g, u = g.view(-1, g.shape[-1]), u.view(-1, u.shape[-1])
            # matmul_lora(grad_output, down_weight.t(), None, down_quant, down_B_t, down_A_t, s): the down weight as
            # (out, in) = (hidden, intermediate), the adapter's B then A
            grad_down = matmul_lora(grad_output, down, dB.t(), dA.t(), ds, transpose=False)
            h, grad_gate, grad_up = grad_down, g, u  # the activation's backward writes into its three inputs
            d_dA, d_dB = _lora_grads(h.t(), grad_output, dA, grad_output @ dB, ds, ctx.dtypes[4:6])
            grad_B_up = grad_up @ uB
            d_uA, d_uB = _lora_grads(X_lora.t(), grad_up, uA, grad_B_up, us, ctx.dtypes[2:4])
            grad_B_gate = grad_gate @ gB
            d_gA, d_gB = _lora_grads(X_lora.t(), grad_gate, gA, grad_B_gate, gs, ctx.dtypes[0:2])
            W_up = dequantize(up)
            dX = torch.matmul(grad_up, W_up)  # `grad_up @ dequantize(up_weight.t()).t()`
            del W_up
            W_gate = dequantize(gate)
            dX.addmm_(grad_gate, W_gate)
            del W_gate
            dX_drop = None
            if ctx.has_dropout:
                dX_drop = torch.zeros_like(X_lora)
                dX_drop.addmm_(grad_B_up, uA, alpha=us)
                dX_drop.addmm_(grad_B_gate, gA, alpha=gs)
                dX_drop = dX_drop.view(batch, seq_len, hd)
            else:
                dX.addmm_(grad_B_up, uA, alpha=us)
                dX.addmm_(grad_B_gate, gA, alpha=gs)
            d_ab = (d_gA, d_gB, d_uA, d_uB, d_dA, d_dB)
            return (dX.view(batch, seq_len, hd), dX_drop, *(t.t() for t in d_ab), None)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "torch"})


__all__ = ["functions"]
