"""``PYTORCH_CUDA_ALLOC_CONF`` as torch 2.13 reads it: what it accepts, what it rejects, what each setting means.

Sources (see :mod:`ledgerspec.derivations.allocator` for how the versions were pinned):

- ``c10/core/AllocatorConfig.h`` of torch 2.13.0 (``git_version`` cf30153c4c131c8164ee7798e5022d810682e2cb, the
  header shipped in the wheel, line numbers exact): the tokenizer ``ConfigTokenizer`` (lines 35-130), the constants
  ``kSmallBuffer``/``kMinBlockSize``/``kSmallSize``/``kMinLargeAlloc``/``kRoundLarge`` (lines 16-25), the defaults
  of ``AcceleratorAllocatorConfig`` (lines 340-353: 20 MiB large segments, no split limit, no garbage collection,
  expandable segments off);
- ``c10/cuda/CUDAAllocatorConfig.h`` of torch 2.13.0 (same wheel): the CUDA keys (``getKeys``, lines 158-175) and
  their defaults (lines 219-225);
- ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs`` and its ``parse*`` helpers) and
  ``c10/cuda/CUDAAllocatorConfig.cpp`` (``CUDAAllocatorConfig::parseArgs``): read in the stored copies
  cyyever/pytorch@106319cb5704e5ec5a9680b3168f2b0075494760 and a 2.15.0a0-era stored copy of the CUDA file; every
  function used here has the signature the 2.13 headers declare. The rules are cited by function name.

Two surprises are modelled on purpose. ``ConfigTokenizer::checkToken`` (AllocatorConfig.h line 65) only *returns*
whether a token matches: the parsers ignore the result, so a wrong separator (``max_split_size_mb=128`` is one
unknown key, but ``a:1;b`` or ``x:1:y:2``) is not an error by itself; only a missing token is (``checkIndex``,
an internal assert). Numbers go through ``std::stoull``/``std::stod``, which read the longest numeric prefix
(``128MB`` is 128) and wrap a minus sign (``-5`` is 2**64 - 5).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ledgerspec.errors import LedgerspecError

MiB = 1024 * 1024
#: std::numeric_limits<size_t>::max(): "no limit" for max_split_size (AllocatorConfig.h line 342)
SIZE_MAX = 2**64 - 1
#: AllocatorConfig.h lines 16-25 (torch 2.13)
kSmallBuffer = 2 * MiB
kMinBlockSize = 512
kSmallSize = 1 * MiB
kMinLargeAlloc = 10 * MiB
kRoundLarge = 2 * MiB
#: the default large segment (AllocatorConfig.h line 340: ``large_segment_size_{20971520}``), kLargeBuffer before
DEFAULT_LARGE_SEGMENT = 20 * MiB
#: AllocatorConfig.cpp: 16 intervals from 1 MiB (2**20) to 64 GiB
ROUNDUP_INTERVALS = 16
ROUNDUP_START_LOG2 = 20
#: CUDAAllocatorConfig.h ``pinned_max_register_threads`` (lines 97-101)
PINNED_MAX_REGISTER_THREADS = 128

#: AcceleratorAllocatorConfig::getMutableKeys (the device-independent keys)
ACCELERATOR_KEYS = frozenset(
    {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "pinned_use_background_threads",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
    }
)
#: CUDAAllocatorConfig::getKeys, torch 2.13 (CUDAAllocatorConfig.h lines 158-175)
CUDA_KEYS = frozenset(
    {
        "backend",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "release_lock_on_hipmalloc",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_reserve_segment_size_mb",
        "pinned_num_register_threads",
        "per_process_memory_fraction",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)


class AllocatorConfigError(LedgerspecError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` that PyTorch 2.13 refuses (one line: which key, why)."""


def _fail(text: str, why: str) -> AllocatorConfigError:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return AllocatorConfigError(
        f"PYTORCH_CUDA_ALLOC_CONF {shown!r}: {why}", rule="allocator-config", hint="torch 2.13 refuses it too"
    )


def tokenize(text: str) -> list[str]:
    """``ConfigTokenizer`` (AllocatorConfig.h lines 35-53): ``, : [ ]`` are tokens of their own, whitespace is
    dropped, everything else accumulates into a word."""
    tokens: list[str] = []
    buffer = ""
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)


