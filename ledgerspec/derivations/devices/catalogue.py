"""The device catalogue: accelerators' memory as the vendor states it and as PyTorch reports it.

The built-in catalogue is ``devices.yaml`` beside this module (shipped in the wheel with the package); a user file of
the same shape adds devices or replaces them by name. Each device has its total as PyTorch reports it and what a
training process cannot give to tensors (the CUDA context, the cuBLAS workspace): the predicted peak is compared with
``usable = total - reserve`` (:mod:`.comparison`).
"""

from __future__ import annotations

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

    @property
    def usable(self) -> int:
        return self.total - self.reserve


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
        except Exception as exc:  # ruamel's parse errors: one line
            raise _bad(shown, f"not a YAML device catalogue: {str(exc).splitlines()[0]}") from None
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
            by_name[item["name"]] = Device(
                item["name"],
                str(item.get("vendor_memory", format_size(total))),
                total,
                reserve,
                " ".join(str(item.get("source", "")).split()),
            )
    named = ["ledgerspec " + BUILT_IN] + ([str(extra)] if extra else [])
    return Catalogue(list(by_name.values()), reserve_source, named)


__all__ = ["BUILT_IN", "CATALOGUE", "Catalogue", "Device", "load_catalogue", "usable_note"]
