"""The estimate against published Mixtral-8x7B QLoRA runs, on the stack they declared (transformers 4.48.1: per-expert
``nn.Linear`` experts that bitsandbytes quantizes, modelled by ``ledgerspec/derivations/stack/legacy_moe``).

    python benchmarks/estimate_vs_published_moe.py     # writes benchmarks/results/published-moe.md

Source: fms-acceleration's reference benchmarks, ``scripts/benchmarks/refs/a100_80gb.csv`` at commit 876e2ed (the
same file and stack as ``benchmarks/estimate_vs_published_fsdp.py``: torch 2.4.1, transformers 4.48.1, peft 0.13.2,
accelerate 1.0.1, trl 0.13.0, bitsandbytes 0.43.3, fms-hf-tuning 2.5.0), rows with ``framework_config``
baseline-peft-bnb and ``model_name_or_path`` mistralai/Mixtral-8x7B-Instruct-v0.1: QLoRA nf4 (double quantization,
bf16 compute), LoRA r=16 alpha 16 dropout 0.1 on q/k/v/o, packed 4,096-token sequences, gradient checkpointing,
flash-attention 2, ``bf16``; 1 x A100-80GB (a single process) and 2 x A100-80GB (FSDP1 through accelerate). Each
ledger (``benchmarks/published-moe/``) states the translation. Published = rank 0's ``TrainerMemoryTracker`` figures:
``mem_peak_torch_mem_alloc_in_bytes`` (``torch.cuda.max_memory_allocated`` over ``train()``) and
``mem_torch_mem_alloc_in_bytes`` (``memory_allocated`` when ``train()`` returns). Nothing is fitted.

Each row is estimated twice: as declared (transformers 4.48.1: its MoE layout, its loss, its checkpoint placement) and
with the installed transformers' MoE layout (the same ledger without ``software.transformers``: fused bf16 experts),
which is what ledgerspec answered before the layout was modelled.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import FMS_A100_CSV, markdown_table  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

LEDGERS = ROOT / "benchmarks" / "published-moe"
RESULTS = ROOT / "benchmarks" / "results" / "published-moe.md"
FMS = FMS_A100_CSV
DECLARED = "  transformers: 4.48.1\n"


@dataclass(frozen=True)
class Run:
    key: str
    label: str
    peak: int  # mem_peak_torch_mem_alloc_in_bytes
    after: int  # mem_torch_mem_alloc_in_bytes
    nvidia_mib: float  # mem_nvidia_mem_reserved
    gpus: int


RUNS = [
    Run(
        "fms-mixtral-8x7b-qlora-1gpu-bs4",
        "Mixtral-8x7B QLoRA, 1 GPU, 4 x 4096",
        42_794_268_160,
        24_665_033_728,
        44924,
        1,
    ),
    Run(
        "fms-mixtral-8x7b-qlora-1gpu-bs8",
        "Mixtral-8x7B QLoRA, 1 GPU, 8 x 4096",
        60_545_920_512,
        24_665_426_944,
        63932,
        1,
    ),
    Run(
        "fms-mixtral-8x7b-qlora-2gpu-bs2",
        "Mixtral-8x7B QLoRA, FSDP1 2 GPUs, 2 x 4096 per rank",
        21_129_981_952,
        12_736_740_864,
        29958,
        2,
    ),
    Run(
        "fms-mixtral-8x7b-qlora-2gpu-bs4",
        "Mixtral-8x7B QLoRA, FSDP1 2 GPUs, 4 x 4096 per rank",
        28_146_350_592,
        12_736_937_472,
        35417,
        2,
    ),
]


@dataclass(frozen=True)
class Row:
    run: Run
    peak: int
    after: int
    frozen: int
    phases: dict[str, int]
    seconds: float
    method: str
    installed_peak: int | None
    installed_frozen: int | None
    installed_error: str | None


def diff(estimated: int, published: int) -> float:
    return (estimated - published) / published


def _estimate(text: str, path: Path, gpus: int) -> tuple[int, dict[str, int], dict[str, int], str]:
    """(peak, phases, components, method) of rank 0."""
    from ledgerspec.contract.document import from_text

    doc = from_text(text, str(path))
    if gpus > 1:
        from ledgerspec.derivations.shard.sharder import shard

        est = shard(doc, estimate=True, target="cuda").estimate
        assert est is not None and est.strategy == "fsdp1"
        r0 = est.ranks[0]
        return r0.peak, dict(r0.phases), dict(r0.components), est.method
    from ledgerspec.derivations.estimate.estimator import estimate

    e = estimate(doc, target="cuda")
    return e.peak_allocated, dict(e.phases), dict(e.components), e.method


def estimate_run(run: Run) -> Row:
    from ledgerspec.errors import LedgerspecError

    path = LEDGERS / f"{run.key}.ledger.yaml"
    text = path.read_text(encoding="utf-8")
    assert DECLARED in text, run.key
    started = time.perf_counter()
    peak, phases, comp, method = _estimate(text, path, run.gpus)
    seconds = time.perf_counter() - started
    assert "MoE layout of the declared transformers 4.48.1" in method, run.key  # built as declared
    after = comp["frozen_base"] + comp["adapter"] + comp["optimizer"]
    installed_peak = installed_frozen = None
    error = None
    try:
        i_peak, _, i_comp, _ = _estimate(text.replace(DECLARED, ""), path, run.gpus)
        installed_peak, installed_frozen = i_peak, i_comp["frozen_base"]
    except LedgerspecError as exc:
        error = str(exc).splitlines()[0][:200]
    return Row(run, peak, after, comp["frozen_base"], phases, seconds, method, installed_peak, installed_frozen, error)


HEADER = [
    "run",
    "ledger",
    "published peak GB",
    "estimated peak GB (declared transformers 4.48.1)",
    "difference",
    "installed layout: estimated peak GB (difference)",
    "published after train() GB",
    "estimated model state GB",
    "difference",
    "frozen base GB: declared / installed layout",
    "nvidia-smi peak GiB (not compared)",
]


def cells(row: Row) -> list[str]:
    r = row.run
    installed = (
        f"{row.installed_peak / 1e9:.2f} ({diff(row.installed_peak, r.peak):+.1%})"
        if row.installed_peak is not None
        else f"refused: {row.installed_error}"
    )
    frozen_installed = f"{row.installed_frozen / 1e9:.2f}" if row.installed_frozen is not None else "-"
    return [
        r.label,
        f"`{r.key}.ledger.yaml`",
        f"{r.peak / 1e9:.2f}",
        f"{row.peak / 1e9:.2f}",
        f"{diff(row.peak, r.peak):+.1%}",
        installed,
        f"{r.after / 1e9:.2f}",
        f"{row.after / 1e9:.2f}",
        f"{diff(row.after, r.after):+.1%}",
        f"{row.frozen / 1e9:.2f} / {frozen_installed}",
        f"{r.nvidia_mib / 1024:.2f}",
    ]


EXPLAINED = """## What each figure includes, and every difference

