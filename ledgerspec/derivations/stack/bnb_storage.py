"""Exact bitsandbytes storage of a quantized weight (pure arithmetic, no torch).

The byte counts follow bitsandbytes 0.50 tensor by tensor (``functional.quantize_4bit``,
``functional.quantize_blockwise``, ``nn.Int8Params``); ``tests/derivations/resolve/test_resolve_exact.py`` checks
them against tensors that bitsandbytes really creates.

4-bit (nf4/fp4), one ``Params4bit`` of ``n`` logical elements:

- packed data: ``(n + 1) // (2 * s)`` elements of the ``quant_storage`` dtype (item size ``s``), i.e.
  two 4-bit codes per byte;
- ``quant_state.code``: the 16-entry fp32 lookup table (a copy per tensor: 64 B);
- without double quantization: ``absmax`` fp32, one per ``blocksize`` (64) elements;
- with double quantization: ``absmax`` uint8 (one per block) + ``offset`` (fp32 scalar) +
  ``state2.absmax`` fp32 (one per 256 blocks) + ``state2.code`` (the 256-entry fp32 dynamic map,
  copied per tensor: 1 KiB).

8-bit (LLM.int8, ``Linear8bitLt`` without fp16 weights): int8 data ``n`` bytes + ``SCB`` fp32 row
statistics, one per output row (``CB`` aliases the data).
"""

from __future__ import annotations

from dataclasses import dataclass

#: elements per block of the 4-bit quantization (bitsandbytes default, and what transformers uses)
BNB4_BLOCKSIZE = 64
#: block size of the second-level (double) quantization of the absmax constants
BNB4_NESTED_BLOCKSIZE = 256
#: fp32 entries of the nf4/fp4 lookup table
BNB4_CODE_ENTRIES = 16
#: fp32 entries of the 8-bit dynamic map used for nested absmax (and by 8-bit optimizers)
DYNAMIC_MAP_ENTRIES = 256
FP32 = 4


def _ceil_div(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class QuantizedBytes:
    """Bytes of one quantized weight, by tensor."""

    data: int
    absmax: int
    code: int
    nested_absmax: int = 0
    nested_code: int = 0
    offset: int = 0

    @property
    def constants(self) -> int:
        """Everything except the packed data (the quantization state)."""
        return self.absmax + self.code + self.nested_absmax + self.nested_code + self.offset

    @property
    def total(self) -> int:
        return self.data + self.constants


def bnb4_bytes(
    numel: int, double_quant: bool, storage_itemsize: int = 1, blocksize: int = BNB4_BLOCKSIZE
) -> QuantizedBytes:
    """Exact bytes of one bitsandbytes 4-bit weight of ``numel`` logical elements.

    >>> bnb4_bytes(4096 * 4096, double_quant=False).total
    9437248
    """
    if numel < 0 or storage_itemsize < 1 or blocksize < 1:
        raise ValueError("numel >= 0, storage_itemsize >= 1 and blocksize >= 1 are required")
    data = ((numel + 1) // (2 * storage_itemsize)) * storage_itemsize
    blocks = _ceil_div(numel, blocksize)
    code = BNB4_CODE_ENTRIES * FP32
    if not double_quant:
        return QuantizedBytes(data=data, absmax=blocks * FP32, code=code)
    return QuantizedBytes(
        data=data,
        absmax=blocks,
        code=code,
        nested_absmax=_ceil_div(blocks, BNB4_NESTED_BLOCKSIZE) * FP32,
        nested_code=DYNAMIC_MAP_ENTRIES * FP32,
        offset=FP32,
    )


def int8_bytes(out_features: int, in_features: int) -> QuantizedBytes:
    """Exact bytes of one LLM.int8 weight (``Int8Params``): int8 data plus fp32 row scales ``SCB``."""
    return QuantizedBytes(data=out_features * in_features, absmax=out_features * FP32, code=0)


__all__ = ["BNB4_BLOCKSIZE", "QuantizedBytes", "bnb4_bytes", "int8_bytes"]
