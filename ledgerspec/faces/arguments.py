"""Argument types shared by the commands: one reading of a size flag, one wording of its errors.

Used as ``type=`` in ``add_argument``, so a bad value is an argparse usage error (one line, exit 2)
before a file is read or torch is imported.
"""

from __future__ import annotations

import argparse
import re

from ledgerspec.contract.units import UnitError, decimal_note, parse_size


def positive_size(text: str) -> int:
    """A memory size flag (``--device-memory``, ``--memory-limit``): bytes, > 0, in any unit we read."""
    try:
        value = parse_size(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size (e.g. 24GiB, 80GB)")
    return value


#: below this a device memory is a missing unit, not a device (``--device-memory 24``)
MIN_DEVICE_MEMORY = 2**20


class DeviceMemory(int):
    """A ``--device-memory`` value in bytes that remembers how it was written (for :func:`decimal_unit_note`)."""

    text: str

    def __new__(cls, value: int, text: str) -> DeviceMemory:
        obj = super().__new__(cls, value)
        obj.text = text
        return obj


def device_memory(text: str) -> DeviceMemory:
    """``--device-memory``: a positive size of at least 1 MiB (a bare ``24`` is 24 bytes: surely a missing unit)."""
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text) and not float(text).is_integer():  # 24.5: a unit is missing
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of bytes; give a unit (did you mean {text.strip()}GiB?)"
        )
    value = positive_size(text)
    if value < MIN_DEVICE_MEMORY:
        bare = re.fullmatch(r"\s*[0-9.]+\s*", text) is not None
        hint = f" (did you mean {text.strip()}GiB or {text.strip()}GB?)" if bare else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is {value} bytes, too small for a device; give a device's memory{hint}"
        )
    return DeviceMemory(value, text)


def decimal_unit_note(size: int | None) -> str | None:
    """A reminder when a device memory was given in decimal units: a card sold as "24 GB" holds 24 GiB."""
    text = getattr(size, "text", None)
    if size is None or text is None or not re.fullmatch(r"\s*[0-9.]+\s*[GT]B\s*", text):  # cards: GB (or TB)
        return None
    note = decimal_note(text, "--device-memory", "pass")
    return f"note: {note}" if note else None


def device_memory_bytes(value: DeviceMemory | None, file: str) -> int | None:
    """A parsed ``--device-memory`` as plain bytes for the core; its decimal-unit note, if any, on stderr."""
    import sys

    note = decimal_unit_note(value)
    if note:
        print(f"{file}: {note}", file=sys.stderr)
    return int(value) if value is not None else None


#: what ``--force`` means for every command that writes a file (docs: "Writing files back")
FORCE_HELP = "write FILE (or OUT) even if it is read-only"


def add_force(parser: argparse.ArgumentParser, help: str = FORCE_HELP) -> None:
    """``--force``: the one opt-in to write over a read-only file, the same flag on every command that writes."""
    parser.add_argument("--force", action="store_true", help=help)


def target_memory_note(doc: object, file: str) -> None:
    """The decimal-unit note for ``result.target_device.memory`` written in GB in the document (as for the flag),
    on stderr, when a command uses it."""
    import sys

    value = doc.get("result", "target_device", "memory")  # type: ignore[attr-defined]
    text = value.value if isinstance(value.value, str) else None
    note = decimal_note(text, "result.target_device.memory") if text and re.search(r"[GT]B\s*$", text) else None
    if note:
        print(f"{file}: note: {note}", file=sys.stderr)
