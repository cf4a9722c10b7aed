"""The stack's first import with the garbage collector paused (:mod:`ledgerspec.derivations.stack.imports`): only
when the command line asks for it, only for the first import, and the collector is on again afterwards. Each case
runs in a fresh Python (the test process has imported the stack long ago) and imports a small standard module in
the stack's place."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

PROGRAM = """
import gc, sys
from ledgerspec.derivations.stack import imports
imports.PAUSE_GC = {pause}
{before}
frozen = gc.get_freeze_count()
imports.import_stack(("xml.dom.minidom", "no_such_module_here"))
print(gc.isenabled(), gc.get_freeze_count() > frozen, "xml.dom.minidom" in sys.modules)
"""


def _run(pause: bool, before: str = "") -> str:
    code = PROGRAM.format(pause=pause, before=before)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("pause", "before", "expected"),
    [
        (True, "", "True True True"),  # the command line: imported with the collector off, then frozen, collector on
        (False, "", "True False False"),  # a library caller: nothing done (its own imports run as usual)
        (True, "import xml", "True False False"),  # already (partly) imported: nothing paused or frozen
        (True, "gc.disable()", "False False False"),  # a caller that turned the collector off keeps it off
    ],
)
def test_the_first_import_pauses_the_collector_only_when_asked(pause: bool, before: str, expected: str) -> None:
    assert _run(pause, before) == expected
