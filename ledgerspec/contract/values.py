"""Value forms and provenance.

Any field is written as a plain value (``rank: 16``), the word ``UNKNOWN`` (or
``CONFIGURATION-SPECIFIC``), or the long form ``{value, source, note, method}``.
:class:`Value` is the one typed view of all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledgerspec.contract.units import UnitError, parse_size

UNKNOWN_WORDS = ("UNKNOWN", "CONFIGURATION-SPECIFIC")
#: provenance strength, strongest first; a plain (declared) input ranks with VERIFIED
SOURCE_RANK = {
    "MEASURED": 5,
    "VERIFIED": 4,
    "DECLARED": 4,
    "CALCULATED": 3,
    "ASSUMPTION": 2,
    "CONFIGURATION-SPECIFIC": 1,
    "UNKNOWN": 0,
}
EXACT_SOURCES = frozenset({"MEASURED", "VERIFIED", "CALCULATED"})
_SWITCH_WORDS = {"on": True, "yes": True, "true": True, "off": False, "no": False, "false": False}


@dataclass(frozen=True)
class Value:
    """One field as written. ``form`` is absent | plain | word | long."""

    form: str
    raw: Any = None
    value: Any = None
    source: str | None = None
    note: str | None = None
    method: str | None = None

    @classmethod
    def of(cls, raw: Any, present: bool = True) -> Value:
        if not present:
            return cls("absent")
        if isinstance(raw, str) and raw.strip() in UNKNOWN_WORDS:
            return cls("word", raw, None, raw.strip())
        if (
            isinstance(raw, dict)
            and "source" in raw
            and set(raw) - {"value", "source", "note", "method"}
            <= {k for k in raw if isinstance(k, str) and k.startswith("x-")}
        ):
            source = raw.get("source")
            return cls(
                "long",
                raw,
                raw.get("value"),
                source if isinstance(source, str) else None,
                _str_or_none(raw.get("note")),
                _str_or_none(raw.get("method")),
            )
        return cls("plain", raw, raw)

    @property
    def present(self) -> bool:
        return self.form != "absent"

    @property
    def unknown(self) -> bool:
        """Absent, UNKNOWN or CONFIGURATION-SPECIFIC: nothing usable is known."""
        return self.form == "absent" or self.source in UNKNOWN_WORDS or (self.form == "long" and self.value is None)

    @property
    def known(self) -> bool:
        return not self.unknown

    def effective_source(self, figure: bool) -> str:
        """The provenance that counts: a bare figure is an ASSUMPTION, a bare input is DECLARED."""
        if self.form == "absent":
            return "UNKNOWN"
        if self.source:
            return self.source
        return "ASSUMPTION" if figure else "DECLARED"

    def size(self) -> int | None:
        """The value as bytes, or None when unknown or unreadable."""
        if self.unknown:
            return None
        try:
            return parse_size(self.value)
        except UnitError:
            return None

    def number(self) -> float | None:
        if self.unknown or isinstance(self.value, bool) or not isinstance(self.value, int | float):
            return None
        return self.value

    def integer(self) -> int | None:
        if self.unknown or isinstance(self.value, bool) or not isinstance(self.value, int):
            return None
        return self.value

    def switch(self) -> bool | None:
        """A two-valued switch: true/false, ON/OFF, YES/NO in any case."""
        if self.unknown:
            return None
        if isinstance(self.value, bool):
            return self.value
        if isinstance(self.value, str):
            return _SWITCH_WORDS.get(self.value.strip().lower())
        return None

    def text(self) -> str | None:
        if self.unknown or self.value is None:
            return None
        return str(self.value)


def _str_or_none(x: Any) -> str | None:
    return x if isinstance(x, str) and x.strip() else None
