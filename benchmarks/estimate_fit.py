"""How long "what is the largest batch that fits?" and a 5 x 5 sweep take, imports included, and whether the answer
is right (targets: the largest microbatch of a 7B QLoRA at 1024 tokens in under 15 s; a 5 x 5 sweep in under 20 s).

    python benchmarks/estimate_fit.py            # section "fit" of benchmarks/results/estimate.md
    python benchmarks/estimate_fit.py --check    # also traces the fit's answer and the value above it, and
                                                 # every cell of the sweep the model gave (slower)

The ledger: examples/llama-2-7b-qlora.intake.yaml (Llama-2-7b, QLoRA nf4 + double quant, LoRA r=16 on all linear
layers, paged AdamW 8-bit, checkpointing on) at max_length 1024 (its sequence profile clipped to it), resolved
once. Each command is a fresh process (``python -m ledgerspec estimate ... --dry-run``): wall time of the whole
command, with the load average of the machine before it ran (the machine is shared: timings vary with load).
``--check`` traces microbatches b* and b*+1 with a plain estimate each and compares their peaks with the answer,
and traces every cell of the sweep that came from the batch x length model with a plain estimate: the largest
difference of a phase peak and of the peak is reported.
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


def ledgerspec(*args: str) -> tuple[float, str, float, float]:
    """Run ``ledgerspec ARGS`` in a fresh process: (wall seconds, stdout, load average before, CPU seconds)."""
    load = os.getloadavg()[0]
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerspec", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**os.environ, "LEDGERSPEC_CACHE_DIR": "off"},  # every run traced (benchmarks/startup.py: the cache)
    )
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ledgerspec {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return wall, proc.stdout, load, cpu


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


def check_sweep(ledger: Path) -> str:
    """Every sweep cell the CLI's sweep wrote rather than traced (``grid_sweep_rows``, as ``estimate --sweep`` runs
    it), traced with a plain estimate (two processes): the largest differences."""
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate import search, sweep
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.gridsweep import grid_sweep_rows

    doc = load(ledger)
    points = sweep.grid(sweep.parse_axes(SWEEP))
    grid = grid_sweep_rows(doc, points, "cuda", "auto", estimate, jobs=2)
    assert grid is not None
    modelled = [r for r in grid.rows if not r.traced]
    full = search.run_estimates([sweep.apply(doc, r.point) for r in modelled], estimate, jobs=2)
    worst_phase = (0.0, "")
    worst_peak = (0.0, "")
    for row, figures in zip(modelled, full, strict=True):
        where = ", ".join(f"{k}={v}" for k, v in row.point.items())
        peak = max(figures[k] for k in row.phases)
        d = abs(row.peak - peak) / peak
        worst_peak = max(worst_peak, (d, where))
        for k, v in row.phases.items():
            worst_phase = max(worst_phase, (abs(v - figures[k]) / figures[k], f"{where}, {k}"))
    return (
        f"{len(modelled)} cells written from the traced streams, each traced in full: largest peak difference "
        f"{100 * worst_peak[0]:.3f} % "
        f"({worst_peak[1]}), largest phase difference {100 * worst_phase[0]:.3f} % ({worst_phase[1]})"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="trace the answer and the value above it")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = prepare(Path(tmp))
        fit_s, fit_out, fit_load, fit_cpu = ledgerspec(
            "estimate", str(ledger), "--fit", "microbatch", "--device-memory", DEVICE, "--dry-run"
        )
        sweep_s, sweep_out, sweep_load, sweep_cpu = ledgerspec(
            "estimate", str(ledger), "--sweep", *SWEEP, "--device-memory", DEVICE, "--dry-run", "--jobs", "1"
        )
        jobs_s, _, jobs_load, jobs_cpu = ledgerspec(
            "estimate", str(ledger), "--sweep", *SWEEP, "--device-memory", DEVICE, "--dry-run", "--jobs", "2"
        )
        answer = fit_out.splitlines()[0]
        m = re.search(r": (\d+) \(peak", answer)
        checked = check(ledger, int(m.group(1))) if args.check and m else ""
        swept = check_sweep(ledger) if args.check else ""
    traced = re.search(r"\((\d+) configurations from (\d+) traced estimates", sweep_out)
    lines = [
        "## fit: the largest microbatch, and a 5 x 5 sweep (`benchmarks/estimate_fit.py`)",
        "",
        f"Machine: {machine()}, shared with other jobs; load average before each command in the table.",
        "",
        "Ledger: examples/llama-2-7b-qlora.intake.yaml at max_length 1024 (Llama-2-7b QLoRA nf4, r=16 all-linear, "
        f"paged AdamW 8-bit, checkpointing on), device {DEVICE}. Wall time of a fresh process, imports included; "
        "CPU time: user + system of the command and its worker processes (the work, whatever the load).",
        "",
        "| command | wall time | CPU time | load average | target |",
        "| --- | --- | --- | --- | --- |",
        f"| `estimate --fit microbatch` | {fit_s:.1f} s | {fit_cpu:.1f} s | {fit_load:.1f} | under 15 s |",
        f"| `estimate --sweep {' '.join(SWEEP)} --jobs 1` | {sweep_s:.1f} s | {sweep_cpu:.1f} s | {sweep_load:.1f} "
        "| under 20 s |",
        f"| the same sweep `--jobs 2` (the default on 2 CPUs) | {jobs_s:.1f} s | {jobs_cpu:.1f} s | {jobs_load:.1f} "
        "| under 20 s |",
        "",
        f"Answer: {answer}",
    ]
    if traced:
        lines.append(f"Sweep: {traced.group(1)} configurations from {traced.group(2)} traced estimates.")
    if checked:
        lines.append(f"Check (plain estimates at the answer and the value above): {checked}.")
    if swept:
        lines.append(f"Check of the sweep: {swept}.")
    lines += ["", "Sweep output:", "", "```text", sweep_out.rstrip(), "```"]
    write_section("fit", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
