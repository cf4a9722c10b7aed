"""How long ``ledgerspec estimate`` takes for 7B-70B models, imports included (target: under 10 s).

    python benchmarks/estimate_speed.py     # section "speed" of benchmarks/results/estimate.md

Each model (config under examples/configs/) gets a ledger: LoRA r=16 on q_proj/v_proj, bf16 base, AdamW,
microbatch 1, sequence 2048, gradient checkpointing on, sdpa. Each run is a fresh process
(``python -m ledgerspec estimate FILE --dry-run``): wall time and CPU time of the whole command.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine, write_section  # noqa: E402

MODELS = [
    "llama-2-7b",
    "mistral-7b-v0.1",
    "llama-3.1-8b",
    "gemma-2-9b",
    "llama-2-13b",
    "qwen2.5-14b",
    "mixtral-8x7b",
    "llama-2-70b",
    "llama-3.1-70b",
]


def ledger(config: Path, attention: str) -> str:
    return f"""ledgerspec: ledger/v1
identity: {{model_id: bench, config_path: {config}}}
software: {{attention_implementation: {attention}}}
method: {{kind: LoRA, rank: 16, alpha: 32, target_modules: [q_proj, v_proj]}}
base_model: {{loaded_dtype: bfloat16, quantized: false}}
adapter: {{dtype: float32}}
workload: {{max_length: 2048, microbatch: 1, gradient_accumulation: 1, packing: false}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: true}}
"""


def run(path: Path) -> tuple[float, float, int, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerspec", "estimate", str(path), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LEDGERSPEC_CACHE_DIR": "off"},  # every run traced (benchmarks/startup.py: the cache)
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    peak = next(
        (
            ln.split()[2] + " " + ln.split()[3]
            for ln in proc.stdout.splitlines()
            if ln.strip().startswith("peak allocated")
        ),
        "",
    )
    note = peak if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1][:160]
    return wall, cpu, proc.returncode, note


def main() -> None:
    lines = [
        "## Speed (`benchmarks/estimate_speed.py`)",
        "",
        f"Machine: {machine()}.",
        "",
        "A fresh `python -m ledgerspec estimate FILE --dry-run` per row (imports included); LoRA r=16 q,v, "
        "bf16, AdamW, microbatch 1, seq 2048, checkpointing on, sdpa. Wall time depends on what else runs "
        "on the machine; CPU time is the process's own.",
        "",
        "| model | wall s | CPU s | exit | predicted peak allocated / error |",
        "| --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            cfg = ROOT / "examples" / "configs" / name / "config.json"
            path = Path(tmp) / f"{name}.ledger.yaml"
            path.write_text(ledger(cfg, "eager" if name.startswith("gemma") else "sdpa"))
            wall, cpu, code, note = run(path)
            lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {code} | {note} |")
            print(lines[-1], flush=True)
    write_section("speed", "\n".join(lines))


if __name__ == "__main__":
    main()
