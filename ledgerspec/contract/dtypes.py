"""dtype names as users write them, and their sizes in bytes (no torch needed)."""

from __future__ import annotations

_ALIASES: dict[str, tuple[str, int]] = {}
for _canon, _size, _names in (
    ("float32", 4, ("float32", "fp32", "float", "f32", "torch.float32", "torch.float")),
    ("float64", 8, ("float64", "fp64", "double", "torch.float64")),
    ("bfloat16", 2, ("bfloat16", "bf16", "torch.bfloat16")),
    ("float16", 2, ("float16", "fp16", "half", "torch.float16", "torch.half")),
    ("float8_e4m3fn", 1, ("float8_e4m3fn", "fp8", "float8", "torch.float8_e4m3fn")),
    ("float8_e5m2", 1, ("float8_e5m2", "torch.float8_e5m2")),
    ("int8", 1, ("int8", "torch.int8")),
    ("uint8", 1, ("uint8", "torch.uint8")),
):
    for _n in _names:
        _ALIASES[_n] = (_canon, _size)


def canonical(name: str) -> str | None:
    """``bf16`` -> ``bfloat16``; None for a name this table does not know (or ``mixed``)."""
    hit = _ALIASES.get(name.strip().lower())
    return hit[0] if hit else None


def itemsize(name: str) -> int | None:
    hit = _ALIASES.get(name.strip().lower())
    return hit[1] if hit else None
