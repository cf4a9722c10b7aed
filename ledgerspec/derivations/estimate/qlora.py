"""QLoRA under fake tensors: bitsandbytes 4-bit linears modelled tensor by tensor.

bitsandbytes' ``Params4bit`` is a tensor subclass that cannot wrap a ``FakeTensor``, so the 4-bit
layers cannot be materialised under ``FakeTensorMode``. :func:`model_4bit_layers` replaces every
``bnb.nn.Linear4bit`` of a meta model (after the workload's exact replacement and PEFT injection,
before materialisation) by :class:`Fake4bitLinear`, which holds what bitsandbytes 0.50 stores and
allocates what its CUDA kernels allocate:

- storage (exact, :func:`ledgerspec.derivations.stack.bnb_storage.bnb4_bytes`): the packed weight
  ``((n + 1) // (2 s), 1)`` in ``quant_storage`` (item size ``s``), ``absmax`` (fp32 per block, or uint8
  per block with double quantization, plus the fp32 ``offset``, the nested fp32 absmax per 256 blocks
  and the 256-entry nested code), the 16-entry fp32 code;
- forward (``Linear4bit.forward`` -> ``MatMul4Bit`` -> CUDA ``gemm_4bit``): the input cast to the
  compute dtype when it differs; for more than 1536 rows bitsandbytes dequantizes
  (``_dequant_linear_fallback``): the nested absmax dequantized to fp32 and offset (two fp32 vectors),
  the dense ``(out, in)`` weight in the compute dtype, then ``F.linear``. Below 1536 rows the fused
  kernel may skip the dense temporary on some GPUs; the estimate always counts it (an upper bound of
  one weight matrix at a time). Nothing is saved for backward but the (frozen) packed weight; with
  ``keep_input`` (a declared bitsandbytes < 0.43.2, :mod:`ledgerspec.contract.differences`) the input in the
  compute dtype too, as ``ctx.tensors = (A, B)`` kept it until the graph is released;
- backward (``MatMul4Bit.backward``): ``dequantize_4bit`` (the nested absmax in fp32, the dense weight
  in the weight's original dtype, cast to the gradient dtype when it differs) and ``grad @ W``.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

#: rows above which bitsandbytes' CUDA gemm_4bit always takes the dequantize + F.linear path
CUDA_DEQUANT_MIN_ROWS = 1536


def _fake_4bit_classes() -> tuple[Any, Any]:
    import torch

    class _Matmul4bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, packed: Any, layer: Any) -> Any:
            nblocks = layer.absmax.numel()
            temps = []
            if layer.nested:
                temps.append(torch.empty(nblocks, dtype=torch.float32, device=x.device))  # absmax_dq
                temps.append(torch.empty(nblocks, dtype=torch.float32, device=x.device))  # absmax_dq + offset
            dense = torch.empty((layer.out_features, layer.in_features), dtype=x.dtype, device=x.device)
            out = torch.nn.functional.linear(x, dense, layer.bias)
            del dense, temps
            ctx.layer = layer
            if layer.keep_input and ctx.needs_input_grad[0]:  # bitsandbytes < 0.43.2: ctx.tensors = (A, B)
                ctx.kept_input = x
            ctx.grad_dtype = x.dtype
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            layer = ctx.layer
            if not ctx.needs_input_grad[0]:
                return None, None, None
            absmax = (
                torch.empty(layer.absmax.numel(), dtype=torch.float32, device=grad.device) if layer.nested else None
            )
            dense = torch.empty((layer.out_features, layer.in_features), dtype=layer.weight_dtype, device=grad.device)
            if dense.dtype != grad.dtype:
                dense = dense.to(grad.dtype)
            grad_x = torch.matmul(grad, dense)
            del dense, absmax
            return grad_x, None, None

    class Fake4bitLinear(torch.nn.Module):
        """A ``bnb.nn.Linear4bit`` as bytes: packed weight + quantization state, CUDA temporaries in forward."""

        def __init__(self, src: Any, weight_dtype: Any, keep_input: bool = False, cpu: bool = False) -> None:
            super().__init__()
            self.keep_input = keep_input
            self.cpu_target = cpu
            from ledgerspec.derivations.stack.bnb_storage import bnb4_bytes

            w = src.weight
            self.out_features, self.in_features = int(src.out_features), int(src.in_features)
            n = self.out_features * self.in_features
            storage = getattr(w, "quant_storage", torch.uint8)
            item = torch.empty((), dtype=storage).element_size()
            blocksize = int(getattr(w, "blocksize", 64))
            self.nested = bool(getattr(w, "compress_statistics", False))
            sizes = bnb4_bytes(n, self.nested, item, blocksize)
            meta = torch.device("meta")
            self.weight = torch.nn.Parameter(
                torch.empty((sizes.data // item, 1), dtype=storage, device=meta), requires_grad=False
            )
            self.bias = src.bias
            nblocks = -(-n // blocksize)
            self.register_buffer(
                "absmax", torch.empty(nblocks, dtype=torch.uint8 if self.nested else torch.float32, device=meta)
            )
            self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=meta))
            if self.nested:
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=meta))
                self.register_buffer("nested_absmax", torch.empty(-(-nblocks // 256), dtype=torch.float32, device=meta))
                self.register_buffer("nested_code", torch.empty(256, dtype=torch.float32, device=meta))
            self.compute_dtype = src.compute_dtype or weight_dtype
            self.weight_dtype = weight_dtype

        def forward(self, x: Any) -> Any:
            inp_dtype = x.dtype
            if x.dtype != self.compute_dtype:
                x = x.to(self.compute_dtype)
            if self.bias is not None and self.bias.dtype != x.dtype:
                # as Linear4bit.forward: the bias is cast for good (`bias.data = ...`) at the first forward, so
                # prepare_for_kbit_training's fp32 bias shrinks back to the compute dtype
                self.bias.data = self.bias.data.to(x.dtype)
            needs_grad = torch.is_grad_enabled() and (
                x.requires_grad or (self.bias is not None and self.bias.requires_grad)
            )
            if self.cpu_target and not needs_grad:
                return self._gemm_4bit(x).to(inp_dtype)
            return _Matmul4bit.apply(x, self.weight, self).to(inp_dtype)

        def _gemm_4bit(self, x: Any) -> Any:
            """No gradient needed, on the CPU: ``matmul_4bit`` calls bitsandbytes' ``gemm_4bit`` op (bitsandbytes 0.50
            autograd/_functions.py:453-489), one dispatcher call whose dequantized absmax and dense weight
            (backends/default/ops.py:323-342) are made below the dispatcher, where no tensor tracker sees them (nor
            PyTorch's MemTracker): the CPU measurement counts its output only, and so does the CPU estimate."""
            return torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)

    return Fake4bitLinear, _Matmul4bit


_CLASSES: tuple[Any, Any] | None = None


def fake_4bit_linear_class() -> Any:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _fake_4bit_classes()
    return _CLASSES[0]


def model_4bit_layers(model: Any, weight_dtype: Any, keep_input: bool = False, cpu: bool = False) -> int:
    """Replace every ``bnb.nn.Linear4bit`` in ``model`` (on meta) by :class:`Fake4bitLinear`; returns how many.
    ``keep_input``: the layers keep their input for backward (bitsandbytes < 0.43.2); ``cpu``: the CPU target, where a
    call that needs no gradient takes bitsandbytes' ``gemm_4bit`` op (its output is what a CPU measurement sees)."""
    quiet_bitsandbytes()
    import bitsandbytes as bnb

    cls = fake_4bit_linear_class()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                setattr(parent, name, cls(child, weight_dtype, keep_input, cpu))
                count += 1
    return count
