"""The pure storage rules (no torch): bitsandbytes 4-bit/8-bit weights and optimizer state, by hand.

The exact equality with real tensors is in ``test_resolve_exact.py``; here the formulas are checked
against hand-computed numbers for real model shapes, so a regression shows where it is.
"""

from __future__ import annotations

import pytest

from ledgerspec.derivations.stack.bnb_storage import bnb4_bytes, int8_bytes
from ledgerspec.derivations.stack.optimizer_state import OPTIMIZERS, TensorShape, optimizer_spec, state_bytes

N = 4096 * 4096  # a Llama-2-7b q_proj weight


@pytest.mark.parametrize(
    ("double_quant", "storage", "expected"),
    [
        # packed N/2 bytes + fp32 absmax per 64 + 16-entry fp32 code
        (False, 1, N // 2 + (N // 64) * 4 + 64),
        # packed + uint8 absmax per 64 + fp32 absmax per 256 blocks + 1 KiB map + 64 B code + 4 B offset
        (True, 1, N // 2 + N // 64 + (N // 64 // 256) * 4 + 1024 + 64 + 4),
        (True, 2, N // 2 + N // 64 + (N // 64 // 256) * 4 + 1024 + 64 + 4),  # bf16 storage: same bytes, even N
    ],
)
def test_bnb4_bytes(double_quant: bool, storage: int, expected: int) -> None:
    assert bnb4_bytes(N, double_quant, storage).total == expected


def test_bnb4_rounds_blocks_and_storage_up_and_down_like_bitsandbytes() -> None:
    q = bnb4_bytes(65, double_quant=False, storage_itemsize=2)
    assert q.data == (66 // 4) * 2  # (n + 1) // (2 * itemsize) elements of the storage dtype
    assert q.absmax == 2 * 4  # ceil(65 / 64) blocks


def test_int8_bytes() -> None:
    assert int8_bytes(11008, 4096).total == 11008 * 4096 + 11008 * 4


LORA_A = TensorShape((16, 4096), 4)  # 65,536 elements, fp32
TINY = TensorShape((16,), 4)  # under min_8bit_size


@pytest.mark.parametrize(
    ("name", "expected_device"),
    [
        ("adamw_torch", 2 * 65536 * 4),  # step scalar on the host
        ("adamw_torch_fused", 2 * 65536 * 4 + 4),
        ("sgd", 0),
        ("sgd_momentum", 65536 * 4),
        ("adafactor", (16 + 4096) * 4 + 4),
        ("adamw_8bit", 2 * (65536 + 256 * 4) + 2 * 1024),  # + shared dynamic/udynamic maps
        ("paged_adamw_32bit", 2 * 65536 * 4),
        ("lion_8bit", 65536 + 256 * 4 + 1024),
    ],
)
def test_state_bytes(name: str, expected_device: int) -> None:
    spec = optimizer_spec(name)
    assert spec is not None
    assert state_bytes(spec, [LORA_A]).device == expected_device


def test_bnb_8bit_keeps_small_tensors_in_fp32_and_paged_marks_large_buffers() -> None:
    spec = OPTIMIZERS["paged_adamw_8bit"]
    small = state_bytes(spec, [TINY])
    assert small.device == 2 * 16 * 4 and small.shared == 0 and small.tensors_32bit == 1
    big = state_bytes(spec, [TensorShape((64, 4096), 4)])  # 262,144 >= 1e5 elements: paged
    assert big.paged == 2 * 262144


def test_adam_state_follows_the_param_dtype() -> None:
    assert state_bytes(OPTIMIZERS["adamw_torch"], [TensorShape((16, 4096), 2)]).device == 2 * 65536 * 2


def test_unknown_optimizer_is_none() -> None:
    assert optimizer_spec("adamw_magic") is None
    assert optimizer_spec(" AdamW_Torch ") is OPTIMIZERS["adamw_torch"]
