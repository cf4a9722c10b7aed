"""Exact storage of weights quantized by libraries other than bitsandbytes (pure arithmetic, no torch).

Each function returns the bytes of one quantized weight, tensor by tensor, as the library holds it on the device
after loading (:class:`ledgerspec.derivations.stack.bnb_storage.QuantizedBytes`: ``data`` is the packed codes,
``absmax`` the scales, ``code`` the zero points or lookup table, ``offset`` an index). Biases stay separate
parameters in the loaded dtype and are counted as such by the census.

- **GPTQ** (``quant_method: gptq``; the ``QuantLinear`` of AutoGPTQ/GPTQModel that transformers loads through
  optimum): ``qweight`` int32 ``(in * bits / 32, out)``, ``qzeros`` int32 ``(groups, out * bits / 32)``, ``scales``
  ``(groups, out)`` in the model dtype (float16 as published), ``g_idx`` int32 ``(in,)``: the group of each input
  column, registered with and without ``desc_act`` (act-order only changes its values); ``groups =
  ceil(in / group_size)`` (one group when ``group_size`` is -1). Sources: AutoGPTQ
  ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``QuantLinear.__init__`` (``register_buffer`` of the four
  tensors), GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py`` ``PackableQuantLinear`` (the same four buffers).
- **AWQ** (``quant_method: awq``, ``version: gemm``; AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM``):
  ``qweight`` int32 ``(in, out * bits / 32)``, ``qzeros`` int32 ``(in / group_size, out * bits / 32)``, ``scales``
  ``(in / group_size, out)`` float16; no ``g_idx``.
- **MXFP4** (gpt-oss experts; transformers 5.24 ``integrations/mxfp4.py``): the expert weights as loaded for the
  triton kernels are the packed FP4 codes, two per byte (``Mxfp4GptOssExperts.gate_up_proj`` uint8
  ``(E, 2I, H/2)``, ``down_proj`` uint8 ``(E, H, I/2)``), one E8M0 scale byte per 32 values (the checkpoint's
  ``*_scales`` uint8 ``(E, rows, cols/32)``: ``Mxfp4Deserialize`` asserts ``blocks.shape[:-1] == scales.shape``),
  and the fp32 biases (parameters of the module, counted by the census). The triton kernels' swizzled scale layout
  may pad the scales on some GPUs: not modelled (unverified). ``dequantize=True`` (what transformers does on the
  CPU, without the kernels, and what training needs: its quantizer reports ``is_trainable`` false) holds the experts
  as dense parameters in the loaded dtype instead.
- **HQQ** (``hqq`` 0.2, ``HQQLinear`` with ``axis=1`` and the default ``4bit_u8`` packing): ``W_q`` uint8 with two
  4-bit codes per byte (``n / 2`` bytes for ``n`` weights; 8-bit: ``n``), and per group of ``group_size`` values
  one ``scale`` and one ``zero`` in the compute dtype (``quant_scale``/``quant_zero`` off, the 0.2 default). From
  the library's documented layout (``hqq/core/quantize.py``, ``Quantizer.quantize``/``pack``); not checked against
  real tensors here (hqq is not installed in the checked environment).
- **torchao NF4** (``torchao.dtypes.nf4tensor.NF4Tensor``, torchtune's QLoRA): ``quantized_data`` uint8 ``n / 2``,
  ``quantized_scalers`` int8 one per ``block_size`` (64) values, ``quantization_factor`` one per
  ``scaler_block_size`` (256) scalers and ``scaler_mean`` (a scalar), both in the original dtype, and the 16-entry
  ``nf4`` lookup table in the original dtype. From the documented layout (``to_nf4``, ``NF4Tensor.from_tensor``);
  not checked against real tensors here (torchao is not installed in the checked environment).
"""

from __future__ import annotations

from ledgerspec.derivations.stack.bnb_storage import QuantizedBytes

INT32 = 4
#: values per MXFP4 scale (the OCP microscaling block)
MXFP4_BLOCK = 32
#: torchao NF4 defaults (``to_nf4(tensor, block_size=64, scaler_block_size=256)``)
TORCHAO_NF4_BLOCK = 64
TORCHAO_NF4_SCALER_BLOCK = 256
NF4_ENTRIES = 16


