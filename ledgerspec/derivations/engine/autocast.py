"""Mixed precision as the declared device runs it: ``torch.autocast``, real or emulated.

``transformers.Trainer`` with ``bf16=True``/``fp16=True`` runs every forward under ``torch.autocast`` (accelerate
wraps the model's ``forward``; see :mod:`ledgerspec.derivations.engine.step`). Autocast changes memory: each op of
its *lower precision* list casts its floating inputs to bf16/fp16 first (copies that autograd may keep for
backward; the casts of fp32 trainable leaves are cached for the whole forward), each op of its *fp32* list casts
its inputs up to fp32, and *promote* ops cast to the widest input type.

On a real device the real ``torch.autocast`` runs (``measure``). The estimate runs on CPU fake tensors, where
``torch.autocast("cuda")`` does nothing (it casts CUDA tensors only, and is disabled without CUDA): for the cuda
target :class:`EmulatedAutocast` applies the **CUDA** policy to CPU tensors at the same place the real one works,
the Autocast dispatch key, above autograd: it enables CPU autocast and registers, for the ``AutocastCPU`` key, a
Python kernel per op of the CUDA lists (:data:`CUDA_POLICY`) that casts as ``autocast_mode.h``'s ``WrapFunction_``
does and redispatches below autocast, plus a pass-through kernel for the ops only the CPU list has. The cache of
cast fp32 leaves follows ``cached_cast`` (``autocast_mode.cpp``): the lower-precision copy of an fp32 leaf that
requires grad is made once per autocast region and held until the region ends.

The same class with :data:`CPU_POLICY` reproduces the real CPU autocast; tests check that it allocates exactly
what the real one does, which is what makes the CUDA emulation trustworthy. The op lists are those of the
installed PyTorch (2.13), from ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``) and ``autocast_mode.cpp`` (the ``AutocastCPU`` registrations); a test compares their op sets
with the kernels the installed torch registered (``torch._C._dispatch_dump_table``) and probes the CUDA policies
on fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

LOWER = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"

_LOWER_CUDA = (
    "_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
    "conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm "
    "baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution "
    "cudnn_convolution_transpose"
)
_FP32_CUDA = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
    "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim "
    "nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
    "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits "
    "dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)
_FP32_SET_OPT_DTYPE_CUDA = (
    "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
    "linalg_matrix_norm.str_ord sum sum.dim_IntList"
)
_FP32_APPEND_DTYPE_CUDA = "norm.Scalar norm.ScalarOpt_dim"
_PROMOTE_CUDA = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"

#: ``aten`` op overload -> autocast policy on CUDA (``AutocastCUDA``), PyTorch 2.13
CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER_CUDA.split(), LOWER),
    **dict.fromkeys(_FP32_CUDA.split(), FP32),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE_CUDA.split(), FP32_SET_OPT_DTYPE),
    **dict.fromkeys(_FP32_APPEND_DTYPE_CUDA.split(), FP32_APPEND_DTYPE),
    **dict.fromkeys(_PROMOTE_CUDA.split(), PROMOTE),
}
#: ops whose CUDA autocast kernel refuses to run (``binary_cross_entropy_banned``)
CUDA_BANNED = ("binary_cross_entropy",)

_LOWER_CPU = (
    "conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm "
    "_addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer conv_transpose1d "
    "conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention _native_multi_head_attention"
)
_FP32_CPU = (
    "avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile quantile.scalar nanquantile "
    "nanquantile.scalar stft stft.center cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace "
    "view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d "
    "max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d "
    "replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss "
    "poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss "
    "triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss "
    "binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft "
    "fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank "
    "linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float "
    "linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product "
    "linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve "
    "fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr "
    "linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"
)
_PROMOTE_CPU = "stack cat index_copy"

#: ``aten`` op overload -> autocast policy on the CPU (``AutocastCPU``), PyTorch 2.13
CPU_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER_CPU.split(), LOWER),
    **dict.fromkeys(_FP32_CPU.split(), FP32),
    **dict.fromkeys(_PROMOTE_CPU.split(), PROMOTE),
}

POLICIES = {"cuda": CUDA_POLICY, "cpu": CPU_POLICY}


def _op(name: str) -> Any:
    """``torch.ops.aten.<op>.<overload>`` of a table key (``mm`` -> ``aten.mm.default``)."""
    import torch

    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


class EmulatedAutocast:
    """The autocast lists of another device (``policy``) for CPU (fake) tensors, while this context is open.

    It changes what CPU autocast does, not when: inside it, every ``torch.autocast("cpu", dtype)`` region (the
    step's forward, and the recomputation ``torch.utils.checkpoint`` runs under the autocast state it saved) casts
    as ``policy`` says. The cache of cast fp32 leaves is emptied when the outermost autocast region ends, exactly
    when the real one is (``torch.clear_autocast_cache``, which autocast's ``__exit__`` calls at nesting 0).
    """

    def __init__(self, policy: dict[str, str], dtype: Any) -> None:
        self.policy = policy
        self.dtype = dtype
        self._cache: dict[int, tuple[Any, Any]] = {}
        self._lib: Any = None
        self._original_clear: Any = None

    # -- casting, as autocast_mode.h ---------------------------------------------------------------------------------
    @staticmethod
    def _eligible(t: Any) -> bool:
        import torch

        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def _cast(self, to: Any, t: Any) -> Any:
        """``cached_cast``: eligible tensors (and lists of them) cast to ``to``; fp32 leaves that require grad are
        cast once per region (``can_try_cache``)."""
        import torch

        if isinstance(t, list | tuple):
            return type(t)(self._cast(to, x) for x in t)
        if not self._eligible(t) or t.dtype == to:
            return t
        if (
            torch.is_autocast_cache_enabled()
            and to == torch.get_autocast_dtype("cpu")
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
        ):
            hit = self._cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            casted = t.to(to)
            self._cache[id(t)] = (weakref.ref(t), casted)
            return casted
        return t.to(to)

    def _promote_type(self, args: Any) -> Any:
        import torch

        current = torch.get_autocast_dtype("cpu")
        for a in _tensors(args):
            if self._eligible(a) and (current == torch.float32 or a.dtype == torch.float32):
                current = torch.float32
        return current

    def _kernel(self, name: str, policy: str | None) -> Any:
        import torch

        op = _op(name)
        excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if policy in (LOWER, FP32, PROMOTE):
                to = (
                    torch.get_autocast_dtype("cpu")
                    if policy == LOWER
                    else torch.float32
                    if policy == FP32
                    else self._promote_type((args, list(kwargs.values())))
                )
                args = self._cast(to, args)
                kwargs = {k: self._cast(to, v) for k, v in kwargs.items()}
            elif policy == FP32_SET_OPT_DTYPE and args and self._eligible(args[0]):
                if dtype_index is not None and dtype_index < len(args):
                    if args[dtype_index] is None:
                        args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == FP32_APPEND_DTYPE:  # norm.Scalar / norm.ScalarOpt_dim -> the dtype-taking overload
                out = torch.float32 if args and self._eligible(args[0]) else args[0].dtype
                with torch._C._ExcludeDispatchKeyGuard(excluded):
                    if name == "norm.Scalar":
                        return torch.ops.aten.norm.ScalarOpt_dtype(args[0], args[1] if len(args) > 1 else 2, dtype=out)
                    return torch.ops.aten.norm.ScalarOpt_dim_dtype(*args, dtype=out, **kwargs)
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return op(*args, **kwargs)

        return kernel

    # -- the scope -------------------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedAutocast:
        import torch

        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel"
            for name in sorted(set(self.policy) | set(CPU_POLICY)):
                try:
                    _op(name)
                except (AttributeError, RuntimeError):
                    continue  # an op this torch does not have
                lib.impl(name, self._kernel(name, self.policy.get(name)), "AutocastCPU")
        self._lib = lib
        self._original_clear = torch.clear_autocast_cache

        def clear() -> None:
            self._cache.clear()
            self._original_clear()

        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        self._cache.clear()
        if self._original_clear is not None:
            torch.clear_autocast_cache = self._original_clear
            self._original_clear = None
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


def _tensors(args: Any) -> Iterator[Any]:
    import torch

    if isinstance(args, torch.Tensor):
        yield args
    elif isinstance(args, list | tuple):
        for a in args:
            yield from _tensors(a)


def autocast_region(dtype_name: str | None, device: str) -> Any:
    """The region the training forward runs in: nothing without mixed precision, else ``torch.autocast`` on
    ``device`` (on CPU tensors under an :class:`EmulatedAutocast` scope it casts as the emulated device does)."""
    if dtype_name is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device, dtype=getattr(torch, dtype_name))


def enabled_dtype() -> Any:
    """The autocast dtype active for CPU tensors now (real or emulated), else None."""
    import torch

    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


__all__ = [
    "CPU_POLICY",
    "CUDA_POLICY",
    "FP32",
    "LOWER",
    "PROMOTE",
    "EmulatedAutocast",
    "autocast_region",
    "enabled_dtype",
]
