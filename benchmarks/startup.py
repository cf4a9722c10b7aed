"""Time to an answer: the five questions a user asks one after another, each a fresh ``ledgerspec`` process.

    python benchmarks/startup.py          # writes benchmarks/results/startup.md

Each command runs twice: cold (an empty estimate cache: everything traced) and again (the same question, answered from
the cache where it can be: ``ledgerspec estimate`` keeps every traced estimate, docs: "The estimate cache"). Wall time
of the whole process (imports included), its CPU time (user + system, worker processes included), and the machine's
one-minute load average just before it: the machine is shared, and a wall time under load is not a quiet one.

Targets (issue "Answers in seconds"): a cold estimate of a 7B LoRA ledger within 5 s, a repeated one within 1 s,
``--fit microbatch`` within 8 s, the 5 x 5 sweep within 15 s, ``--devices`` within 20 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine  # noqa: E402
from benchmarks.estimate_fit import DEVICE, SWEEP, prepare  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "startup.md"


def lora_ledger(folder: Path) -> Path:
    """The bundled Llama-2-7b LoRA ledger (bf16, r=16 q/v, AdamW, checkpointing), its config path made absolute."""
    text = (ROOT / "examples" / "llama-2-7b-lora.ledger.yaml").read_text(encoding="utf-8")
    text = text.replace("config_path: configs/", f"config_path: {ROOT / 'examples' / 'configs'}/")
    path = folder / "llama-2-7b-lora.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def timed(args: list[str], cache: Path) -> tuple[float, float, float, str]:
    """``ledgerspec ARGS`` in a fresh process with the estimate cache in ``cache``: wall s, CPU s, load, last line."""
    load = os.getloadavg()[0]
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerspec", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LEDGERSPEC_CACHE_DIR": str(cache)},
        check=False,
    )
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ledgerspec {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return wall, cpu, load, lines[-1] if lines else ""


def reference() -> str:
    """How fast this machine is right now, for comparing runs on a shared machine: a fixed pure-Python loop and
    ``import torch, transformers.modeling_utils, peft`` in a fresh process (a plain import)."""
    code = (
        "import time\nt = time.perf_counter()\ns = 0\nfor i in range(20_000_000):\n    s += i\n"
        "print(time.perf_counter() - t)"
    )
    loop = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    imports = []
    for _ in range(2):  # the first may read the libraries from disk; the second finds them in the page cache
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import torch, transformers.modeling_utils, peft"], capture_output=True, check=True
        )
        imports.append(time.perf_counter() - t0)
    return (
        f"Reference, measured just before: a 20,000,000-iteration Python loop {loop:.2f} s; "
        f"`import torch, transformers.modeling_utils, peft` in a fresh process {imports[0]:.1f} s, again "
        f"{imports[1]:.1f} s (a plain import; a cold answer imports the same with the garbage collector paused, "
        "`ledgerspec/derivations/stack/imports.py`)."
    )


def main() -> None:
    rows: list[str] = []
    speed = reference()
    print(speed, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lora = lora_ledger(folder)
        qlora = prepare(folder)
        questions = [
            ("`estimate` (7B LoRA)", ["estimate", str(lora), "--dry-run"], 5.0, 1.0),
            (
                "`estimate --fit microbatch` (7B QLoRA, 1024 tokens)",
                ["estimate", str(qlora), "--fit", "microbatch", "--device-memory", DEVICE, "--dry-run"],
                8.0,
                None,
            ),
            (
                f"`estimate --sweep {' '.join(SWEEP)}` (7B QLoRA)",
                ["estimate", str(qlora), "--sweep", *SWEEP, "--device-memory", DEVICE, "--dry-run"],
                15.0,
                None,
            ),
            ("`estimate --devices` (7B LoRA)", ["estimate", str(lora), "--devices", "--dry-run"], 20.0, None),
        ]
        for i, (name, args, target, again_target) in enumerate(questions):
            cache = folder / f"cache-{i}"
            cold = timed(args, cache)
            again = timed(args, cache)
            for label, (wall, cpu, load, last), goal in (("cold", cold, target), ("again", again, again_target)):
                verdict = "" if goal is None else ("met" if wall <= goal else "NOT met")
                goal_text = "-" if goal is None else f"{goal:g} s {verdict}"
                rows.append(f"| {name} | {label} | {wall:.1f} s | {cpu:.1f} s | {load:.1f} | {goal_text} |")
                print(rows[-1], "|", last, flush=True)
    text = "\n".join(
        [
            "# Time to an answer (`benchmarks/startup.py`)",
            "",
            f"Machine: {machine()}; shared with other jobs (the load average before each command is in the table).",
            "",
            "Each command is a fresh `python -m ledgerspec ...` process: wall time of the whole command (imports "
            "included), CPU time of the command and its worker processes, and the one-minute load average before "
            "it. Cold: an empty estimate cache. Again: the same command right after, with the cache the cold run "
            "filled.",
            "",
            speed,
            "",
            "| question | cache | wall | CPU | load | target |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    RESULTS.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
