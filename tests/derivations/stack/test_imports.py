"""The stack's first import with the garbage collector paused (:mod:`ledgerspec.derivations.stack.imports`): only
when the command line asks for it, only for the first import, and the collector is on again afterwards. Each case
runs in a fresh Python (the test process has imported the stack long ago) and imports a small standard module in
the stack's place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


PAUSED_ESTIMATE = """
import gc, json, sys
from ledgerspec.faces.cli import main
code = main(["estimate", sys.argv[1], "-o", sys.argv[2]])
print(json.dumps({"code": code, "frozen": gc.get_freeze_count() > 0, "enabled": gc.isenabled()}))
"""


@pytest.mark.slow
def test_a_command_that_paused_the_collector_estimates_what_this_process_does(tmp_path: Path) -> None:
    """The ``estimate`` command (a fresh process: the stack imported with the collector paused, then frozen) writes
    the figures this test process's estimate gives (the stack imported long ago, the collector never paused), phase
    for phase and component for component, on a step with checkpointing and two micro-steps."""
    pytest.importorskip("peft")
    import shutil

    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate.estimator import estimate
    from tests.support.estimate_docs import DATA, ledger, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    source, out = tmp_path / "in.ledger.yaml", tmp_path / "out.ledger.yaml"
    source.write_text(ledger_text(checkpointing=True, accumulation=2), encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-c", PAUSED_ESTIMATE, str(source), str(out)], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert run.returncode == 0, run.stderr[-2000:]
    status = json.loads(run.stdout.strip().splitlines()[-1])
    assert status == {"code": 0, "frozen": True, "enabled": True}  # paused, frozen, the collector on again
    written = load(out).plain["x-estimate"]
    here = estimate(ledger(checkpointing=True, accumulation=2))
    assert written["phases"] == here.phases
    assert {k: v for k, v in written["at_peak"].items() if k != "phase"} == here.at_peak
