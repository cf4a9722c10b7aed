"""What the declared CUDA attention kernel keeps in memory, modelled for a trace on the CPU.

During a fake-tensor trace on the CPU, ``scaled_dot_product_attention`` would pick a CPU kernel, whose
memory is not what the GPU kernel uses. :func:`cuda_attention` registers one attention function per
declared implementation in transformers' ``AttentionInterface`` (and the matching mask function in
``AttentionMaskInterface``) and points every config of the model at it for the duration of the trace.
The function reproduces the memory the CUDA kernel allocates, tensor by tensor:

- ``eager``: plain PyTorch ops, identical on every device: the CPU trace is already exact (scores
  batch x heads x seq^2 in the compute dtype, the fp32 softmax and its cast, the dropout mask); no
  replacement.
- ``sdpa``: transformers' ``sdpa_attention_forward`` logic is kept (``repeat_kv`` unless CUDA can use
  ``enable_gqa``: no mask and head dim <= 256). Then PyTorch's CUDA kernel choice (priority flash >
  memory-efficient > math) is modelled: **flash** for fp16/bf16, no explicit mask, head dim <= 256;
  **memory-efficient** with an explicit mask, or fp32, when key/value are not grouped; **math**
  otherwise (scores materialised, as eager).
- ``flash_attention_2`` (also 3): the FlashAttention-2 kernel, GQA native (no ``repeat_kv``).

Flash (SDPA and FlashAttention-2 share ``mha_fwd``/``mha_bwd``): forward keeps q, k, v (saved by
autograd), the output ``(b, s, h, d)`` and the log-sum-exp ``(b, h, s)`` fp32; backward allocates
dq, dk, dv, ``softmax_d`` ``(b, h, round128(s))`` fp32, ``dq_accum`` ``(b, round128(s), h, round32(d))``
fp32 and, for GQA, ``dk_expanded``/``dv_expanded`` ``(b, s, h, d)`` (flash_api.cpp ``mha_bwd``).
Memory-efficient: the log-sum-exp is padded to a multiple of 32 along the sequence; with a mask, the
additive bias PyTorch builds from it in every call (``(b, 1, s, s)`` in the query dtype, key dimension
padded to a multiple of 8) is saved for backward; backward allocates dq, dk, dv and one fp32 ``(b, s, h, d)``
accumulator (an approximation of the kernel's workspace).

A padded batch (the workload's padding mask) reaches these functions as transformers' 4-D boolean mask
(``sdpa``: not all ones, so no ``is_causal`` skip: memory-efficient kernel, ``repeat_kv``) or, for
FlashAttention, as the 2-D mask of its varlen path, which is not modelled: the estimate does not pass the
mask for ``flash_attention_*`` (padded rows as full rows, see ``ledgerspec.derivations.estimate.estimator``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: the implementations this module knows; anything else is refused (measure it instead)
EAGER = "eager"
SDPA = "sdpa"
FLASH2 = "flash_attention_2"
FLASH3 = "flash_attention_3"
KNOWN = (EAGER, SDPA, FLASH2, FLASH3)
_KEY = "ledgerspec_model_"


@dataclass(frozen=True)
class KernelChoice:
    """Which CUDA kernel an attention call would run, and why."""

    kernel: str  # flash | efficient | math | eager
    repeat_kv: bool
    reason: str


def method_text(implementation: str) -> str:
    """One sentence for the ``method`` string: how attention memory was modelled."""
    if implementation == EAGER:
        return (
            "attention: eager, traced as is (batch x heads x seq^2 scores, fp32 softmax, dropout mask "
            "materialised on every device)"
        )
    if implementation == SDPA:
        return (
            "attention: SDPA modelled as the CUDA kernel PyTorch picks (flash for fp16/bf16 without a mask: "
            "output + fp32 log-sum-exp saved, flash_api mha_bwd buffers in backward; memory-efficient with a "
            "mask or fp32; math otherwise)"
        )
    return (
        f"attention: {implementation} modelled as FlashAttention-2 (output + fp32 log-sum-exp saved; "
        "dq_accum/softmax_d fp32 and GQA dk/dv expansion in backward)"
    )


def choose_sdpa_kernel(dtype: Any, head_dim: int, has_mask: bool, grouped: bool, dropout: float) -> KernelChoice:
    """PyTorch's CUDA SDPA choice (flash > memory-efficient > math) for a training call.

    transformers passes ``enable_gqa=True`` only without a mask and with head dim <= 256 on CUDA;
    otherwise it repeats key/value heads first (``repeat_kv``).
    """
    import torch

    gqa_native = grouped and not has_mask and head_dim <= 256
    repeat = grouped and not gqa_native
    half = dtype in (torch.float16, torch.bfloat16)
    if half and not has_mask and head_dim <= 256:
        return KernelChoice("flash", repeat, "fp16/bf16, no mask, head dim <= 256")
    if not gqa_native:
        why = "an explicit mask" if has_mask else "fp32 inputs" if not half else f"head dim {head_dim}"
        return KernelChoice("efficient", repeat, why)
    return KernelChoice("math", repeat, "grouped heads without the flash kernel")


def _round(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def _fused_function() -> Any:
    """The autograd function standing for a fused CUDA attention kernel (built lazily: torch)."""
    import torch

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, kernel: str, bias: Any = None) -> Any:
            # q: (b, h, s, d); k, v: (b, hk, s_k, d) - the layout transformers hands over; bias: the additive
            # mask the memory-efficient kernel reads (saved for its backward, as autograd saves ``attn_bias``)
            b, h, s, _ = q.shape
            out = torch.empty((b, s, h, v.shape[-1]), dtype=q.dtype, device=q.device)
            lse_len = _round(s, 32) if kernel == "efficient" else s
            lse = torch.empty((b, h, lse_len), dtype=torch.float32, device=q.device)
            ctx.kernel = kernel
            if bias is None:
                ctx.save_for_backward(q, k, v, out, lse)
            else:
                ctx.save_for_backward(q, k, v, out, lse, bias)
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            q, k, v = ctx.saved_tensors[:3]
            b, h, s, d = q.shape
            hk, s_k = k.shape[1], k.shape[2]
            dq = torch.empty_like(q)
            dk = torch.empty_like(k)
            dv = torch.empty_like(v)
            if ctx.kernel == "cpu_flash":
                pass  # the CPU kernel's scratch buffers are allocated inside the kernel, unseen by any tracker
            elif ctx.kernel == "flash":
                s_r = _round(s, 128)
                d_r = _round(d, 32) if d <= 128 else _round(d, 64)
                softmax_d = torch.empty((b, h, s_r), dtype=torch.float32, device=q.device)
                dq_accum = torch.empty((b, s_r, h, d_r), dtype=torch.float32, device=q.device)
                if hk != h:
                    dk_expanded = torch.empty((b, s_k, h, d), dtype=q.dtype, device=q.device)
                    dv_expanded = torch.empty((b, s_k, h, v.shape[-1]), dtype=q.dtype, device=q.device)
                    del dk_expanded, dv_expanded
                del softmax_d, dq_accum
            else:
                accum = torch.empty((b, s, h, d), dtype=torch.float32, device=q.device)
                del accum
            return dq, dk, dv, None, None

    return FusedAttention


_FUSED: Any = None


def _fused() -> Any:
    global _FUSED
    if _FUSED is None:
        _FUSED = _fused_function()
    return _FUSED


def _math_attention(module: Any, q: Any, k: Any, v: Any, mask: Any, dropout: float, scaling: float | None) -> Any:
    """SDPA's math kernel: the same tensors eager attention materialises (scores, softmax, dropout)."""
    import torch

    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores + mask if mask.dtype != torch.bool else scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def _sdpa_model(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    from transformers.integrations.sdpa_attention import repeat_kv

    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention(
            "sdpa does not support attention logit soft-capping (e.g. Gemma2): transformers "
            "raises on it; declare eager or flash_attention_2"
        )
    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedAttention("sdpa with a position bias / attention sinks is not modelled")
    groups = getattr(module, "num_key_value_groups", 1)
    choice = choose_sdpa_kernel(query.dtype, query.shape[-1], attention_mask is not None, groups > 1, dropout)
    if choice.repeat_kv:
        key = repeat_kv(key, groups)
        value = repeat_kv(value, groups)
    if choice.kernel == "math":
        if groups > 1 and not choice.repeat_kv:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        return _math_attention(module, query, key, value, attention_mask, dropout, scaling), None
    if attention_mask is None:
        return _fused().apply(query, key, value, choice.kernel), None
    return _fused().apply(query, key, value, choice.kernel, _efficient_bias(attention_mask, query, key)), None


#: the memory-efficient kernel wants its bias rows aligned to this many elements (attention.cpp ``preprocess_mask``)
_MEM_EFF_ALIGNMENT = 8


def _efficient_bias(mask: Any, query: Any, key: Any) -> Any:
    """The additive bias PyTorch hands the memory-efficient kernel, allocated as attention.cpp does per call.

    ``convert_boolean_attn_mask``: a boolean mask becomes ``where(mask, 0, -inf)`` in the query dtype (a new
    ``(b, 1, q, k)`` tensor in every attention call: transformers builds the boolean mask once per forward);
    ``preprocess_mask``: unless every stride but the last is a multiple of 8 elements, the bias is padded along
    the key dimension and sliced back (a second, padded copy). ``_scaled_dot_product_efficient_attention`` saves
    it for backward, so it is held from each layer's forward to its backward.
    """
    import torch

    bias = mask
    if mask.dtype == torch.bool:
        neg_inf = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device)
        bias = torch.where(mask, 0.0, neg_inf)
        del neg_inf
    aligned = bias.stride(-1) == 1 and all(bias.stride(i) % _MEM_EFF_ALIGNMENT == 0 for i in range(bias.dim() - 1))
    if not aligned:
        last = bias.shape[-1]
        bias = torch.nn.functional.pad(bias, (0, _MEM_EFF_ALIGNMENT - last % _MEM_EFF_ALIGNMENT))[..., :last]
    return bias


