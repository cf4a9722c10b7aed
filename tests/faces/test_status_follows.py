"""The declared status follows the evidence (spec, "The status ladder"): every command that writes a ledger sets it
to what its result supports, up or down, unless ``--keep-status``; and each runs validate's input checks before it
imports torch, so a bad input fails at once with validate's line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ledgerspec.checks.fix import status_fix
from ledgerspec.checks.validate import validate
from ledgerspec.contract.document import from_text, load
from ledgerspec.faces.status import change_line, settle
from tests.support import EXAMPLES, REPO_ROOT, CliRunner

TINY = EXAMPLES / "tiny" / "tiny-llama-lora.ledger.yaml"


def _tiny(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "tiny" / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / TINY.name
    shutil.copy(TINY, path)
    return path


def _status_line(path: Path) -> str:
    return next(line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("status:"))


CALCULATED = """ledgerspec: ledger/v1
status: {status}
identity: {{model_id: m/x, revision: abc}}
method: {{kind: LoRA, rank: 8, target_modules: [q_proj]}}
base_model: {{loaded_dtype: bfloat16}}
adapter: {{dtype: float32}}
workload: {{microbatch: 1, max_length: 512, sequence_p95: 400, packing: true}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: false}}
ledger:
  frozen_base: {{value: 1000000, source: CALCULATED, method: n x 2}}
  adapter: {{value: 4000, source: CALCULATED, method: n x 4}}
  gradients: {{value: 4000, source: CALCULATED, method: n x 4}}
  optimizer: {{value: 8000, source: CALCULATED, method: 2 x n x 4}}
