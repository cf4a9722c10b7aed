"""What ``LedgerCallback`` costs a real ``transformers.Trainer`` run, and what it records next to ``measure``.

    python benchmarks/callback_overhead.py [--device cpu|cuda] [--steps N] [--repeats R]

For each configuration (Llama-architecture models built from a config, LoRA r=4 on q/v, AdamW), the same Trainer
run (``tests/derivations/integrations/callback_run.py``: the ground truth's model, adapters and data, one process
per run) goes ``1 + steps`` optimizer steps with and without the callback, ``repeats`` times interleaved; a step's
time is its wall time from ``on_step_begin`` to ``on_step_end`` (a timing callback in both arms), the first step
left out (it creates the optimizer state). Then the callback's ledger is measured again with
``ledgerspec measure --device DEVICE`` (its own step, built from the ledger alone) and the two are shown phase by
phase: on the CPU they are equal to the byte (tests/derivations/integrations/test_callback.py asserts it); on CUDA
the table is the check of the CUDA half (``scripts/gpu-check`` runs this with ``--device cuda``).

Writes benchmarks/results/callback.md (cpu) or callback-cuda.md, with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from machine import cpu_model  # benchmarks/machine.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = (
    "after_load",
    "after_adapter_injection",
    "after_optimizer_init",
    "forward_peak",
    "backward_peak",
    "optimizer_step_peak",
    "steady_state_peak",
)
CONFIGS = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, microbatch, worst sequence, typical sequence)
    "llama-h64-l2-s64": (64, 128, 2, 4, 2, 256, 2, 64, 32),
    "llama-h512-l4-s256": (512, 1376, 4, 8, 4, 16384, 2, 256, 128),
}


def write_config(folder: Path, name: str) -> Path:
    h, inter, layers, heads, kv, vocab, *_ = CONFIGS[name]
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def case(name: str, folder: Path, device: str, steps: int, **over: Any) -> dict[str, Any]:
    from tests.truths.trainer_run import default_case

    *_, mb, worst, typical = CONFIGS[name]
    shape = {"microbatch": mb, "seq_worst": worst, "seq_typical": typical, "steps": steps}
    return default_case(
        str(folder), mixed_precision="bf16" if device == "cuda" else "no", device=device, **shape, **over
    )


def run(c: dict[str, Any], work: Path, ledger: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    case_file, out_file = work / "case.json", work / "out.json"
    case_file.write_text(json.dumps(c), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tests.derivations.integrations.callback_run", str(case_file), str(ledger)]
    proc = subprocess.run([*cmd, str(out_file)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"callback_overhead: the Trainer run failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(out_file.read_text(encoding="utf-8"))
    if out["raised"] or out["failure"]:
        raise SystemExit(f"callback_overhead: {out['raised'] or out['failure']}")
    return out


def compare(ledger: Path, device: str) -> list[tuple[str, int | None, int | None]]:
    """The callback's phases next to ``ledgerspec measure`` of a copy of its ledger."""
    from ledgerspec.contract.document import load

    copy = ledger.with_name("measured.ledger.yaml")
    shutil.copy(ledger, copy)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "ledgerspec", "measure", str(copy), "--device", device, "--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"callback_overhead: measure failed:\n{proc.stderr[-3000:]}")
    a, b = load(str(ledger)), load(str(copy))
    return [(p, a.get("phases", p).size(), b.get("phases", p).size()) for p in PHASES]


def machine() -> str:
    import torch

    text = f"{cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    import transformers

    return text + f", transformers {transformers.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=4, help="steady steps after the first (>= 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("callback_overhead: no CUDA device", file=sys.stderr)
            return 2
    load_before = os.getloadavg()[0]
    rows: list[tuple[str, float, float]] = []
    tables: dict[str, list[tuple[str, int | None, int | None]]] = {}
    with tempfile.TemporaryDirectory(prefix="ledgerspec-callback-bench-") as tmp:
        for name in args.configs:
            folder = write_config(Path(tmp) / name / name, name)
            bare, recorded = [], []
            for i in range(args.repeats):  # interleaved, so drift hits both alike
                work = Path(tmp) / name / f"r{i}"
                c = case(name, folder, args.device, args.steps)
                plain = run({**c, "no_callback": True}, work / "bare", work / "bare.ledger.yaml")
                ledger = work / "with" / "run.ledger.yaml"
                with_cb = run(c, work / "with", ledger)
                bare.append(statistics.mean(plain["step_seconds"][1:]))
                recorded.append(statistics.mean(with_cb["step_seconds"][1:]))
                if i == 0:
                    tables[name] = compare(ledger, args.device)
            rows.append((name, min(bare), min(recorded)))
            print(f"{name}: without {rows[-1][1] * 1e3:.1f} ms, with {rows[-1][2] * 1e3:.1f} ms", flush=True)
    lines = [
        f"# LedgerCallback overhead and figures ({args.device})",
        "",
        f"Machine: {machine()}; 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
        "(other jobs on the host make single timings noisy: compare rows, not absolute times)",
        "",
        f"Command: `python benchmarks/callback_overhead.py --device {args.device} --steps {args.steps} "
        f"--repeats {args.repeats}`",
        "",
        "Per configuration: the best (minimum) over interleaved repeats of the mean wall time of a steady optimizer "
        "step of a real `transformers.Trainer` run (LoRA r=4 q/v, AdamW, bfloat16 base), without and with "
        "`LedgerCallback`.",
        "",
        "| config (hidden, layers, seq) | step without | step with the callback | overhead |",
        "| --- | --- | --- | --- |",
    ]
    for name, bare_t, with_t in rows:
        lines.append(f"| {name} | {bare_t * 1e3:.1f} ms | {with_t * 1e3:.1f} ms | {(with_t / bare_t - 1):+.1%} |")
    lines += ["", _reading(args.device), ""]
    for name, table in tables.items():
        lines += [
            f"## {name}: the callback's phases vs `ledgerspec measure --device {args.device}` of its ledger",
            "",
            "| phase | callback (B) | measure (B) | callback - measure |",
            "| --- | --- | --- | --- |",
        ]
        for phase, got, want in table:
            diff = f"{got - want:+,}" if got is not None and want is not None else "n/a"
            lines.append(f"| {phase} | {_num(got)} | {_num(want)} | {diff} |")
        lines.append("")
    out = ROOT / "benchmarks" / "results" / ("callback.md" if args.device == "cpu" else "callback-cuda.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _num(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def _reading(device: str) -> str:
    if device == "cpu":
        return (
            "On the cpu the callback runs the tensor tracker (a TorchDispatchMode: Python code for every aten op) "
            "for the whole run: a fixed cost per op, largest for tiny models. It is the CPU test path; a GPU run "
            "reads the allocator's counters instead."
        )
    return (
        "On cuda the callback adds a synchronize and counter reads at each phase boundary (forward, backward, "
        "optimizer step) and an NVML sampling thread; no allocator history unless `snapshot=True`."
    )


if __name__ == "__main__":
    sys.exit(main())