class _Tokens:
    """The tokenizer's accessors as the parsers use them (AllocatorConfig.h lines 55-129)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = tokenize(text)

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, i: int, what: str) -> str:
        """``operator[]``/``checkIndex``: an index past the end is an internal assert (a value is missing)."""
        if i >= len(self.tokens):
            raise _fail(self.text, f"{what}: the string ends where a value is expected")
        return self.tokens[i]

    def check(self, i: int, what: str) -> None:
        """``checkToken(i, ...)``: only the index is checked, the token itself is not (its result is ignored)."""
        self.at(i, what)

    def size_t(self, i: int, what: str) -> int:
        """``toSizeT``: ``std::stoull`` (the longest integer prefix; a minus sign wraps; no digits or overflow
        throw)."""
        token = self.at(i, what)
        m = _INT.match(token)
        if m is None:
            raise _fail(self.text, f"{what}: {token!r} is not a number (std::stoull)")
        value = int(m.group(0))
        if abs(value) > SIZE_MAX:
            raise _fail(self.text, f"{what}: {token!r} is out of range (std::stoull)")
        return value % (SIZE_MAX + 1)

    def double(self, i: int, what: str) -> float:
        """``toDouble``: ``std::stod`` (the longest floating-point prefix)."""
        token = self.at(i, what)
        m = _FLOAT.match(token)
        if m is None:
            raise _fail(self.text, f"{what}: {token!r} is not a number (std::stod)")
        return float(m.group(0))

    def boolean(self, i: int, what: str) -> bool:
        """``toBool`` (AllocatorConfig.h lines 80-96): exactly ``True`` or ``False``, case-sensitive."""
        token = self.at(i, what)
        if token == "True":
            return True
        if token == "False":
            return False
        raise _fail(self.text, f"{what}: expected 'True' or 'False', got {token!r}")

    def skip_key(self, i: int, what: str) -> int:
        """``skipKey`` (AllocatorConfig.h lines 100-122): past ``key : value`` or ``key : [ ... ]``."""
        self.check(i + 1, what)
        i += 2
        if self.at(i, what) != "[":
            return i
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            i += 1
        if i >= len(self.tokens):
            raise _fail(self.text, f"{what}: '[' without a closing ']'")
        return i


def _has_single_bit(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings (torch 2.13 defaults). Sizes in bytes.

    ``max_split_size == SIZE_MAX`` means "no limit" (the default): every block may be split.
    ``roundup_power2_divisions`` holds the 16 per-interval division counts (1 MiB, 2 MiB, ... 32 GiB and above).
    """

    large_segment_size: int = DEFAULT_LARGE_SEGMENT
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = DEFAULT_LARGE_SEGMENT
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    throw_on_cudamalloc_oom: bool = False
    release_lock_on_cudamalloc: bool = False
    #: the settings string this configuration was parsed from (``last_allocator_settings``)
    text: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str, previous: AllocatorConfig | None = None) -> AllocatorConfig:
        """The configuration after ``torch.cuda.memory._set_allocator_settings(text)`` (or the environment variable
        read at start-up, when ``previous`` is None).

        Like ``AcceleratorAllocatorConfig::parseArgs``, ``max_split_size_mb``, ``roundup_power2_divisions`` and
        ``garbage_collection_threshold`` fall back to their defaults when absent, and ``max_non_split_rounding_mb``
        to the large segment size; the other settings keep the value ``previous`` had. Raises
        :class:`AllocatorConfigError` on what PyTorch refuses.
        """
        base = previous if previous is not None else cls()
        tokens = _Tokens(text)
        values: dict[str, Any] = {
            "max_split_size": SIZE_MAX,
            "roundup_power2_divisions": [0] * ROUNDUP_INTERVALS,
            "garbage_collection_threshold": 0.0,
        }
        large = base.large_segment_size
        # parseArgs: large_segment_size_mb is read first (max_non_split_rounding_size must be >= it)
        i = 0
        while i < len(tokens):
            if tokens.tokens[i] == "large_segment_size_mb":
                large = _parse_large_segment_size(tokens, i)
                i += 2
            i += 1
        accel = _parse_accelerator(tokens, large)
        cuda = _parse_cuda(tokens)
        values.update(accel)
        merged = replace(base, large_segment_size=large, max_non_split_rounding_size=large, text=text)
        changes: dict[str, Any] = {**values, **cuda}
        changes["roundup_power2_divisions"] = tuple(changes["roundup_power2_divisions"])
        return replace(merged, **changes)

    @functools.cached_property
    def plain_rounding(self) -> bool:
        """No interval rounds to power-of-two divisions (the default): every size rounds up to 512 B."""
        return max(self.roundup_power2_divisions) <= 1

    def roundup_divisions(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the divisions of the power-of-two interval
        ``size`` lies in (intervals from 1 MiB to 64 GiB; below 1 MiB the first, above 32 GiB the last)."""
        log_size = size.bit_length() - 1
        index = log_size - ROUNDUP_START_LOG2 if log_size > ROUNDUP_START_LOG2 else 0
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    @property
    def split_limited(self) -> bool:
        return self.max_split_size != SIZE_MAX


def _parse_large_segment_size(tokens: _Tokens, i: int) -> int:
    """``parseLargeSegmentSize``: more than kMinLargeAlloc (10 MiB), in MiB."""
    tokens.check(i + 1, "large_segment_size_mb")
    value = tokens.size_t(i + 2, "large_segment_size_mb")
    if not value > kMinLargeAlloc // MiB:
        raise _fail(tokens.text, f"large_segment_size_mb must be > {kMinLargeAlloc // MiB} MB (got {value})")
    return min(value, SIZE_MAX // MiB) * MiB


def _parse_accelerator(tokens: _Tokens, large: int) -> dict[str, Any]:
    """``AcceleratorAllocatorConfig::parseArgs``, second pass (every key but large_segment_size_mb)."""
    out: dict[str, Any] = {}
    text = tokens.text
    i = 0
    while i < len(tokens):
        key = tokens.tokens[i]
        if key == "large_segment_size_mb":
            i = tokens.skip_key(i, key)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            # parseMaxSplitSize / parseMaxNonSplitRoundingSize: at least the large segment size (in MiB)
            tokens.check(i + 1, key)
            i += 2
            value = tokens.size_t(i, key)
            if value < large // MiB:
                raise _fail(text, f"{key} too small, must be >= {large // MiB} (got {value})")
            name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            out[name] = min(value, SIZE_MAX // MiB) * MiB
        elif key == "garbage_collection_threshold":
            # parseGarbageCollectionThreshold: strictly between 0 and 1
            tokens.check(i + 1, key)
            i += 2
            threshold = tokens.double(i, key)
            if not (threshold > 0 and threshold < 1.0):
                raise _fail(text, f"garbage_collection_threshold is invalid ({threshold}), set it in (0.0, 1.0)")
            out["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            i, divisions = _parse_roundup(tokens, i)
            out["roundup_power2_divisions"] = divisions
        elif key == "expandable_segments":
            tokens.check(i + 1, key)
            i += 2
            out["expandable_segments"] = tokens.boolean(i, key)
        elif key == "pinned_use_background_threads":
            tokens.check(i + 1, key)
            i += 2
            tokens.boolean(i, key)
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            tokens.check(i + 1, key)
            i += 2
            tokens.size_t(i, key)
        else:
            # with the CUDA parser hook registered, a key neither parser knows is refused
            if key not in ACCELERATOR_KEYS | CUDA_KEYS:
                raise _fail(text, f"unrecognized key {key!r} in Accelerator allocator config")
            i = tokens.skip_key(i, key)
        if i + 1 < len(tokens):
            i += 1  # checkToken(++i, ","): the separator itself is not checked
        i += 1
    return out


def _parse_roundup(tokens: _Tokens, i: int) -> tuple[int, list[int]]:
    """``parseRoundUpPower2Divisions``: one power of two for every interval, or a list ``[MB:div, ..., >:div]``
    where the first entry also fills the intervals below it and ``>`` fills those above the last one."""
    text = tokens.text
    key = "roundup_power2_divisions"
    divisions = [0] * ROUNDUP_INTERVALS
    tokens.check(i + 1, key)
    i += 2
    if tokens.at(i, key) == "[":
        first = True
        last_index = 0
        i += 1
        while i < len(tokens) and tokens.tokens[i] != "]":
            value_index = i
            tokens.check(i + 1, key)
            i += 2
            value = tokens.size_t(i, key)
            if not (value == 0 or _has_single_bit(value)):
                raise _fail(text, f"{key}: the divisions have to be a power of 2 or 0 (got {value})")
            if tokens.tokens[value_index] == ">":
                for k in range(last_index + 1, ROUNDUP_INTERVALS):
                    divisions[k] = value
            else:
                boundary = tokens.size_t(value_index, key)
                if not _has_single_bit(boundary):
                    raise _fail(text, f"{key}: the intervals have to be a power of 2 (got {boundary})")
                index = min(max(boundary.bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
                if first:
                    for k in range(index):
                        divisions[k] = value
                    first = False
                divisions[index] = value
                last_index = index
            if tokens.at(i + 1, key) != "]":
                i += 1  # checkToken(++i, ","): unchecked
            i += 1
        if i >= len(tokens):
            raise _fail(text, f"{key}: '[' without a closing ']'")
    else:  # the single-value syntax
        value = tokens.size_t(i, key)
        if not _has_single_bit(value):
            raise _fail(text, f"{key}: the divisions have to be a power of 2 (got {value})")
        divisions = [value] * ROUNDUP_INTERVALS
    return i, divisions


def _parse_cuda(tokens: _Tokens) -> dict[str, Any]:
    """``CUDAAllocatorConfig::parseArgs`` (the device hook, run after the accelerator parser on the same string)."""
    out: dict[str, Any] = {}
    text = tokens.text
    i = 0
    while i < len(tokens):
        key = tokens.tokens[i]
        if key == "backend":
            # parseAllocatorConfig: native or cudaMallocAsync, and it must be the backend loaded at start-up
            tokens.check(i + 1, key)
            i += 2
            value = tokens.at(i, key)
            if value not in ("native", "cudaMallocAsync"):
                raise _fail(text, f"unknown allocator backend {value!r}, options are native and cudaMallocAsync")
            if value != "native":
                raise _fail(text, "backend:cudaMallocAsync is CUDA's own allocator, not the caching allocator modelled")
        elif key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc"):
            tokens.check(i + 1, key)
            i += 2
            out["release_lock_on_cudamalloc"] = tokens.boolean(i, key)
        elif key in (
            "pinned_use_cuda_host_register",
            "pinned_use_hip_host_register",
            "graph_capture_record_stream_reuse",
            "pinned_free_catch_all",
        ):
            tokens.check(i + 1, key)
            i += 2
            tokens.boolean(i, key)
        elif key == "pinned_num_register_threads":
            # parsePinnedNumRegisterThreads: a power of 2, at most 128
            tokens.check(i + 1, key)
            i += 2
            threads = tokens.size_t(i, key)
            if not _has_single_bit(threads):
                raise _fail(text, f"{key}: the number of register threads has to be a power of 2 (got {threads})")
            if threads > PINNED_MAX_REGISTER_THREADS:
                raise _fail(text, f"{key}: at most {PINNED_MAX_REGISTER_THREADS} (got {threads})")
        elif key == "pinned_reserve_segment_size_mb":
            tokens.check(i + 1, key)
            i += 2
            if tokens.size_t(i, key) == 0:
                raise _fail(text, f"{key}: has to be greater than 0")
        elif key == "per_process_memory_fraction":
            # parsePerProcessMemoryFraction: in [0, 1]
            tokens.check(i + 1, key)
            i += 2
            fraction = tokens.double(i, key)
            if not (fraction >= 0.0 and fraction <= 1.0) or math.isnan(fraction):
                raise _fail(text, f"per_process_memory_fraction is invalid ({fraction}), set it in [0.0, 1.0]")
            out["per_process_memory_fraction"] = fraction
        elif key == "throw_on_cudamalloc_oom":
            tokens.check(i + 1, key)
            i += 2
            out["throw_on_cudamalloc_oom"] = tokens.boolean(i, key)
        else:
            if key not in ACCELERATOR_KEYS:
                raise _fail(text, f"unrecognized key {key!r} in CUDA allocator config")
            i = tokens.skip_key(i, key)
        if i + 1 < len(tokens):
            i += 1
        i += 1
    return out


__all__ = [
    "DEFAULT_LARGE_SEGMENT",
    "SIZE_MAX",
    "AllocatorConfig",
    "AllocatorConfigError",
    "MiB",
    "kMinBlockSize",
    "kMinLargeAlloc",
    "kRoundLarge",
    "kSmallBuffer",
    "kSmallSize",
    "tokenize",
]
