"""An AWQ base in the training step: the GEMM ``QuantLinear`` an AWQ checkpoint loads, and its training kernel.

:func:`replace_with_awq_linear` replaces the ``nn.Linear`` layers of the decoder blocks (the layers transformers'
``replace_with_awq_linear`` converts in the decoder; the head stays dense, as
:mod:`ledgerspec.derivations.stack.census` counts them) by :class:`AwqGemmLinear`; PEFT's ``AwqLoraLinear``
(``peft/tuners/lora/awq.py``) wraps it through LoRA's custom-module dispatch, as ``dispatch_awq`` wraps a GPTQModel
AWQ layer. Plain tensors: the same module runs on real CPU tensors and under ``FakeTensorMode``.

Buffers (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.__init__`` at 88e4c76; GPTQModel 7.x
``AwqGEMMLinear`` the same, :func:`ledgerspec.derivations.stack.quant_storage.awq_bytes`): ``qweight`` int32 ``(in,
out / 8)``, ``qzeros`` int32 ``(in / group, out / 8)``, ``scales`` float16 ``(in / group, out)``, ``bias`` float16
``(out,)`` when the Linear had one.

Kernel (GPTQModel 7.x ``gptqmodel/nn_modules/qlinear/gemm_awq.py`` at f4c327a: ``AwqGEMMLinear.forward`` lines
167-204, ``AwqGemmFn`` lines 22-84, its AWQ GEMM layer with ``SUPPORTS_TRAINING = True``; AutoAWQ's
``WQLinearMMFunction`` is the same): an input that is not float16 or
bfloat16 is cast to float16 first; ``ctx.save_for_backward(x, qweight, qzeros, scales, bias)`` keeps the layer's
INPUT for backward; above 1,024 rows (``x.shape[0] * x.shape[1] > 1024``) the weight is dequantized into a new
``(in, out)`` tensor in the scales' dtype and multiplied (``torch.matmul``), below it the fused CUDA GEMM writes the
output only (its split-k partial sums are not modelled); ``+ bias``; a 2-D output gets a leading dimension. Backward
dequantizes again and multiplies by ``weights.transpose(0, 1).unsqueeze(0).repeat(batch_size, 1, 1)``: a batch-size
copy of the transposed weight, ``(batch, out, in)``, then ``bmm``.
"""

from __future__ import annotations

from typing import Any

#: rows (``x.shape[0] * x.shape[1]``) above which the kernel dequantizes the whole weight
FULL_DEQUANT_ROWS = 1024


def _classes() -> tuple[Any, Any]:
    import torch

    def dequantize(qweight: Any, scales: Any) -> Any:
        """The ``(in, out)`` weight in the scales' dtype, one new tensor as ``awq_dequantize_weights`` returns it."""
        w = torch.empty((qweight.shape[0], scales.shape[1]), dtype=scales.dtype, device=qweight.device)
        w.copy_(scales[0].expand_as(w))
        return w

    class AwqGemmFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, qweight: Any, qzeros: Any, scales: Any, bias: Any, out_features: int) -> Any:
            ctx.save_for_backward(x, qweight, qzeros, scales, bias)
            out_shape = (*x.shape[:-1], out_features)
            if x.shape[0] * x.shape[1] > FULL_DEQUANT_ROWS:
                w = dequantize(qweight, scales)
                if w.dtype != x.dtype:
                    w = w.to(dtype=x.dtype)
                out = torch.matmul(x, w)
                del w
            else:  # the fused GEMM: its output only (zeros: finite values, or a real run's GradScaler skips the step)
                out = torch.zeros((x.reshape(-1, x.shape[-1]).shape[0], out_features), dtype=x.dtype, device=x.device)
            out = out + bias if bias is not None else out
            out = out.reshape(out_shape)
            if len(out.shape) == 2:
                out = out.unsqueeze(0)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            _x, qweight, _qzeros, scales, _bias = ctx.saved_tensors
            weights = dequantize(qweight, scales)
            if weights.dtype != grad.dtype:
                weights = weights.to(grad.dtype)
            grad_x = None
            if ctx.needs_input_grad[0]:
                batch = grad.shape[0]
                grad_x = grad.bmm(weights.transpose(0, 1).unsqueeze(0).repeat(batch, 1, 1))
            return grad_x, None, None, None, None, None

    class AwqGemmLinear(torch.nn.Module):
        """An AWQ GEMM ``QuantLinear`` (the buffers of the upstream layer; see the module docstring)."""

        def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool) -> None:
            super().__init__()
            if bits != 4:
                raise ValueError(f"the AWQ GEMM kernel packs 4 bits, got {bits}")
            self.in_features, self.out_features = in_features, out_features
            self.w_bit = bits
            self.group_size = group_size if group_size not in (-1, 0) else in_features
            groups = in_features // self.group_size
            pack = 32 // bits
            self.register_buffer("qweight", torch.zeros((in_features, out_features // pack), dtype=torch.int32))
            self.register_buffer("qzeros", torch.zeros((groups, out_features // pack), dtype=torch.int32))
            self.register_buffer("scales", torch.zeros((groups, out_features), dtype=torch.float16))
            if bias:
                self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16))
            else:
                self.bias = None

        def forward(self, x: Any) -> Any:
            out_shape = (*x.shape[:-1], self.out_features)
            input_dtype = x.dtype
            compute = input_dtype if input_dtype in (torch.float16, torch.bfloat16) else torch.float16
            if input_dtype != compute:
                x = x.to(compute)
            elif not x.is_contiguous():
                x = x.contiguous()
            scales: Any = getattr(self, "scales")  # noqa: B009
            if scales.dtype != compute:  # _ensure_runtime_dtype: the scales (and bias) cast for good
                self.scales = scales.to(dtype=compute).contiguous()
                if self.bias is not None:
                    self.bias = self.bias.to(dtype=compute).contiguous()
            out = AwqGemmFn.apply(x, self.qweight, self.qzeros, self.scales, self.bias, self.out_features)
            if out.dtype != input_dtype:
                out = out.to(dtype=input_dtype)
            return out.reshape(out_shape)

    return AwqGemmLinear, AwqGemmFn


_CLASSES: tuple[Any, Any] | None = None


def quant_linear_class() -> Any:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _classes()
    return _CLASSES[0]


def lora_custom_modules() -> dict[Any, Any]:
    """LoRA's custom-module mapping that makes PEFT wrap :class:`AwqGemmLinear` in its ``AwqLoraLinear``."""
    from peft.tuners.lora.awq import AwqLoraLinear

    return {quant_linear_class(): AwqLoraLinear}


def replace_with_awq_linear(model: Any, bits: int, group_size: int, skip_modules: tuple[str, ...] = ()) -> int:
    """Replace the ``nn.Linear`` layers of the decoder blocks by :class:`AwqGemmLinear`; returns how many."""
    from ledgerspec.derivations.engine.gptq import replace_decoder_linears

    cls = quant_linear_class()
    count = replace_decoder_linears(
        model,
        lambda child: cls(child.in_features, child.out_features, bits, group_size, child.bias is not None),
        skip_modules,
    )
    model.quantization_method = "awq"
    return count


__all__ = ["FULL_DEQUANT_ROWS", "lora_custom_modules", "quant_linear_class", "replace_with_awq_linear"]