- **The MoE layout (modelled).** transformers 4.48.1 builds each of the 32 x 8 experts as three `nn.Linear`
  modules (`w1`, `w3`: 4,096 -> 14,336, `w2`: 14,336 -> 4,096) and the router `gate` as an `nn.Linear`; its
  bitsandbytes integration replaces every `nn.Linear` but `lm_head`, so the experts are 4-bit
  (transformers 5.0.0 fused them into 3-D parameters that bitsandbytes leaves in bf16: the installed layout's frozen
  base is 62 GiB larger, the column "installed layout"). The declared layout is built by
  `ledgerspec/derivations/stack/legacy_moe/mixtral.py` (4.48.1's modules and routing loop; checked to the byte against
  a real transformers 4.48.1 Trainer QLoRA step of a tiny Mixtral, `tests/derivations/stack/test_legacy_moe.py`).
- **The routing.** The simulation gives each expert an even share of the `tokens x 2` assignments (a fake tensor has
  no router values). What the loop keeps for backward is proportional to each expert's tokens, so the activations do
  not depend on the split; the transient of the expert being computed does (`tokens x 14,336` bf16 temporaries of one
  expert: 0.12 GB per 1,000 tokens above its share, if the real router sent more to one expert at the peak).
- **1 GPU:** TRL 0.13's path for a non-sharded QLoRA model: `prepare_model_for_kbit_training` (the non-4-bit
  parameters upcast to float32, then TRL's `peft_module_casting_to_bf16` puts `lm_head` and `embed_tokens` back to
  bf16 and keeps the norms in float32), float32 adapters, bf16 autocast, reentrant checkpointing.
- **2 GPUs:** FSDP1 as in `published-multi-gpu.md` (the same translation, the same stack: the quant storage is bf16
  under FSDP, TRL skips the k-bit preparation and keeps bf16 adapters, BACKWARD_PRE backward prefetch from the runs'
  accelerate.yaml), rank 0.