def _ceil_div(a: int, b: int) -> int:
    return -(a // -b)


def _packed_int32(values: int, bits: int) -> int:
    """Bytes of ``values`` codes of ``bits`` packed into int32 words (32 / bits codes a word)."""
    per_word = 32 // bits
    return _ceil_div(values, per_word) * INT32


def gptq_bytes(
    in_features: int, out_features: int, bits: int, group_size: int, scale_itemsize: int = 2
) -> QuantizedBytes:
    """Exact bytes of one GPTQ ``QuantLinear`` (qweight, qzeros, scales, g_idx; the bias apart).

    >>> gptq_bytes(4096, 4096, 4, 128).total  # 8 MiB codes + 128 groups of scales/zeros + g_idx
    8732672
    """
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ packs 2, 3, 4 or 8 bits, got {bits}")
    groups = 1 if group_size in (-1, 0) else _ceil_div(in_features, group_size)
    qweight = _ceil_div(in_features * bits, 32) * out_features * INT32  # 3-bit codes straddle words: in * 3 / 32 rows
    qzeros = groups * _ceil_div(out_features * bits, 32) * INT32
    return QuantizedBytes(
        data=qweight,
        absmax=groups * out_features * scale_itemsize,
        code=qzeros,
        offset=in_features * INT32,  # g_idx
    )


def awq_bytes(
    in_features: int, out_features: int, bits: int, group_size: int, scale_itemsize: int = 2
) -> QuantizedBytes:
    """Exact bytes of one AWQ ``WQLinear_GEMM`` (qweight, qzeros, scales; the bias apart).

    >>> awq_bytes(4096, 4096, 4, 128).total
    8716288
    """
    if bits != 4:
        raise ValueError(f"AWQ GEMM packs 4-bit weights, got {bits}")
    groups = 1 if group_size in (-1, 0) else _ceil_div(in_features, group_size)
    return QuantizedBytes(
        data=in_features * _packed_int32(out_features, bits),
        absmax=groups * out_features * scale_itemsize,
        code=groups * _packed_int32(out_features, bits),
    )


def mxfp4_bytes(numel: int, rows: int) -> QuantizedBytes:
    """Exact bytes of one MXFP4 expert tensor of ``numel`` values in ``rows`` rows (the reduced dimension is
    ``numel / rows``, a multiple of 32): packed codes ``numel / 2`` and one scale byte per 32 values of a row."""
    cols = numel // rows
    return QuantizedBytes(data=numel // 2, absmax=rows * _ceil_div(cols, MXFP4_BLOCK), code=0)


def hqq_bytes(numel: int, bits: int, group_size: int, meta_itemsize: int = 2) -> QuantizedBytes:
    """Bytes of one HQQ weight (documented layout, see the module docstring): packed codes, scale and zero per group."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"HQQ packs 1, 2, 3, 4 or 8 bits, got {bits}")
    groups = _ceil_div(numel, group_size)
    if bits == 3:  # 3bit_32: ten 3-bit codes per int32
        data = _ceil_div(numel, 10) * INT32
    else:
        data = _ceil_div(numel * bits, 8)
    return QuantizedBytes(data=data, absmax=groups * meta_itemsize, code=groups * meta_itemsize)


def torchao_nf4_bytes(
    numel: int,
    itemsize: int = 2,
    block_size: int = TORCHAO_NF4_BLOCK,
    scaler_block_size: int = TORCHAO_NF4_SCALER_BLOCK,
) -> QuantizedBytes:
    """Bytes of one torchao ``NF4Tensor`` (documented layout, see the module docstring)."""
    scalers = _ceil_div(numel, block_size)
    factors = _ceil_div(scalers, scaler_block_size)
    return QuantizedBytes(
        data=numel // 2,
        absmax=scalers,  # int8 quantized scalers
        code=NF4_ENTRIES * itemsize,
        nested_absmax=factors * itemsize,
        offset=itemsize,  # scaler_mean
    )


__all__ = ["awq_bytes", "gptq_bytes", "hqq_bytes", "mxfp4_bytes", "torchao_nf4_bytes"]
