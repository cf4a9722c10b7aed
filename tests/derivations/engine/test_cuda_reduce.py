"""The port of PyTorch's CUDA reduction staging (``ledgerspec/derivations/engine/cuda_reduce.py``) against figures
derived without it: Liger-Kernel's published rms_norm memory rows less what their tensors hold (shapes x bytes), and
``setReduceConfig``'s rules (PyTorch 2.4.1 ``aten/src/ATen/native/cuda/Reduce.cuh``) followed by hand for one
shape."""

from __future__ import annotations

import csv
import json

import pytest

from ledgerspec.derivations.engine import cuda_reduce
from tests.support import REPO_ROOT

PUBLISHED = REPO_ROOT / "benchmarks" / "published-liger" / "liger_memory.csv"
MiB = 2**20


def _rms_norm_rows() -> list[tuple[int, int, float]]:
    """(M, H, published MiB) of the liger rms_norm rows (liger-kernel 0.2.1, one A100-SXM4-80GB)."""
    out = []
    with PUBLISHED.open(newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if (r["kernel_name"], r["kernel_provider"], r["metric_name"]) == ("rms_norm", "liger", "memory"):
                out.append(
                    (json.loads(r["extra_benchmark_config_str"])["M"], int(r["x_value"]), float(r["y_value_50"]))
                )
    return out


@pytest.mark.parametrize(("m", "h", "published"), _rms_norm_rows(), ids=lambda v: str(v))
def test_the_staging_is_what_the_published_rms_norm_rows_hold_beyond_their_tensors(
    m: int, h: int, published: float
) -> None:
    """benchmark_rms_norm.py at b5672a1 keeps x, dy (bf16 (M, H)) and, in the measured call, y (bf16 (M, H)); the
    0.2.1 backward adds dW (M, H) in W's dtype, float32 (ops/rms_norm.py:229-232), its sum (H float32), and the
    small tensors: two float32 weights (H each), the weight's .grad (H), the reciprocal RMS (M float32). What is left
    of the published peak is the staging buffer plus the semaphores, rounded up to the caching allocator's 512-B
    blocks."""
    small = 2 * h * 4 + h * 4 + h * 4 + m * 4
    left = round(published * MiB) - 3 * m * h * 2 - m * h * 4 - small
    staging = cuda_reduce.rows_sum_staging(m, h, "float32", cuda_reduce.A100)
    assert staging.semaphores > 0
    assert staging.buffer + -(-staging.semaphores // 512) * 512 == left


def test_one_shape_by_hand() -> None:
    """x.sum(dim=0) of a float32 (2048, 1024) tensor on an A100, Reduce.cuh (2.4.1) followed by hand:
    rows are reduced, not the fastest-moving dimension (strides 4096 B vs 4 B): dim0 = 1024 outputs, dim1 = 2048
    inputs; Case 2, output_vec_size 4 (aligned base, 1024 % 4, stride 1024 % 4): dim0 = 256; max threads 512 / 4 = 128:
    block 32 x 4; output split by 32 lanes (step_output 32); values per thread 2048 >= 4 * 16: inputs split across 4
    warps (step_input 4, 512 values each); blocks per SM 2048 / 128 = 16, target grid 108 * 16 = 1728, grid.x =
    ceil(1024 / 4 / 32) = 8 <= 1728 and 512 >= 256: ctas_per_output = max(min(ceil(1728 / 8), ceil(512 / 16)),
    ceil(512 / 256)) = max(min(216, 32), 2) = 32. Staging: 4 B x 1024 outputs x 32 ctas x (32 lanes x 4 vec) =
    16 MiB; semaphores 4 B x 8."""
    config = cuda_reduce.set_reduce_config(cuda_reduce.rows_layout(2048, 1024, 4), cuda_reduce.A100, 4, 4)
    assert (config.output_vec_size, config.block_width, config.block_height) == (4, 32, 4)
    assert (config.step_output, config.step_input, config.ctas_per_output) == (32, 4 * 32, 32)
    assert config.grid() == (8, 32)
    assert (config.global_memory_size(), config.semaphore_size()) == (16 * MiB, 32)


@pytest.mark.parametrize("device", [cuda_reduce.A100, cuda_reduce.H100], ids=["A100", "H100"])
def test_the_per_sm_partial_sums_of_later_liger_releases_take_no_staging(device: cuda_reduce.CudaDevice) -> None:
    """liger-kernel >= 0.4.0 sums (SMs, H) float32 partials: 108 or 132 rows. Inputs per output 108/132 >= 4 x 16,
    so the four warps split them: 27/33 values per thread, under 256: no split across blocks."""
    for h in (1024, 4096, 8192):
        assert cuda_reduce.rows_sum_staging(device.sm_count, h, "float32", device).total == 0


def test_a_bfloat16_sum_stages_float32_partials() -> None:
    """A bf16 sum accumulates in float (arg_t): the same configuration as float32 for an aligned (2048, 1024) bf16
    tensor (2-byte strides still divisible by the vector of 4), the staging in 4-byte elements: 16 MiB."""
    assert cuda_reduce.rows_sum_staging(2048, 1024, "bfloat16", cuda_reduce.A100).buffer == 16 * MiB


def test_the_h100_splits_over_its_132_sms() -> None:
    """(2048, 4096) float32 on 132 SMs: grid.x = 4096 / 4 / 32 = 32, target 132 x 16 = 2112 blocks: ceil(2112 / 32) =
    66 > ceil(512 / 16) = 32, so 32 ctas: 4 B x 4096 x 32 x 128 = 64 MiB, as on the A100 (whose 54 ctas were also
    capped at 32)."""
    assert cuda_reduce.rows_sum_staging(2048, 4096, "float32", cuda_reduce.H100).buffer == 64 * MiB


def test_one_row_or_column_is_not_followed() -> None:
    assert cuda_reduce.rows_sum_staging(1, 4096, "float32", cuda_reduce.A100).total == 0
    assert cuda_reduce.rows_sum_staging(4096, 1, "float32", cuda_reduce.A100).total == 0
