"""What ``reserved_step`` costs for the 7B example, against the plain estimate, and whether its figures agree.

    python benchmarks/reserved_step.py      # writes benchmarks/results/reserved.md

``examples/llama-2-7b-lora.ledger.yaml`` (Llama-2-7b, LoRA r=16 on q_proj/v_proj, bf16, AdamW, 2048 tokens,
checkpointing, accumulation 16: two micro-steps traced). Each measurement is a fresh process, so imports and the first
trace's warm-up are in every wall time:

- ``estimate``: the plain estimate (two probes of 2 and 3 layers, figures extrapolated to 32; cache off);
- ``reserved_step``: three probes (2, 3, 4 layers) traced with the event log, the 32-layer stream built from them
  (:mod:`ledgerspec.derivations.allocator.depth`) and replayed through the allocator model; also with
  ``parallel=True`` (the 4-layer probe in a forked process);
- ``full trace``: the 32-layer step traced with the event log and replayed (what ``reserved_step`` falls back to).

Figures: the built stream's replay per protocol phase, as the estimate's tracker counts (``allocated``) and as the
allocator counts (``allocator_allocated``: whole blocks), beside the plain estimate's extrapolated figures; the
built stream against the full trace's, event by event (a digest of both).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LEDGER = ROOT / "examples" / "llama-2-7b-lora.ledger.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "reserved.md"
GiB = 2**30


def worker(kind: str) -> dict[str, object]:
    """One measurement, in this (fresh) process."""
    started = time.perf_counter()
    from ledgerspec.contract.document import load

    doc = load(str(LEDGER))
    out: dict[str, object] = {"kind": kind}
    if kind == "estimate":
        from ledgerspec.derivations.estimate.estimator import estimate

        est = estimate(doc, store=None)
        out["phases"] = est.phases
        out["plan"] = est.plan.describe()
    else:
        from ledgerspec.derivations.allocator.depth import canonical
        from ledgerspec.derivations.allocator.step import replay_step, reserved_step, step_events

        if kind == "full":
            t0 = time.perf_counter()
            step = step_events(doc, layers=None)
            traced = time.perf_counter() - t0
            replayed = replay_step(doc, step=step)
        else:
            replayed = reserved_step(doc, parallel=kind == "parallel")
            step = replayed.step
            traced = step.seconds
        out["method"] = step.method
        out["fallback"] = step.fallback
        out["events"] = len(step.events)
        out["stream"] = hashlib.sha256(repr(canonical(step.events)).encode()).hexdigest()[:16]
        out["stream_seconds"] = traced
        out["build_seconds"] = step.build_seconds
        t0 = time.perf_counter()
        replay_step(doc, step=step)  # once more, timed alone
        out["replay_seconds"] = time.perf_counter() - t0
        out["phases"] = {name: [f.allocated, f.allocator_allocated, f.reserved] for name, f in replayed.phases.items()}
        out["figures"] = {name: step.figures[name] for name in replayed.phases}
    out["seconds_in_process"] = time.perf_counter() - started
    return out


def measure(kind: str) -> dict[str, object]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", kind],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LEDGERSPEC_CACHE_DIR": "off"},
        check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall"] = time.perf_counter() - t0
    return result


def gib(n: int) -> str:
    return f"{n / GiB:.3f}"


def main() -> None:
    import platform

    import torch
    import transformers

    from benchmarks.machine import cpu_model, memory_bytes

    load = os.getloadavg()[0]
    runs = {kind: measure(kind) for kind in ("estimate", "reserved", "parallel", "full")}
    est, res, par, full = runs["estimate"], runs["reserved"], runs["parallel"], runs["full"]
    lines = [
        "# `reserved_step`: the 7B example at full depth",
        "",
        "Written by `python benchmarks/reserved_step.py`. "
        f"Machine: {platform.machine()}, {cpu_model()}, {os.cpu_count()} CPU cores, "
        f"{memory_bytes() / GiB:.0f} GiB, shared with other jobs (load average {load:.1f} at the start); no GPU. "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
        f"`{LEDGER.relative_to(ROOT)}`: {est['plan']}. Each row a fresh process (imports and the first trace's "
        "warm-up included in the wall time; the estimate cache off). `stream s`: tracing (and building) the 32-layer "
        "stream; `replay s`: its replay through the allocator model, timed alone.",
        "",
        "| run | wall s | stream s | of which built s | replay s | events | stream digest |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| plain estimate (2 and 3 layers, extrapolated) | {est['wall']:.1f} | | | | | |",
    ]
    for name, r in (
        ("`reserved_step` (probes 2, 3, 4; built to 32)", res),
        ("`reserved_step(parallel=True)`", par),
        ("full trace of 32 layers + replay", full),
    ):
        lines.append(
            f"| {name} | {r['wall']:.1f} | {r['stream_seconds']:.1f} | {r['build_seconds']:.2f} | "
            f"{r['replay_seconds']:.1f} | {r['events']} | `{r['stream']}` |"
        )
    same = res["stream"] == full["stream"] == par["stream"]
    lines += [
        "",
        f"How the stream was obtained: {res['method']}"
        + (f" (fallback: {res['fallback']})" if res["fallback"] else "")
        + f". Built and traced streams event by event the same (digest of the canonical streams): {same}.",
        "",
        "Per protocol phase, bytes (GiB in brackets): the plain estimate's extrapolated figure, the built stream's "
        "replay as the estimate's tracker counts it (`allocated`: each live request rounded up to 512 B), as the "
        "allocator counts it (`allocator_allocated`: whole blocks; a cached large block less than 1 MiB bigger than "
        "the request is handed out whole), and the peak reserved.",
        "",
        "| phase | estimate | allocated | allocated - estimate | allocator_allocated - allocated | reserved |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    phases = res["phases"]
    assert isinstance(phases, dict)
    estimate_phases = est["phases"]
    assert isinstance(estimate_phases, dict)
    for name, (allocated, allocator, reserved) in phases.items():
        e = estimate_phases[name]
        lines.append(
            f"| {name} | {e} ({gib(e)}) | {allocated} | {allocated - e} | {allocator - allocated} | "
            f"{reserved} ({gib(reserved)}) |"
        )
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    else:
        main()
