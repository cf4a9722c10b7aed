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
