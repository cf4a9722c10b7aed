"""Argument types shared by the commands: one reading of a size flag, one wording of its errors.

Used as ``type=`` in ``add_argument``, so a bad value is an argparse usage error (one line, exit 2)
before a file is read or torch is imported.
"""

from __future__ import annotations

import argparse

from ledgerspec.contract.units import UnitError, parse_size


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


def device_memory(text: str) -> int:
    """``--device-memory``: a positive size of at least 1 MiB (a bare ``24`` is 24 bytes: surely a missing unit)."""
    value = positive_size(text)
    if value < MIN_DEVICE_MEMORY:
        raise argparse.ArgumentTypeError(f"{text!r} is {value} bytes, too small for a device; give a unit "
                                         f"(did you mean {text.strip()}GiB or {text.strip()}GB?)")
    return value