"""


@pytest.mark.parametrize(
    ("declared", "want", "verb"),
    [("INSUFFICIENT DATA", "CALCULATED", "raised"), ("VALIDATED", "CALCULATED", "lowered"), ("CALCULATED", None, "")],
)
def test_status_fix_goes_up_or_down_and_says_from_what(declared: str, want: str | None, verb: str) -> None:
    report = validate(from_text(CALCULATED.format(status=declared)))
    fix = status_fix(report)
    if want is None:
        assert fix is None
        return
    assert fix is not None
    status, comment = fix
    assert status == want and comment.startswith(f"ledgerspec: {verb} from {declared}: ")
    if verb == "raised":  # what the evidence now holds
        assert "the minimum intake is complete" in comment
    else:  # what holds it down
        assert "VALIDATED" not in comment.split(": ", 2)[2] or "needs" in comment


def test_settle_keeps_the_status_when_asked() -> None:
    doc = from_text(CALCULATED.format(status="INSUFFICIENT DATA"))
    assert settle(doc, keep=True).declared_status == "INSUFFICIENT DATA"
    assert settle(doc).declared_status == "CALCULATED"
    raised = "f: status raised from INSUFFICIENT DATA to CALCULATED"
    assert change_line("f", "INSUFFICIENT DATA", "CALCULATED") == raised
    assert change_line("f", "VALIDATED", "CANDIDATE") == "f: status lowered from VALIDATED to CANDIDATE"
    assert change_line("f", "CANDIDATE", "CANDIDATE") is None


@pytest.mark.slow
def test_resolve_and_estimate_raise_the_status_and_keep_status_keeps_it(cli: CliRunner, tmp_path: Path) -> None:
    """The tiny ledger declares INSUFFICIENT DATA: resolve supports CALCULATED, an estimate that fits CANDIDATE."""
    path = _tiny(tmp_path)
    code, _, err = cli("resolve", path, "--offline")
    assert code == 0 and "status raised from INSUFFICIENT DATA to CALCULATED" in err, err
    assert re.match(r"status: CALCULATED +# ledgerspec: raised from INSUFFICIENT DATA: ", _status_line(path))
    kept = tmp_path / "kept.ledger.yaml"
    code, _, err = cli("estimate", path, "--device-memory", "1GiB", "--target", "cpu", "--keep-status", "-o", kept)
    assert code == 0 and "status" not in err.replace("status:", ""), err
    assert load(kept).plain["status"] == "CALCULATED"
    # 4 GiB: on 1 GiB the unnamed device's catalogue range outside the allocator (up to 1.75 GiB) alone could take
    # it all, and a verdict at the edge does not fit and holds the status (tests/checks/test_ladder.py)
    code, _, err = cli("estimate", path, "--device-memory", "4GiB")
    assert code == 0 and "status raised from CALCULATED to CANDIDATE" in err, err
    assert load(path).plain["status"] == "CANDIDATE" and validate(load(path)).ok
    # the evidence goes: a device the prediction does not fit lowers it again
    code, _, err = cli("estimate", path, "--device-memory", "1MiB")
    assert code == 1 and "status lowered from CANDIDATE to CALCULATED" in err, err
    assert "does not fit the target device" in _status_line(path)


#: bad inputs validate finds without torch, and the line each command must print
BAD_INPUTS = {
    "rank-word": (("rank: 4", "rank: sixteen"), "method.rank: expected an integer >= 1, got 'sixteen' [schema]"),
    "typo-key": (("target_modules:", "target_module:"), "(did you mean 'target_modules'?)"),
    "optimizer-typo": (("name: adamw_torch", "name: adamw_trch"), "unknown optimizer 'adamw_trch': did you mean"),
    "config-missing": (("config_path: tiny-llama/config.json", "config_path: nowhere/config.json"), "[LS008]"),
    # a misspelt section was read as absent: resolve wrote its figures, estimate blamed line 1 for the missing one
    "section-typo": (("\noptimizer:", "\noptimiser:"), "unknown key 'optimiser' (did you mean 'optimizer'?)"),
    # what the device verdict reads as declared: unreadable, it was passed over (no verdict, the catalogue's figure)
    "device-memory-fraction": (
        ("ledgerspec: ledger/v1\n", "ledgerspec: ledger/v1\nresult: {target_device: {memory: 24.3 GiB}}\n"),
        "result.target_device.memory: '24.3 GiB' is not a whole number of bytes (give 26091926323 or 24883 MiB)",
    ),
    "outside-total-fraction": (
        ("ledgerspec: ledger/v1\n", "ledgerspec: ledger/v1\noutside_allocator: {total: 1.67 GiB}\n"),
        "outside_allocator.total: '1.67 GiB' is not a whole number of bytes (give 1793148846 or 1710 MiB) [schema]",
    ),
}
_PROBE = """
import json, sys
from ledgerspec.faces.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    out.append([code, sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules)])
print(json.dumps(out))
"""


def test_a_bad_input_fails_before_torch_is_imported(tmp_path: Path) -> None:
    """resolve, estimate, measure, triage and shard run validate's input checks first: with a bad input none of them
    imports torch (so it fails in well under a second, not after the seconds torch takes to import)."""
    text = _tiny(tmp_path).read_text(encoding="utf-8")
    runs = []
    lines = {}
    for name, ((old, new), expected) in BAD_INPUTS.items():
        assert old in text, old
        path = tmp_path / f"{name}.ledger.yaml"
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
        lines[str(path)] = expected
        for command in (["resolve"], ["estimate"], ["measure"], ["triage"], ["shard", "--nproc", "2"]):
            runs.append([command[0], str(path), *command[1:]])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(runs)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(code == 1 for code, _ in results), results
    assert all(heavy == [] for _, heavy in results), "a bad input imported torch & co."
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == len(runs), err  # one line per run
    for run, line in zip(runs, err, strict=True):
        assert line.startswith(f"{run[1]}:") and f": {run[0]}: " in line and lines[run[1]] in line, line


def test_extension_keys_and_notes_at_the_top_level_do_not_stop_a_command(tmp_path: Path) -> None:
    """An unknown top-level key stops a command (a misspelt section); what the schema allows there does not."""
    from ledgerspec.faces.preflight import preflight

    text = _tiny(tmp_path).read_text(encoding="utf-8")
    preflight(from_text(text + "x-mine: {anything: 1}\nnotes: free text\n", str(tmp_path / "ok.ledger.yaml")), "t")
    with pytest.raises(Exception, match=r"unknown key 'optimiser'"):
        preflight(from_text(text.replace("\noptimizer:", "\noptimiser:"), str(tmp_path / "t.ledger.yaml")), "t")


@pytest.mark.slow  # traces the tiny model
def test_an_estimate_says_beside_its_answer_that_a_declared_kernel_is_not_modelled(
    cli: CliRunner, tmp_path: Path
) -> None:
    """A misspelt kernel runs as transformers' own op: the answer is the eager step's, and it says so (LS013), not
    only `validate` afterwards."""
    path = _tiny(tmp_path)
    text = path.read_text(encoding="utf-8").replace(
        "software:\n", "software:\n  kernels: {cross_entropy: liger_fused_linear_crossentropy}\n", 1
    )
    path.write_text(text, encoding="utf-8")
    code, _, err = cli("estimate", path, "--dry-run", "--target", "cpu")
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if ": LS013: " in ln]
    assert line.startswith(f"{path}:") and "did you mean liger_fused_linear_cross_entropy?" in line
    assert "the estimate runs the eager cross_entropy instead" in line
