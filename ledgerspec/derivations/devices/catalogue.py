"""The device catalogue: accelerators' memory as the vendor states it and as PyTorch reports it.

The built-in catalogue is ``devices.yaml`` beside this module (shipped in the wheel with the package); a user file of
the same shape adds devices or replaces them by name. Each device has its total as PyTorch reports it and what a
training process cannot give to tensors (the CUDA context, the cuBLAS workspace): the predicted peak is compared with
``usable = total - reserve`` (:mod:`.comparison`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledgerspec.contract.units import UnitError, format_size, parse_size
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

CATALOGUE = Path(__file__).with_name("devices.yaml")
#: how the built-in catalogue is named in a ledger (not the path where the package is installed)
BUILT_IN = "derivations/devices/devices.yaml"


@dataclass(frozen=True)
class Device:
    name: str
    vendor_memory: str  # as sold ("24 GB")
    total: int  # bytes, as PyTorch reports them (torch.cuda.get_device_properties(0).total_memory)
    reserve: int  # bytes no tensor can have (CUDA context, cuBLAS workspace)
    source: str
    #: bytes CUDA (HIP) reports as the device's total (``cudaMemGetInfo``'s total, what PyTorch's out-of-memory message
    #: prints as "total capacity"): the most the caching allocator can ever hold; ``total`` when the file gives none
    capacity: int = 0
    #: True when the file gives no ``capacity`` and ``total`` stands in for it (an ASSUMPTION: CUDA's total is below)
    capacity_assumed: bool = False

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            object.__setattr__(self, "capacity", self.total)
            object.__setattr__(self, "capacity_assumed", True)

    @property
    def usable(self) -> int:
        return self.total - self.reserve

    def nominal(self) -> list[int]:
        """The memories a ledger may declare for this device as its own: its total as nvidia-smi prints it, and its
        vendor memory in GB (decimal, as sold) or in GiB (``80 GB`` -> 80 GB and 80 GiB)."""
        sizes = [self.total]
        m = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(GB|GiB|TB|TiB)\s*$", self.vendor_memory)
        if m:
            n = float(m.group(1))
            scale = {"GB": (10**9, 2**30), "GiB": (10**9, 2**30), "TB": (10**12, 2**40), "TiB": (10**12, 2**40)}
            dec, binary = scale[m.group(2)]
            sizes += [int(n * dec), int(n * binary)]
        return sizes


#: words a device's name carries that do not tell devices apart
_VENDOR_WORDS = frozenset({"nvidia", "amd", "tesla", "geforce"})


def name_tokens(name: str) -> frozenset[str]:
    """The words of a device name, lower case, without the vendor: ``NVIDIA A100-SXM4-80GB`` -> a100, sxm4, 80gb."""
    return frozenset(t for t in re.split(r"[^0-9a-z]+", name.lower()) if t and t not in _VENDOR_WORDS)


def packed_name(name: str) -> str:
    """A device name's words (less the vendor's) run together: ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``."""
    return "".join(t for t in re.split(r"[^0-9a-z]+", name.lower()) if t and t not in _VENDOR_WORDS)


def cards_with_words(words: frozenset[str], devices: list[Device]) -> list[Device]:
    """The entries whose name has every one of ``words`` (less the vendor's; ``{"h100"}``: the H100)."""
    return [d for d in devices if words and words <= name_tokens(d.name)]


def cards_asked(text: str, devices: list[Device]) -> list[Device]:
    """The entries a name typed by a user may mean: the one :func:`device_named` picks; else those whose name has
    every word given (``H100``; ``A100``: two); else those whose words run together hold the words given
    (``rtx4090``)."""
    device = device_named(text, devices)
    if device is not None:
        return [device]
    words = name_tokens(text)
    within = cards_with_words(words, devices)
    if within or not words:
        return within
    packed = "".join(sorted(words))
    return [d for d in devices if packed in packed_name(d.name)]


def device_named(name: str, devices: list[Device]) -> Device | None:
    """The catalogue entry a reported device name is: the entry whose name's words (less the vendor) are all among
    the reported name's words, the one with the most words when several are (``NVIDIA A100-SXM4-80GB`` and ``NVIDIA
    A100 80GB PCIe`` are the entry ``NVIDIA A100 80GB``; ``NVIDIA A100`` alone is neither A100 entry); None: none,
    or two entries as specific."""
    words = name_tokens(name)
    found = [(len(name_tokens(d.name)), d) for d in devices if name_tokens(d.name) and name_tokens(d.name) <= words]
    if not found:
        return None
    found.sort(key=lambda f: -f[0])
    if len(found) > 1 and found[1][0] == found[0][0]:
        return None
    return found[0][1]


@dataclass(frozen=True)
class Catalogue:
    devices: list[Device]
    reserve_source: str
    files: list[str]


def usable_note(catalogue: Catalogue) -> str:
    return (
        "usable memory = the total PyTorch reports - what the CUDA context and the cuBLAS workspace take "
        f"({catalogue.reserve_source}); the caching allocator's slack (reserved - allocated) comes on top and "
        "depends on the workload (`ledgerspec measure` records it)"
    )


def _bad(file: str, message: str) -> LedgerspecError:
    return LedgerspecError(message, file, rule="devices", exit_code=EXIT_USAGE, hint="see " + str(CATALOGUE))


def _size(value: Any, file: str, what: str) -> int:
    try:
        return parse_size(value)
    except UnitError as exc:
        raise _bad(file, f"{what}: {exc}") from None


def load_catalogue(extra: str | None = None) -> Catalogue:
    """The built-in catalogue, with the devices of ``extra`` (a YAML file of the same shape) added or replacing
    those of the same name; its ``default_reserve``/``reserve_source`` replace the built-in ones when given."""
    from ruamel.yaml import YAML

    files = [CATALOGUE] + ([Path(extra)] if extra else [])
    by_name: dict[str, Device] = {}
    default_reserve = 0
    reserve_source = ""
    for path in files:
        shown = str(path)
        try:
            data = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise _bad(shown, f"cannot read the device catalogue: {exc.strerror or exc}") from None
        except Exception as exc:  # ruamel's parse errors: one line, at the place ruamel names
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            err = _bad(shown, f"not a YAML device catalogue: {problem}")
            if mark is not None:
                err.line, err.column = mark.line + 1, mark.column + 1
            raise err from None
        if isinstance(data, dict) and "ledgerspec" in data:
            raise LedgerspecError(
                f"a ledgerspec document ({data['ledgerspec']!r}), not a device catalogue",
                shown,
                rule="devices",
                exit_code=EXIT_USAGE,
                hint="--devices takes an optional CATALOGUE: write the ledger first, `ledgerspec estimate FILE "
                "--devices`",
            )
        if not isinstance(data, dict) or not isinstance(data.get("devices", []), list):
            raise _bad(shown, "a device catalogue is a mapping with a list `devices`")
        if "default_reserve" in data:
            default_reserve = _size(data["default_reserve"], shown, "default_reserve")
        if isinstance(data.get("reserve_source"), str):
            reserve_source = " ".join(data["reserve_source"].split())
        for i, item in enumerate(data.get("devices", [])):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "total" not in item:
                raise _bad(shown, f"devices[{i}] needs `name` and `total` (bytes as PyTorch reports them)")
            total = _size(item["total"], shown, f"devices[{i}].total")
            reserve = _size(item.get("reserve", default_reserve), shown, f"devices[{i}].reserve")
            if reserve >= total:
                raise _bad(shown, f"devices[{i}]: reserve {reserve} B is not below total {total} B")
            capacity = 0
            if "capacity" in item:
                capacity = _size(item["capacity"], shown, f"devices[{i}].capacity")
                if not 0 < capacity <= total:
                    raise _bad(
                        shown,
                        f"devices[{i}]: capacity {capacity} B is not in (0, total {total} B]: CUDA's total "
                        "(cudaMemGetInfo) is at most nvidia-smi's",
                    )
            by_name[item["name"]] = Device(
                item["name"],
                str(item.get("vendor_memory", format_size(total))),
                total,
                reserve,
                " ".join(str(item.get("source", "")).split()),
                capacity,
            )
    named = ["ledgerspec " + BUILT_IN] + ([str(extra)] if extra else [])
    return Catalogue(list(by_name.values()), reserve_source, named)


__all__ = [
    "BUILT_IN",
    "CATALOGUE",
    "Catalogue",
    "Device",
    "device_named",
    "load_catalogue",
    "name_tokens",
    "usable_note",
]
