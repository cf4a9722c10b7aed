"""Argument types shared by the commands: one reading of a size flag, one wording of its errors.

Used as ``type=`` in ``add_argument``, so a bad value is an argparse usage error (one line, exit 2)
before a file is read or torch is imported.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from ledgerspec.contract.units import UnitError, decimal_note, parse_size

if TYPE_CHECKING:
    from ledgerspec.contract.document import Document


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
    """A ``--device-memory`` value in bytes that remembers how it was written (for :func:`decimal_unit_note`), and
    the device catalogue's card it named, if it named one (``--device-memory "RTX 4090"``)."""

    text: str
    card: str | None

    def __new__(cls, value: int, text: str, card: str | None = None) -> DeviceMemory:
        obj = super().__new__(cls, value)
        obj.text = text
        obj.card = card
        return obj


def _card(text: str) -> DeviceMemory | None:
    """A card of the built-in device catalogue named instead of a size: its total as nvidia-smi prints it (the
    commands then take that card: :func:`name_the_card`); None when the text names none
    (:func:`~ledgerspec.derivations.devices.catalogue.cards_asked`), a usage error when it names several."""
    from ledgerspec.derivations.devices.catalogue import cards_asked, load_catalogue

    found = cards_asked(text, load_catalogue().devices)
    if len(found) > 1:
        names = ", ".join(d.name for d in found)
        raise argparse.ArgumentTypeError(f"{text!r} names several cards of the device catalogue ({names}): say which")
    return DeviceMemory(found[0].total, text, found[0].name) if found else None


def _cards_numbered(text: str) -> list[str]:
    """The catalogue's cards whose name has the number ``text`` as a word (``4090``: the RTX 4090)."""
    from ledgerspec.derivations.devices.catalogue import cards_with_words, load_catalogue

    return [d.name for d in cards_with_words(frozenset({text.strip()}), load_catalogue().devices)]


def device_memory(text: str) -> DeviceMemory:
    """``--device-memory``: a positive size of at least 1 MiB (a bare ``24`` is 24 bytes: surely a missing unit), or
    a card of the device catalogue by name (``"RTX 4090"``, ``H100``: :func:`_card`)."""
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text) and not float(text).is_integer():  # 24.5: a unit is missing
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of bytes; give a unit (did you mean {text.strip()}GiB?)"
        )
    try:
        value = positive_size(text)
    except argparse.ArgumentTypeError as exc:
        if not re.search(r"[A-Za-z]", text):
            raise
        card = _card(text)  # words: perhaps a card's name
        if card is not None:
            return card
        if text.strip()[:1].isdigit():  # a number with a unit that is wrong: the size's own message
            raise
        from ledgerspec.derivations.devices.catalogue import load_catalogue

        names = ", ".join(d.name for d in load_catalogue().devices)
        raise argparse.ArgumentTypeError(f"{exc}; or name a card of the device catalogue ({names})") from None
    if value < MIN_DEVICE_MEMORY:
        bare = re.fullmatch(r"\s*[0-9.]+\s*", text) is not None
        cards = _cards_numbered(text) if bare else []
        hint = (
            f" (did you mean the card {cards[0]!r}?)"
            if len(cards) == 1
            else f" (did you mean {text.strip()}GiB or {text.strip()}GB?)"
            if bare
            else ""
        )
        raise argparse.ArgumentTypeError(
            f"{text!r} is {value} bytes, too small for a device; give a device's memory{hint}"
        )
    return DeviceMemory(value, text)


def decimal_unit_note(size: int | None) -> str | None:
    """A reminder when a device memory was given in decimal units: a card sold as "24 GB" holds 24 GiB."""
    text = getattr(size, "text", None)
    card = getattr(size, "card", None)
    if size is not None and card is not None and text is not None:
        from ledgerspec.contract.units import format_size

        return f"note: --device-memory {text.strip()!r} is the device catalogue's {card}, {format_size(int(size))}"
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


def name_the_card(doc: Document, value: DeviceMemory | None) -> None:
    """A card named with ``--device-memory "RTX 4090"`` is the device asked about: recorded in the document as
    ``result.target_device`` (its name and total), so that every verdict names that card, not the one the total alone,
    ``software.gpu_name`` or an earlier ``result.target_device.name`` would (an RTX 3090's total is 24 GiB, one of an
    RTX 4090's nominal memories); written back with the answer, as a ``--device-memory`` size is."""
    card = getattr(value, "card", None)
    if value is None or card is None:
        return
    from ledgerspec.contract.edit import set_plain

    set_plain(doc, ("result", "target_device", "name"), card, force=True)
    set_plain(doc, ("result", "target_device", "memory"), int(value), force=True)


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
