"""Quantities of memory: integers of bytes, or strings with an explicit unit.

Decimal units (B, KB, MB, GB, TB) are powers of 10^3, binary units (KiB, MiB, GiB, TiB)
powers of 2^10. A number with no unit means bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}

#: the largest size any field may hold (1 EiB): far above any device, far below overflow
MAX_BYTES = 2**60

SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$"
_SIZE_RE = re.compile(r"^\s*(?P<num>[+-]?[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]+)?\s*$")


class UnitError(ValueError):
    """A size that cannot be read; the message says why and what is accepted."""


def parse_size(value: object) -> int:
    """Return the number of bytes that ``value`` denotes.

    >>> parse_size("1.5 GiB")
    1610612736
    >>> parse_size(1024)
    1024
    """
    if isinstance(value, bool):
        raise UnitError(f"{value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise UnitError(f"{value!r} is not a size")
        if not value.is_integer():
            raise UnitError(f"{value!r} bytes is not a whole number of bytes; give a unit or an integer")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise UnitError(
                f"{value!r} is not a size; write bytes as an integer or a number with a unit ({', '.join(UNITS)})"
            )
        unit = m.group("unit") or "B"
        if unit not in UNITS:
            known = {u.lower(): u for u in UNITS}
            # 24G and 24Gi: GiB, as torch and Linux say
            guess = known.get(unit.lower()) or known.get(unit.lower() + "ib") or known.get(unit.lower() + "b")
            hint = f"; did you mean {guess}?" if guess else f"; use one of {', '.join(UNITS)}"
            raise UnitError(f"unknown unit {unit!r} in {value!r}{hint}")
        try:
            num = Decimal(m.group("num"))
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
            raise UnitError(f"{value!r} is not a number") from exc
        exact = num * UNITS[unit]
        if exact != exact.to_integral_value():
            near = int(exact.to_integral_value())
            raise UnitError(
                f"{value!r} is not a whole number of bytes"
                + (f" (give {near} or {round(exact / 2**20)} MiB)" if near >= 2**20 else "")
            )
        n = int(exact)
    else:
        raise UnitError(f"{value!r} is not a size")
    if n < 0:
        raise UnitError(f"negative size {value!r}")
    if n > MAX_BYTES:
        raise UnitError(f"size {value!r} is larger than 1 EiB; check the unit")
    return n


_DECIMAL_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>KB|MB|GB|TB)\s*$")


def decimal_unit(text: object) -> tuple[str, str] | None:
    """``("24", "GB")`` when ``text`` is a size written in decimal units (KB, MB, GB, TB), else None."""
    m = _DECIMAL_RE.match(text) if isinstance(text, str) else None
    return (m.group("num"), m.group("unit")) if m else None


def decimal_note(text: object, what: str, verb: str = "write") -> str | None:
    """A reminder for a device memory written in decimal units: ``24 GB`` is 24 x 10^9 bytes = 22.35 GiB, while a
    card sold as "24 GB" holds about 24 GiB (vendors state GPU memory in binary units; ``nvidia-smi`` shows the
    exact total). ``what`` names where it was written (``--device-memory 24GB``, ``result.target_device.memory``)."""
    parts = decimal_unit(text)
    if parts is None:
        return None
    num, unit = parts
    nbytes = parse_size(text)
    binary = f"{num}{unit[0]}iB"
    return (
        f"{what} {str(text).strip()} is {nbytes:,} B = {format_size(nbytes)} (decimal units); "
        f'GPU memory is sold in binary units, a "{num} {unit}" card has about {binary} '
        f"(nvidia-smi shows the exact total): {verb} {binary}, or that total, if you mean such a card"
    )


def format_size(n: int) -> str:
    """Human-readable binary size, for comments beside byte figures: ``13.48 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n_f = n / UNITS[unit]
        if n_f < 1024 or unit == "TiB":
            return f"{n_f:.2f} {unit}"
    raise AssertionError("unreachable")
