"""The forked depth probe finds the stack imported (:meth:`ledgerspec.derivations.estimate.estimator.Prepared.warm`).

A cold ``estimate`` traces its two depth probes at once, the deeper one in a process forked beside this one. Forked
before the model's modules were imported, both processes imported them (transformers' masking utilities and through
them torch._dynamo, the model class, PEFT): about 3 s of CPU twice on a 7B Llama LoRA. Each case runs in a process
of its own: the modules the forked probe imports that its parent had not, with and without the warm-up, and the
figures of both probes, which must not depend on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import fresh_python

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from ledgerspec.derivations.engine.beside import both, can_fork
from ledgerspec.derivations.estimate.estimator import prepare
from tests.support.estimate_docs import ledger

p = prepare(ledger(arch="tiny-llama-gqa", seq=32))
if sys.argv[1] == "warm":
    p.warm()
before = set(sys.modules)
forked = can_fork()
n1, n2 = p.plan.probes


def deep():
    figures = p.trace(n2)
    return figures, sorted(set(sys.modules) - before)


shallow, (deeper, new) = both(lambda: p.trace(n1), deep, True)
print(json.dumps({"forked": forked, "new": new, "figures": [shallow, deeper]}))
"""

HEAVY = ("transformers.models.", "transformers.masking_utils", "peft", "torch._dynamo")


def run(tmp_path: Path, mode: str) -> dict[str, object]:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT, encoding="utf-8")
    root = Path(__file__).resolve().parents[3]
    proc = fresh_python([script, mode], env={"PYTHONPATH": str(root)}, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_the_forked_probe_imports_nothing_of_the_stack_again(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    warm, cold = run(tmp_path, "warm"), run(tmp_path, "cold")
    if not warm["forked"]:
        pytest.skip("no second CPU: the probes run one after the other")
    heavy = [m for m in warm["new"] if m.startswith(HEAVY)]  # type: ignore[attr-defined]
    assert heavy == [], heavy
    # the control: without the warm-up the forked probe imports the model's module itself
    assert "transformers.models.llama.modeling_llama" in cold["new"]  # type: ignore[operator]
    assert warm["figures"] == cold["figures"]
