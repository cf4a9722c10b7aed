"""DeepSpeed ZeRO offload per rank: Llama-2-7b LoRA on 2 ranks, ZeRO-3 and ZeRO-2, with and without CPU offload.

    python benchmarks/zero_offload.py        # writes benchmarks/results/zero-offload.md

The workload is ``examples/llama-2-7b-lora.intake.yaml`` (bf16 base, LoRA r=16 on q/v, 2048 tokens, gradient
checkpointing, AdamW) with ``parallelism.strategy`` set to ``zero3`` / ``zero2`` and transformers' ``"auto"``
ZeRO-3 values for a hidden size of 4096 written out (``reduce_bucket_size = hidden**2``,
``stage3_prefetch_bucket_size = 0.9 * hidden**2``, ``stage3_param_persistence_threshold = 10 * hidden``). For each:
``ledgerspec shard --nproc 2 --estimate`` (cuda target: DeepSpeed's own engine per rank on fake tensors) -- the
device peak, the host peak and the wall time -- beside the calculated ``zeroN`` / ``zeroN_offload`` rows. Nothing
here is compared with a GPU run (none was available); the CPU runs that check the simulation to the byte are
``tests/derivations/shard/test_zero_offload.py``.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import cpu_model, memory_bytes  # noqa: E402

from ledgerspec.contract.document import load  # noqa: E402
from ledgerspec.contract.units import format_size  # noqa: E402

INTAKE = ROOT / "examples" / "llama-2-7b-lora.intake.yaml"
HIDDEN = 4096
AUTO = (
    f"{{reduce_bucket_size: {HIDDEN**2}, stage3_prefetch_bucket_size: {int(0.9 * HIDDEN**2)}, "
    f"stage3_param_persistence_threshold: {10 * HIDDEN}}}"
)
CASES = [("zero3", False), ("zero3", True), ("zero2", False), ("zero2", True)]


def ledger(tmp: Path, strategy: str, offload: bool) -> Path:
    text = INTAKE.read_text(encoding="utf-8")
    for old, new in (
        ("  cpu_offload: false\n  sharding: none\n", f"  cpu_offload: {offload!s}\n  sharding: {strategy}\n".lower()),
        ("parallelism:\n  gpu_count: 1", f"parallelism:\n  gpu_count: 2\n  strategy: {strategy}\n  deepspeed: {AUTO}"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / f"{strategy}{'-offload' if offload else ''}.intake.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def main() -> int:
    from ledgerspec.derivations.shard.sharder import shard

    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(ROOT / "examples" / "configs", tmp / "configs")
    rows = []
    for strategy, offload in CASES:
        doc = load(ledger(tmp, strategy, offload))
        t = time.perf_counter()
        result = shard(doc, 2, estimate=True, target="cuda")
        secs = time.perf_counter() - t
        assert result.estimate is not None
        r0 = result.estimate.ranks[0]
        row = result.extension["zero"][f"{strategy}{'_offload' if offload else ''}"]
        rows.append(
            f"| {strategy} | {'offload' if offload else 'none'} | {format_size(r0.peak)} | "
            + (format_size(r0.host_peak) if r0.host_peak is not None else "-")
            + f" | {format_size(row['device_total']['value'])} | {format_size(row['host']['value'])} | {secs:.0f} |"
        )
        print(rows[-1], flush=True)
    import deepspeed
    import torch

    lines = [
        "# DeepSpeed ZeRO offload per rank (Llama-2-7b LoRA, 2 ranks)",
        "",
        f"Machine: {platform.machine()}, {cpu_model()}, {memory_bytes() / 2**30:.0f} GiB, Python "
        f"{platform.python_version()}; no GPU used. torch {torch.__version__}, deepspeed {deepspeed.__version__}. "
        "Command: `python benchmarks/zero_offload.py`.",
        "",
        "Workload: `examples/llama-2-7b-lora.intake.yaml` (bf16 base, LoRA r=16 on q/v, 2048 tokens, microbatch 1, "
        f"gradient checkpointing, AdamW), ZeRO options `{AUTO}` (transformers' `auto` for hidden 4096). Offload: "
        "ZeRO-3 `offload_optimizer` + `offload_param`, ZeRO-2 `offload_optimizer`; DeepSpeedCPUAdam.",
        "",
        "| strategy | offload | simulated device peak, rank 0 | simulated host peak | calculated device model state | "
        "calculated host | estimate s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The simulated peaks are DeepSpeed's engine run per rank under fake tensors for the cuda target (device: "
        "what it keeps on the GPU, activations and temporaries included; host: what it keeps in CPU memory, tensors "
        "only). The calculated columns are the `zero*` rows of `shard`: model state only, no activations. Not "
        "compared with a GPU run.",
    ]
    out = ROOT / "benchmarks" / "results" / "zero-offload.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
