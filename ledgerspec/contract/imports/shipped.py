"""The real ``config.json`` files ledgerspec ships (``examples/configs/<folder>/config.json``, listed with their
repository in ``examples/configs/SOURCES.md``): an imported model id that names one gets ``identity.config_path``,
so that ``resolve`` and ``estimate`` run offline."""

from __future__ import annotations

import re
from pathlib import Path

#: a row of the SOURCES.md table: | folder | repository | ...
_ROW = re.compile(r"^\|\s*([A-Za-z0-9._-]+)\s*\|\s*([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)\s*\|")


def default_dirs() -> list[Path]:
    """``examples/configs`` of the checkout this package runs from (absent in an installed wheel)."""
    here = Path(__file__).resolve().parents[3] / "examples" / "configs"
    return [here] if here.is_dir() else []


def find(model_id: str, dirs: list[Path]) -> Path | None:
    """The shipped config folder whose SOURCES.md repository is ``model_id`` (case-insensitive), else None."""
    want = model_id.strip().lower()
    for folder in dirs:
        sources = folder / "SOURCES.md"
        try:
            lines = sources.read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for line in lines:
            m = _ROW.match(line)
            if m and m.group(2).lower() == want and (folder / m.group(1) / "config.json").is_file():
                return folder / m.group(1) / "config.json"
    return None
