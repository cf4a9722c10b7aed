"""Exact optimizer state, tensor by tensor (pure arithmetic, no torch).

Each supported optimizer is described by how it allocates state for one parameter tensor, following
the library code (torch 2.13 ``torch.optim``, transformers ``Adafactor``, bitsandbytes 0.50
``Optimizer2State``/``Optimizer1State``):

- torch Adam/AdamW: ``exp_avg`` and ``exp_avg_sq`` are ``zeros_like(param)`` (bf16 params get bf16
  states); ``step`` is a host fp32 scalar, on the device only when ``fused`` or ``capturable``.
- torch SGD: no state without momentum; with momentum one ``momentum_buffer`` = a clone of the gradient.
- transformers Adafactor (``beta1=None``, the Trainer's default): a tensor with 2+ dims keeps a row and a
  column second-moment vector (``shape[:-1]`` and ``shape[:-2] + shape[-1:]``) in the gradient's dtype after
  the step's upcast (``grad.float()`` for fp16/bf16: fp32 states on bf16 weights); a vector keeps a full
  ``exp_avg_sq``; after the first step ``RMS`` is a 0-dim fp32 tensor per parameter.
- bitsandbytes 8-bit (blockwise): uint8 states like the parameter plus one fp32 ``absmax`` per 256
  elements per state; tensors under ``min_8bit_size`` (4096) elements keep fp32 states. The quantile maps
  (``dynamic``, and ``udynamic`` for the second Adam state: 256 fp32 each) are shared by all tensors and
  counted once. 32-bit variants keep fp32 states whatever the parameter dtype.
- Paged variants put each state buffer of a tensor with at least 1e5 elements in CUDA unified memory
  (``cudaMallocManaged``: counted in the figure, evictable to host under pressure); smaller buffers and
  the absmax vectors are ordinary device tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ledgerspec.contract.optimizers import OPTIMIZERS, OptimizerSpec, optimizer_spec

FP32 = 4
BNB_BLOCKSIZE = 256
BNB_PAGED_MIN_NUMEL = 100_000
DEFAULT_MIN_8BIT_SIZE = 4096
QMAP_BYTES = 256 * FP32


@dataclass(frozen=True)
class TensorShape:
    """One optimized parameter: its shape and the byte size of its dtype."""

    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class OptimizerState:
    """Optimizer state of a set of parameters, in bytes."""

    device: int = 0  # resident on the accelerator (includes paged)
    paged: int = 0  # the part of ``device`` held in unified memory (evictable to host)
    host: int = 0  # host-side tensors (torch's non-fused step scalars)
    shared: int = 0  # shared tables (bitsandbytes quantile maps), included in ``device``
    tensors_8bit: int = 0
    tensors_32bit: int = 0
    notes: list[str] = field(default_factory=list)


def _ceil_div(a: int, b: int) -> int:
    return -(a // -b)


def state_bytes(
    spec: OptimizerSpec, params: Iterable[TensorShape], min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
) -> OptimizerState:
    """Exact state bytes ``spec`` allocates for ``params`` after the first step.

    >>> state_bytes(OPTIMIZERS["adamw_torch"], [TensorShape((16, 4096), 4)]).device
    524288
    """
    out = OptimizerState()
    any_8bit = False
    for p in params:
        n = p.numel
        if spec.family == "adam":
            out.device += 2 * n * p.itemsize
            if spec.fused:
                out.device += FP32
            else:
                out.host += FP32
        elif spec.family == "sgd":
            out.device += spec.states * n * p.itemsize
        elif spec.family == "adafactor":
            size = max(p.itemsize, FP32)  # the step upcasts fp16/bf16 gradients (grad.float()); states .to(grad)
            if len(p.shape) >= 2:
                row = n // p.shape[-1]
                col = n // p.shape[-2]
                out.device += (row + col) * size
            else:
                out.device += n * size
            out.device += FP32  # state["RMS"]: a 0-dim fp32 tensor after the first step
        elif spec.family == "bnb":
            eight = spec.bits == 8 and n >= min_8bit_size
            if eight:
                any_8bit = True
                out.tensors_8bit += 1
                buf = n
                out.device += spec.states * (buf + _ceil_div(n, BNB_BLOCKSIZE) * FP32)
            else:
                out.tensors_32bit += 1
                buf = n * FP32
                out.device += spec.states * buf
            if spec.paged and n >= BNB_PAGED_MIN_NUMEL:
                out.paged += spec.states * buf
        else:  # pragma: no cover - the table above holds only these families
            raise ValueError(f"unknown optimizer family {spec.family!r}")
    if any_8bit:
        out.shared = spec.states * QMAP_BYTES
        out.device += out.shared
    return out


__all__ = ["OPTIMIZERS", "OptimizerSpec", "OptimizerState", "TensorShape", "optimizer_spec", "state_bytes"]
