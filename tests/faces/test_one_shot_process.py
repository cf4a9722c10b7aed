"""A one-shot ``resolve`` hides bitsandbytes from PEFT for the rest of the process (a faster start); only the
``ledgerspec`` program itself may ask for it. Under ``python -m pytest`` ``argv[0]`` is pytest's ``__main__.py``:
taking that for the program made a later in-process QLoRA estimate fail (``NameError: name 'bnb'``) whenever a
resolve ran first in a test worker."""

from __future__ import annotations

import os
import sys

import pytest

from ledgerspec.faces.commands.resolve import _one_shot_process


@pytest.mark.parametrize(
    ("argv0", "one_shot"),
    [
        ("/usr/local/bin/ledgerspec", True),
        (os.path.join("site-packages", "ledgerspec", "__main__.py"), True),
        (os.path.join("site-packages", "pytest", "__main__.py"), False),
        ("/usr/bin/ipython", False),
        ("", False),
    ],
)
def test_only_the_ledgerspec_program_is_one_shot(monkeypatch: pytest.MonkeyPatch, argv0: str, one_shot: bool) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    assert _one_shot_process() is one_shot
