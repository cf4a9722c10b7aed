"""``aten::_grouped_mm`` under fake tensors for every floating dtype its kernels take (issue 26).

Mixture-of-experts layers of transformers 5 multiply every expert at once with ``torch.nn.functional.grouped_mm``
(``transformers/integrations/moe.py``). torch 2.13's meta kernel of the op (``torch/_meta_registrations.py``,
``_meta_grouped_mm_common``, "Implementing all the checks from _grouped_mm_cuda()") refuses anything but bfloat16
("Expected inputs of BF16 type"), so an fp16 run (fp16 experts, fp16 autocast) or one whose preparation upcast the
experts to float32 could not be traced. The kernels take those dtypes: the CUDA kernel
(``aten/src/ATen/native/cuda/GroupedBlas.cpp``, ``_grouped_mm_cuda``) takes its CUTLASS fast path for bfloat16 and
``_grouped_mm_fallback`` (one ``mm`` per group into the output) otherwise, and the CPU kernel computes float16,
float32 and bfloat16 alike (``tests/derivations/estimate/test_grouped_mm.py`` runs it). Either path returns one
output tensor of the shape, dtype and strides ``_create_grouped_mm_output_tensor`` gives for the output dtype,
which is what :func:`grouped_mm_any_float` has the meta kernel return for float16 and float32 inputs of one
dtype. Anything else (bfloat16, mixed dtypes, integers) goes to torch's own meta kernel unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

#: the dtypes the kernels take beside bfloat16
OTHER_FLOATS = ("float16", "float32")


_LIB: Any = None


def grouped_mm_any_float() -> None:
    """From now on in this process, the meta kernel of ``aten::_grouped_mm`` accepts float16 and float32 inputs (see
    the module docstring). Once per process: FakeTensorMode keeps dispatching to the relaxed kernel even after the
    library that registered it is destroyed (seen with torch 2.13), so it is not presented as a scope. It changes
    nothing but the output of fake and meta tensors for dtypes torch's own meta kernel refuses and its kernels take."""
    global _LIB
    if _LIB is not None:
        return
    import torch
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    others = tuple(getattr(torch, name) for name in OTHER_FLOATS)

    def meta(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
        if mat_a.dtype in others and mat_b.dtype == mat_a.dtype and out_dtype in (None, mat_a.dtype):
            return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel"
        lib.impl("_grouped_mm", meta, "Meta")
    _LIB = lib


__all__ = ["OTHER_FLOATS", "grouped_mm_any_float"]
