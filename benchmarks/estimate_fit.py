"""How long "what is the largest batch that fits?" and a 5 x 5 sweep take, imports included, and whether the answer
is right (targets: the largest microbatch of a 7B QLoRA at 1024 tokens in under 15 s; a 5 x 5 sweep in under 20 s).

    python benchmarks/estimate_fit.py            # section "fit" of benchmarks/results/estimate.md
    python benchmarks/estimate_fit.py --check    # also traces the answer and the value above it (slower)

The ledger: examples/llama-2-7b-qlora.intake.yaml (Llama-2-7b, QLoRA nf4 + double quant, LoRA r=16 on all linear
layers, paged AdamW 8-bit, checkpointing on) at max_length 1024 (its sequence profile clipped to it), resolved
once. Each command is a fresh process (``python -m ledgerspec estimate ... --dry-run``): wall time of the whole
command, with the load average of the machine before it ran (the machine is shared: timings vary with load).
``--check`` traces microbatches b* and b*+1 with a plain estimate each and compares their peaks with the answer.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine, write_section  # noqa: E402

DEVICE = "24GiB"
SWEEP = ["microbatch=1,2,4,8,16", "max_length=256,512,1024,2048,4096"]


def ledgerspec(*args: str) -> tuple[float, str, float]:
    """Run ``ledgerspec ARGS`` in a fresh process: (wall seconds, stdout, load average before)."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerspec", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ledgerspec {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return wall, proc.stdout, load


def prepare(folder: Path) -> Path:
    intake = (ROOT / "examples" / "llama-2-7b-qlora.intake.yaml").read_text(encoding="utf-8")
    for old, new in (("max_length: 4096", "max_length: 1024"), ("sequence_p50: 1210", "sequence_p50: 1024")):
        intake = intake.replace(old, new)
    intake = intake.replace("sequence_p95: 3380", "sequence_p95: 1024")
    intake = intake.replace("config_path: configs/", f"config_path: {ROOT / 'examples' / 'configs'}/")
    src = folder / "qlora-1024.intake.yaml"
    src.write_text(intake, encoding="utf-8")
    ledger = folder / "qlora-1024.ledger.yaml"
    subprocess.run(
        [sys.executable, "-m", "ledgerspec", "resolve", str(src), "-o", str(ledger), "--offline"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return ledger


def check(ledger: Path, best: int) -> str:
    """Trace b* and b*+1 with plain estimates: their predicted peaks."""
    from ledgerspec.contract.document import load
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.sweep import apply

    doc = load(ledger)
    peaks = {b: estimate(apply(doc, {"microbatch": b})).peak_allocated for b in (best, best + 1)}
    return ", ".join(f"microbatch {b}: {format_size(p)} ({p:,} B) traced" for b, p in peaks.items())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="trace the answer and the value above it")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = prepare(Path(tmp))
        fit_s, fit_out, fit_load = ledgerspec(
            "estimate", str(ledger), "--fit", "microbatch", "--device-memory", DEVICE, "--dry-run"
        )
        sweep_s, sweep_out, sweep_load = ledgerspec(
            "estimate", str(ledger), "--sweep", *SWEEP, "--device-memory", DEVICE, "--dry-run"
        )
        answer = fit_out.splitlines()[0]
        m = re.search(r": (\d+) \(peak", answer)
        checked = check(ledger, int(m.group(1))) if args.check and m else ""
    traced = re.search(r"\((\d+) configurations from (\d+) traced estimates", sweep_out)
    lines = [
        "## fit: the largest microbatch, and a 5 x 5 sweep (`benchmarks/estimate_fit.py`)",
        "",
        f"Machine: {machine()}, shared with other jobs; load average before each command in the table.",
        "",
        "Ledger: examples/llama-2-7b-qlora.intake.yaml at max_length 1024 (Llama-2-7b QLoRA nf4, r=16 all-linear, "
        f"paged AdamW 8-bit, checkpointing on), device {DEVICE}. Wall time of a fresh process, imports included.",
        "",
        "| command | wall time | load average | target |",
        "| --- | --- | --- | --- |",
        f"| `estimate --fit microbatch` | {fit_s:.1f} s | {fit_load:.1f} | under 15 s |",
        f"| `estimate --sweep {' '.join(SWEEP)}` | {sweep_s:.1f} s | {sweep_load:.1f} | under 20 s |",
        "",
        f"Answer: {answer}",
    ]
    if traced:
        lines.append(f"Sweep: {traced.group(1)} configurations from {traced.group(2)} traced estimates.")
    if checked:
        lines.append(f"Check (plain estimates at the answer and the value above): {checked}.")
    lines += ["", "Sweep output:", "", "```text", sweep_out.rstrip(), "```"]
    write_section("fit", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