def _sdpa_cpu_model(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """SDPA as the CPU runs it (target cpu, for checks against ``measure --device cpu``): PyTorch's CPU flash
    kernel keeps the output and an fp32 log-sum-exp; transformers repeats k/v only when a mask is given."""
    from transformers.integrations.sdpa_attention import repeat_kv

    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention(
            "sdpa does not support attention logit soft-capping (e.g. Gemma2): transformers "
            "raises on it; declare eager or flash_attention_2"
        )
    if attention_mask is not None:  # with a mask the fake dispatch takes the same (math) path as the CPU
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and query.shape[-1] > 256:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return _fused().apply(query, key, value, "cpu_flash"), None


def _flash_model(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    if attention_mask is not None and attention_mask.dim() == 2:
        raise UnsupportedAttention("flash attention with a padding mask (varlen unpadding) is not modelled")
    return _fused().apply(query, key, value, "flash"), None


def _fused_under_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An attention model run as the one fused op it stands for, under autocast (real or emulated,
    :mod:`ledgerspec.derivations.engine.autocast`): ``scaled_dot_product_attention`` is on autocast's lower-precision
    list, so its floating inputs (query, key, value, a float mask) are cast to the autocast dtype first; transformers'
    FlashAttention path casts fp32 query/key/value to it too. Inside, the model's own ops run without autocast (the
    fused kernel computes in its input dtype). Without autocast the model runs as it is."""
    import functools

    @functools.wraps(fn)
    def wrapped(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        if not torch.is_autocast_enabled("cpu"):
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        low = torch.get_autocast_dtype("cpu")

        def cast(t: Any) -> Any:
            eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (low, torch.float64)
            return t.to(low) if eligible else t

        query, key, value, attention_mask = cast(query), cast(key), cast(value), cast(attention_mask)
        with torch.autocast("cpu", enabled=False):
            return fn(module, query, key, value, attention_mask, *args, **kwargs)

    return wrapped


class UnsupportedAttention(Exception):
    """The declared attention cannot be modelled faithfully; the caller turns it into a LedgerspecError."""


def _registry() -> tuple[Any, Any]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _configs(model: Any) -> list[Any]:
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen[id(cfg)] = cfg
            for name in getattr(cfg, "sub_configs", {}) or {}:
                sub = getattr(cfg, name, None)
                if isinstance(sub, PretrainedConfig):
                    seen[id(sub)] = sub
    return list(seen.values())


@contextlib.contextmanager
def cuda_attention(model: Any, implementation: str, target: str = "cuda") -> Iterator[str]:
    """Route every attention call of ``model`` to the memory model of ``implementation`` on ``target``.

    Yields the registry key in use. ``eager`` is left alone (already device-independent). ``target="cpu"``
    models PyTorch's CPU SDPA kernel instead (the fake-tensor trace would otherwise take the math path).
    """
    if implementation not in KNOWN:
        raise UnsupportedAttention(
            f"attention implementation {implementation!r} is not modelled (known: {', '.join(KNOWN)})"
        )
    if implementation == EAGER:
        yield EAGER
        return
    if target == "cpu" and implementation != SDPA:
        raise UnsupportedAttention(f"{implementation} does not run on the CPU")
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    attn, masks = _registry()
    key = _KEY + implementation + ("_cpu" if target == "cpu" else "")
    fn: Callable[..., Any] = (
        (_sdpa_cpu_model if target == "cpu" else _sdpa_model) if implementation == SDPA else _flash_model
    )
    attn.register(key, _fused_under_autocast(fn))
    masks.register(key, sdpa_mask if implementation == SDPA else flash_attention_mask)
    configs = _configs(model)
    before = [cfg._attn_implementation for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = key
        yield key
    finally:
        for cfg, old in zip(configs, before, strict=True):
            cfg._attn_implementation = old