- **After `train()`:** rank 0's frozen base + adapter + AdamW state (the gradients are freed by `zero_grad`).
- **Not modelled, each small here:** flash-attn 2.7.3's kernels versus the estimate's CUDA attention model;
  bitsandbytes 0.43.3 versus the installed 0.50 (after 0.43.2 both keep no 4-bit layer input for backward); PEFT
  0.13.2 versus the installed PEFT (the same LoRA layers on the same modules: q/k/v/o); the 100 steps of packed data
  (every step has the same shape).
"""


def render(rows: list[Row], elapsed: float) -> str:
    import torch
    import transformers

    lines = [
        "# Mixtral-8x7B QLoRA: estimate vs published runs, on the declared stack (transformers 4.48.1's MoE layout)",
        "",
        "Command: `python benchmarks/estimate_vs_published_moe.py`. Machine (for the estimate): "
        f"{cpu_model()}, torch {torch.__version__}, transformers {transformers.__version__}; no GPU used "
        f"({elapsed:.0f} s for all rows).",
        "",
        f"Source: fms-acceleration's reference benchmarks, `scripts/benchmarks/refs/a100_80gb.csv` ({FMS}), "
        "scenario baseline-peft-bnb, mistralai/Mixtral-8x7B-Instruct-v0.1 (GB = 1e9 B).",
        "",
        *markdown_table(HEADER, [cells(row) for row in rows]),
        "",
        "Rank 0's simulated phases (GB; the estimate is their maximum):",
        "",
        "| run | forward | backward | optimizer step | steady state | estimate s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        p = row.phases
        lines.append(
            f"| {row.run.label} | {p['forward_peak'] / 1e9:.2f} | {p['backward_peak'] / 1e9:.2f} | "
            f"{p['optimizer_step_peak'] / 1e9:.2f} | {p['steady_state_peak'] / 1e9:.2f} | {row.seconds:.0f} |"
        )
    within = [r for r in rows if abs(diff(r.peak, r.run.peak)) <= 0.10]
    diffs = sorted(abs(diff(r.peak, r.run.peak)) for r in rows)
    median = (diffs[len(diffs) // 2] + diffs[(len(diffs) - 1) // 2]) / 2
    lines += [
        "",
        f"Within 10% of the published peak: {len(within)} of {len(rows)} runs; median absolute difference "
        f"{median:.1%}.",
        "",
        EXPLAINED,
        unexplained(rows),
    ]
    return "\n".join(lines)


def unexplained(rows: list[Row]) -> str:
    """The gap of the single-GPU rows, computed from them."""
    single = sorted((r for r in rows if r.run.gpus == 1), key=lambda r: r.run.key)
    if len(single) != 2:
        return ""
    (a, b) = single
    gap_a, gap_b = a.run.peak - a.peak, b.run.peak - b.peak
    tokens = (int(b.run.key.rsplit("bs", 1)[1]) - int(a.run.key.rsplit("bs", 1)[1])) * 4096
    slope = (gap_b - gap_a) / tokens
    return f"""## What is not explained

**The single-GPU rows** are {diff(a.peak, a.run.peak):+.1%} and {diff(b.peak, b.run.peak):+.1%}: the published
peaks are {gap_a / 1e9:.2f} GB and {gap_b / 1e9:.2f} GB above the estimate, a gap that grows by {slope / 1e3:.1f} kB
per token ({(gap_a - slope * tokens) / 1e9:.2f} GB at no token, by a straight line through the two rows). Their
simulated peak is at the loss in forward; the FSDP1 rows (peak late in backward, bf16 adapters, no k-bit
preparation) agree within 1%. The same single-GPU recipe (k-bit preparation, TRL's casts, bf16 autocast,
checkpointing, packed rows) on a tiny Mixtral with transformers 4.48.1 is equal to the real CPU Trainer step but for
40 B (tests/derivations/stack/test_legacy_moe.py), so the gap is not the layout or the recipe as the CPU runs it. Not
settled without a GPU run: what the real single-GPU step holds at the loss besides
(flash-attn 2.7.3's kernels, bitsandbytes 0.43.3's, and the float32 modules of TRL 0.13's preparation in its real
order) and how unevenly the real router loads the experts (the estimate gives each an even share).
"""


def main() -> None:
    started = time.perf_counter()
    rows = []
    for run in RUNS:
        row = estimate_run(run)
        print(" | ".join(cells(row)), flush=True)
        rows.append(row)
    RESULTS.write_text(render(rows, time.perf_counter() - started) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
