"""Which torch versions' caching allocators the model (torch 2.13's) was compared with, and where they differ.

The model follows torch 2.13 (:mod:`ledgerspec.derivations.allocator`). A ledger declares the torch its run used
(``software.torch``); this says, for that version, whether the rules the model implements were compared with its
``c10/cuda/CUDACachingAllocator.cpp`` and, for the allocator settings the ledger declares, whether they differ.

torch 2.2.1 (compared 2026-12-06): ``c10/cuda/CUDACachingAllocator.cpp`` at kdvalin/pytorch@714154d7 (a fork whose
line numbers reproduce every assertion line the torch-2.2.1 wheel's ``libc10_cuda.so`` records: 1796, 2085, 2126,
2162, 2420, 2493, 2650, 2693; it swaps ``cudaMalloc`` for ``cudaMallocManaged`` in two places, no policy code), and
the wheel's config-parser strings. Under PyTorch's defaults every rule modelled is the same: 512-byte rounding
(``round_size``), the 1 MiB small/large threshold, segment sizes (``get_allocation_size``: 2 MiB, 20 MiB, 10 MiB,
rounded to 2 MiB), best fit per stream and the oversize tests (``get_free_block``), ``should_split``, ``free_block``
and merging, the ``malloc`` path when ``cudaMalloc`` fails (``release_available_cached_blocks`` then
``release_cached_blocks`` and the retry), events and ``record_stream`` (``process_events`` at each ``malloc``,
``synchronize_and_free_events`` before releasing), expandable segments (20 MiB large pages). The differences are
the settings' (:data:`COMPARED`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

#: the torch version the allocator model follows
MODELLED = "2.13"


#: the allocator settings as written: option -> value (``expandable_segments:True,max_split_size_mb:128``)
Settings = dict[str, str]


@dataclass(frozen=True)
class Compared:
    """A torch version whose allocator was compared with the model: what was read, and how it differs with the
    settings that make it differ."""

    version: str  # the release compared, e.g. "2.2.1"
    source: str  # what was read
    #: allocator option -> (whether that version differs from the model with these settings, how); options absent
    #: here, or set where the test says no, behave as the model does
    differs: dict[str, tuple[Callable[[Settings], bool], str]] = field(default_factory=dict)


def _expandable(settings: Settings) -> bool:
    return settings.get("expandable_segments", "").strip().lower() == "true"


#: torch minor version -> the comparison
COMPARED: dict[str, Compared] = {
    "2.2": Compared(
        "2.2.1",
        "c10/cuda/CUDACachingAllocator.cpp at kdvalin/pytorch@714154d7, matched to the torch-2.2.1 wheel's assertion "
        "line numbers, and the wheel's config-parser strings",
        {
            "roundup_power2_divisions": (
                lambda s: s.get("roundup_power2_divisions", "").strip() == "1",
                "a value of 1 leaves sizes above 512 B unrounded (roundup_power2_next_division returns the size when "
                "divisions <= 1), where the model rounds them to 512 B",
            ),
            "max_split_size_mb": (
                lambda s: s.get("max_split_size_mb", "").strip() == "20" or _expandable(s),
                "a value of 20 is refused (torch 2.2 asks for more than 20); beside expandable_segments:True, "
                "release_available_cached_blocks does not skip expandable blocks and reaches an internal assert",
            ),
            "garbage_collection_threshold": (
                _expandable,
                "beside expandable_segments:True, garbage_collect_cached_blocks does not skip expandable blocks and "
                "can reach the same internal assert",
            ),
            "max_non_split_rounding_mb": (
                lambda s: True,
                "not an option of torch 2.2 (Unrecognized CachingAllocator option)",
            ),
            "per_process_memory_fraction": (
                lambda s: True,
                "not an option of torch 2.2 (Unrecognized CachingAllocator option; torch 2.2 collects garbage only "
                "after torch.cuda.set_per_process_memory_fraction)",
            ),
        },
    ),
}


def minor(version: str | None) -> str | None:
    """``2.2`` of ``2.2.1+cu121`` (None: not a torch version)."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def settings_of(conf: str) -> Settings:
    """The options of a ``PYTORCH_CUDA_ALLOC_CONF`` text (``key:value,key:value``), in order."""
    out: Settings = {}
    for part in conf.split(","):
        if part.strip():
            key, _, value = part.partition(":")
            out[key.strip()] = value.strip()
    return out


def version_note(torch: str | None, conf: str = "") -> str:
    """What the model's rules are for the declared ``torch`` and allocator settings ``conf``, in one phrase; "" when
    the declared torch is the modelled one or none is declared."""
    v = minor(torch)
    if v is None or v == MODELLED:
        return ""
    seen = COMPARED.get(v)
    if seen is None:
        done = ", ".join(c.version for c in COMPARED.values())
        return (
            f"the declared torch {torch.strip() if torch else v}'s allocator was not compared with the model "
            f"(compared: {done}, and {MODELLED}, which it follows)"
        )
    settings = settings_of(conf)
    differing = [f"{key}: {how}" for key, (test, how) in seen.differs.items() if key in settings and test(settings)]
    if differing:
        return f"torch {seen.version}'s allocator differs from the model's with these settings ({'; '.join(differing)})"
    under = "PyTorch's defaults" if not conf.strip() else "these settings"
    return f"torch {seen.version}'s allocator follows the rules modelled under {under} (compared line by line)"


__all__ = ["COMPARED", "MODELLED", "Compared", "Settings", "minor", "settings_of", "version_note"]
