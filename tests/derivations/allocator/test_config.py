"""``PYTORCH_CUDA_ALLOC_CONF`` as torch 2.13 parses it.

Expected outcomes come from PyTorch: its own tests (``tests/data/allocator/pytorch-test_cuda-expectations.json``,
test/test_cuda.py) and the parser read line by line (``c10/core/AllocatorConfig.h`` of the 2.13 wheel for the
tokenizer; ``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs`` for the keys).
"""

from __future__ import annotations

import json

import pytest

from ledgerspec.derivations.allocator.config import SIZE_MAX, AllocatorConfig, AllocatorConfigError, MiB, tokenize
from tests.support import TESTS

EXPECTATIONS = json.loads((TESTS / "data" / "allocator" / "pytorch-test_cuda-expectations.json").read_text())


def test_the_defaults_are_torch_2_13s() -> None:
    """AllocatorConfig.h lines 340-353: 20 MiB large segments, no split limit (SIZE_MAX), no garbage collection,
    expandable segments off; the constructor sets max_non_split_rounding_size to the large segment size."""
    c = AllocatorConfig()
    assert (c.large_segment_size, c.max_split_size, c.max_non_split_rounding_size) == (20 * MiB, SIZE_MAX, 20 * MiB)
    assert c.garbage_collection_threshold == 0 and not c.expandable_segments
    assert c.roundup_power2_divisions == (0,) * 16 and c.per_process_memory_fraction == 1.0


def test_the_briefs_example_parses() -> None:
    c = AllocatorConfig.parse(
        "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True,"
        "roundup_power2_divisions:[256:1,512:2,>:4]"
    )
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.6 and c.expandable_segments
    # parseRoundUpPower2Divisions: 256 (MiB) -> index bit_width(256)-1 = 8, the first entry also fills 0..7;
    # 512 -> index 9; '>' fills from last_index + 1 = 10 to the end
    assert c.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6


@pytest.mark.parametrize("text", EXPECTATIONS["rejected_settings"]["settings"])
def test_what_pytorchs_test_rejects_is_rejected(text: str) -> None:
    """test_allocator_settings: each of these raises ValueError in torch."""
    with pytest.raises(AllocatorConfigError) as info:
        AllocatorConfig.parse(text)
    assert "\n" not in str(info.value) and "PYTORCH_CUDA_ALLOC_CONF" in str(info.value)


def test_memory_fractions_as_pytorchs_test_has_them() -> None:
    """test_allocator_memory_fraction_setting: 0.0, 0.5, 1.0 read back; -0.1 and 1.1 fail with
    'per_process_memory_fraction is invalid'."""
    data = EXPECTATIONS["memory_fraction_settings"]
    for text, value in data["accepted"].items():
        assert AllocatorConfig.parse(text).per_process_memory_fraction == value
    for text in data["rejected"]:
        with pytest.raises(AllocatorConfigError, match="per_process_memory_fraction is invalid"):
            AllocatorConfig.parse(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("expandable_segments:true", "expected 'True' or 'False'"),  # toBool is case-sensitive (lines 80-96)
        ("max_split_size_mb", "ends where a value"),  # checkIndex: an internal assert
        ("max_split_size_mb:", "ends where a value"),
        ("max_split_size_mb:abc", "not a number"),  # std::stoull throws
        ("max_split_size_mb:19", "must be >= 20"),  # parseMaxSplitSize: >= large_segment_size / MiB
        ("large_segment_size_mb:10", "must be > 10"),  # parseLargeSegmentSize: > kMinLargeAlloc / MiB
        ("large_segment_size_mb:32,max_split_size_mb:20", "must be >= 32"),  # the minimum follows the segment
        ("max_non_split_rounding_mb:10", "must be >= 20"),
        ("garbage_collection_threshold:0", "(0.0, 1.0)"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[64:3]", "power of 2 or 0"),
        ("roundup_power2_divisions:[48:2]", "intervals have to be a power of 2"),
        ("roundup_power2_divisions:[64:2", "ends where a value"),
        ("backend:cudaMallocAsync", "not the caching allocator"),
        ("backend:other", "unknown allocator backend"),
        ("max_split_size_mb=128", "unrecognized key"),  # '=' is no separator: one unknown word
    ],
)
def test_refused_with_one_line(text: str, why: str) -> None:
    with pytest.raises(AllocatorConfigError) as info:
        AllocatorConfig.parse(text)
    assert why in str(info.value) and "\n" not in str(info.value)


def test_what_the_parser_lets_through() -> None:
    """checkToken only returns whether a token matches and the parsers ignore it; std::stoull/stod read the longest
    numeric prefix: wrong separators and trailing junk pass, as they do in torch."""
    assert "".join(tokenize(" max_split_size_mb : 128 , x:[1,2] ")) == "max_split_size_mb:128,x:[1,2]"
    assert tokenize("a:[1,2]") == ["a", ":", "[", "1", ",", "2", "]"]
    assert AllocatorConfig.parse("max_split_size_mb:128MB").max_split_size == 128 * MiB
    c = AllocatorConfig.parse("max_split_size_mb:20:expandable_segments:True")  # ':' where ',' belongs
    assert c.max_split_size == 20 * MiB and c.expandable_segments
    assert AllocatorConfig.parse("garbage_collection_threshold:.5x").garbage_collection_threshold == 0.5
    # '>' as the first entry fills from last_index + 1 = 1: the first interval keeps 0
    assert AllocatorConfig.parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions == (0,) + (4,) * 15


def test_settings_reset_as_set_allocator_settings_resets_them() -> None:
    """parseArgs resets max_split_size, roundup_power2_divisions and garbage_collection_threshold on every call (and
    max_non_split_rounding to the large segment size); expandable_segments and the CUDA keys keep their value. This is
    what test_allocator_settings relies on ('should have reset the power2 divisions now')."""
    first = AllocatorConfig.parse(
        "max_split_size_mb:40,roundup_power2_divisions:4,expandable_segments:True,max_non_split_rounding_mb:64,"
        "large_segment_size_mb:32,per_process_memory_fraction:0.5"
    )
    assert first.max_non_split_rounding_size == 64 * MiB and first.large_segment_size == 32 * MiB
    second = AllocatorConfig.parse("garbage_collection_threshold:0.5", first)
    assert second.max_split_size == SIZE_MAX and second.roundup_power2_divisions == (0,) * 16
    assert second.expandable_segments and second.large_segment_size == 32 * MiB
    assert second.max_non_split_rounding_size == 32 * MiB and second.per_process_memory_fraction == 0.5
    assert second.garbage_collection_threshold == 0.5


def test_roundup_divisions_by_interval() -> None:
    """roundup_power2_divisions(size): intervals start at 1 MiB; index = log2(size) - 20, clamped to 0..15."""
    c = AllocatorConfig.parse("roundup_power2_divisions:[1:1,2:2,4:4,>:8]")
    assert c.roundup_divisions(1000) == 1  # below 1 MiB: the first interval
    assert c.roundup_divisions(3 * MiB) == 2  # [2, 4) MiB
    assert c.roundup_divisions(4 * MiB) == 4
    assert c.roundup_divisions(8 * MiB) == 8
    assert c.roundup_divisions(1 << 40) == 8  # past 32 GiB: the last interval
