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


SWEEP = """
import json, sys
from ledgerspec.faces.cli import main

try:
    main(["estimate", sys.argv[1], "--sweep", "microbatch=1,2", "--jobs", "2", "--dry-run"])
except SystemExit:
    pass
print(json.dumps({"torch": "torch" in sys.modules}))
"""


def test_a_sweep_the_cache_answers_imports_no_torch(tmp_path: Path) -> None:
    """A sweep imports the stack before it forks its workers, but only when one of its estimates is traced: asked
    again, the cache answers every one, and nothing imports torch (the warm-up would cost the repeat its answer)."""
    from tests.support.estimate_docs import DATA, ledger_text

    text = ledger_text(arch="tiny-llama-gqa", seq=32)
    ledger = tmp_path / "tiny.ledger.yaml"
    ledger.write_text(text.replace("config_path: tiny-llama-gqa/", f"config_path: {DATA}/tiny-llama-gqa/"))
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP, encoding="utf-8")
    root = Path(__file__).resolve().parents[3]
    # a Python of its own, not one forked from the test session's server (which has imported torch already)
    env = {"PYTHONPATH": str(root), "LEDGERSPEC_CACHE_DIR": str(tmp_path / "cache")}
    env["LEDGERSPEC_LAUNCHER"] = "subprocess"
    seen = []
    for _ in range(2):
        proc = fresh_python([script, ledger], env=env, cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1])["torch"])
    assert seen == [True, False]
