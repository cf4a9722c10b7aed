"""``shard --estimate``'s verdict on the device against published 2-GPU FSDP1 runs (issue 23): what nvidia-smi showed
on each GPU, and whether the run ran out of memory.

    python benchmarks/device_vs_published_fsdp.py     # writes benchmarks/results/device-fsdp.md

The runs and their ledgers are those of ``benchmarks/estimate_vs_published_fsdp.py`` (fms-acceleration's reference
benchmarks, ``scripts/benchmarks/refs/a100_80gb.csv`` at 876e2ed: 2 x A100-SXM4-80GB, FSDP1 through accelerate 1.0.1
and transformers 4.48.1's Trainer, packed 4,096-token sequences; its docstring lists every setting), plus the row of
the same CSV that ran out of memory: Llama-2-70B QLoRA (``baseline-peft-bnb``) at 4 sequences per rank, no training
metrics, ``mem_nvidia_mem_reserved`` 79,517 MiB (its ``accelerated-peft-bnb`` twin: 79,313 MiB, no metrics either).
The published device figure is ``mem_nvidia_mem_reserved``: the peak of nvidia-smi's ``memory.used`` minus its first
sample, MiB, averaged over the GPUs (the allocator's segments, the CUDA context and modules, NCCL's buffers). The
estimate is rank 0's device-level peak: the allocator model's replay of its simulated stream (each allocation on the
stream FSDP1 made it on; the units brought to the device one at a time as the Trainer run does) plus the
outside-allocator catalogue's figure for an A100 with two ranks' NCCL buffers (an ASSUMPTION: nothing was measured
on a GPU here). Nothing is fitted to the published figures.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine, markdown_table  # noqa: E402

LEDGERS = ROOT / "benchmarks" / "published-multi-gpu"
RESULTS = ROOT / "benchmarks" / "results" / "device-fsdp.md"
SOURCE = (
    "https://github.com/foundation-model-stack/fms-acceleration/blob/876e2ed6fc4e966785e3f4315f5ee3cdf8e3d097/"
    "scripts/benchmarks/refs/a100_80gb.csv"
)
GiB = 2**30


@dataclass(frozen=True)
class Run:
    """One published 2-GPU run: its ledger and the figures of its row (allocated: bytes, rank 0; nvidia-smi: MiB)."""

    key: str
    label: str
    peak: int | None  # mem_peak_torch_mem_alloc_in_bytes (None: no training metrics)
    nvidia_mib: float  # mem_nvidia_mem_reserved
    ran: bool

    @property
    def nvidia(self) -> int:
        return int(self.nvidia_mib * 2**20)


RUNS = [
    Run("fms-mistral-7b-lora-2gpu-bs2", "Mistral-7B LoRA, 2 x 4096 tokens per rank", 15_144_870_400, 18678, True),
    Run("fms-mistral-7b-lora-2gpu-bs4", "Mistral-7B LoRA, 4 x 4096 tokens per rank", 21_959_827_968, 26328, True),
    Run("fms-mistral-7b-qlora-2gpu-bs2", "Mistral-7B QLoRA nf4, 2 x 4096 tokens per rank", 9_424_594_432, 13164, True),
    Run("fms-mistral-7b-qlora-2gpu-bs4", "Mistral-7B QLoRA nf4, 4 x 4096 tokens per rank", 15_970_067_968, 21182, True),
    Run(
        "fms-llama-2-70b-qlora-2gpu-bs2", "Llama-2-70B QLoRA nf4, 2 x 4096 tokens per rank", 46_685_287_936, 51988, True
    ),
    Run("fms-llama-2-70b-qlora-2gpu-bs4", "Llama-2-70B QLoRA nf4, 4 x 4096 tokens per rank", None, 79517, False),
]


@dataclass(frozen=True)
class Row:
    run: Run
    allocated: int  # rank 0's simulated peak allocated
    reserved: int  # rank 0's peak reserved, the allocator model without a limit
    outside: int  # outside the allocator (the catalogue)
    device: int  # device-level peak = reserved + outside
    fits: bool  # every rank's replay against the device completes
    margin: int  # rank 0: device total - device-level peak
    seconds: float

    def cells(self) -> list[str]:
        r = self.run

        def diff(est: int, pub: int | None) -> str:
            return f"{(est - pub) / pub:+.1%}" if pub else "-"

        return [
            r.label,
            f"`{r.key}.ledger.yaml`",
            f"{r.peak / GiB:.2f}" if r.peak else "- (no metrics)",
            f"{self.allocated / GiB:.2f}",
            diff(self.allocated, r.peak),
            f"{r.nvidia / GiB:.2f}",
            f"{self.device / GiB:.2f}",
            diff(self.device, r.nvidia) if r.ran else "-",
            f"{self.reserved / GiB:.2f}",
            f"{self.outside / GiB:.2f}",
            "ran" if r.ran else "out of memory",
            f"{'fits' if self.fits else 'does not fit'} (margin {self.margin / GiB:.2f})",
        ]


HEADER = [
    "run",
    "ledger",
    "published allocated GiB",
    "estimated allocated GiB",
    "difference",
    "published nvidia-smi GiB",
    "estimated device-level GiB",
    "difference",
    "of which reserved GiB",
    "outside the allocator GiB",
    "published outcome",
    "predicted on 80 GiB (GiB)",
]


def estimate_run(run: Run) -> Row:
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.shard.sharder import shard

    doc = load(LEDGERS / f"{run.key}.ledger.yaml")
    started = time.perf_counter()
    result = shard(doc, estimate=True)
    est = result.estimate
    assert est is not None and est.device is not None, run.key
    d = est.device[0]
    return Row(
        run,
        est.ranks[0].peak,
        d.replayed.free_peak_reserved,
        d.outside,
        d.replayed.free_peak_reserved + d.outside,
        all(x.fits for x in est.device),
        d.margin,
        time.perf_counter() - started,
    )


def table(rows: list[Row]) -> str:
    return "\n".join(markdown_table(HEADER, [r.cells() for r in rows]))


def main() -> None:
    only = sys.argv[1:]
    rows = [estimate_run(run) for run in RUNS if not only or run.key in only]
    outcome = sum((r.run.ran == r.fits) for r in rows)
    ran = [r for r in rows if r.run.ran]
    diffs = sorted((r.device - r.run.nvidia) / r.run.nvidia for r in ran)
    oom = [r for r in rows if not r.run.ran]
    bs4_peak = f"{oom[0].device / GiB:.2f}" if oom else "-"
    bs4_margin = f"{oom[0].margin / GiB:.2f}" if oom else "-"
    median = diffs[len(diffs) // 2] if diffs else 0.0
    body = f"""# `shard --estimate` on the device vs published 2-GPU FSDP1 runs

Command: `python benchmarks/device_vs_published_fsdp.py`. Machine (for the estimate): {machine()}; no GPU used
({sum(r.seconds for r in rows):.0f} s for all rows).

Source: fms-acceleration's reference benchmarks, `scripts/benchmarks/refs/a100_80gb.csv` ({SOURCE}): 2 x
A100-SXM4-80GB, FSDP1 (FULL_SHARD) through accelerate 1.0.1 and transformers 4.48.1's Trainer, packed 4,096-token
sequences, gradient checkpointing, flash-attention 2, LoRA r=16 on q/k/v/o; the ledgers and every setting are those of
`benchmarks/results/published-multi-gpu.md`, plus the 70B QLoRA row at 4 sequences per rank, which has no training
metrics and an nvidia-smi peak at the card's capacity (it ran out of memory). nvidia-smi = `mem_nvidia_mem_reserved`
(MiB, the peak of `memory.used` minus its first sample, averaged over the GPUs); allocated = rank 0's
`mem_peak_torch_mem_alloc_in_bytes`. Estimated: rank 0 (the ranks hold the same bytes here).

{table(rows)}

Device-level peak against nvidia-smi, runs that trained: {", ".join(r.cells()[7] for r in ran)} (median
{median:+.1%}). The published outcome is predicted for {outcome} of {len(rows)} runs.

## What the figures say, and what is not explained yet

- **The allocator matters more than the tensors' excess:** the reserve above the allocated peak (reserved -
  allocated) is 1.2-10 GiB here. The replay keeps a pool per stream: FSDP1 all-gathers into its unshard stream and
  reduces gradients on its post-backward stream, so those blocks are not reused by the compute stream (with every
  allocation on one stream the 70B rows' reserved peaks moved by 0.04 and 0.53 GiB, before the pending frees below
  were modelled). The load matters most: a Trainer run does not place
  an FSDP model on the device; FSDP1 moves (or, with `cpu_ram_efficient_loading`, materialises) each unit as it wraps
  it, flattens and shards it. Simulated with the whole model on the device first (as the allocated estimate may, since
  the held bytes are the same), the Mistral-7B LoRA row reserved 21 GiB at load and its device-level peak was 25.9
  GiB, +42 %; unit by unit it is the figure above.
- **The host runs ahead of the device, and the replay follows it:** FSDP1 frees each unsharded flat parameter after
  `record_stream` on the compute stream, so its block returns to the pool only once the GPU has used it, and the
  host waits for the GPU only at FSDP1's rate limiter (two all-gathers in flight) and at the Trainer's loss check.
  Modelled (pending frees and `sync` points in each rank's stream): +0.1 GiB on the Mistral QLoRA rows (a 4-bit
  decoder layer), +0.4 GiB on the 70B and Mistral LoRA rows (one more unsharded layer).
- **The device-level figures are still low by the median above, most on the QLoRA rows.** Their allocated peaks
  are themselves 7.7 % low (`published-multi-gpu.md`: the 2-GPU QLoRA rows' unexplained part), and the outside
  figure is the catalogue's (an ASSUMPTION: `measure --device cuda` records it); what else the GPUs held is not
  known without a GPU run of this step (`scripts/gpu-check`).
- **The run that ran out of memory is not yet predicted to:** the 70B QLoRA row at 4 sequences per rank is predicted
  at {bs4_peak} GiB, {bs4_margin} GiB under the 80 GiB the ledger declares. PyTorch reports an A100-80GB's total as
  79.25 GiB in its out-of-memory messages (e.g. https://github.com/wbfwonderful/Vad-R1/issues/11: "GPU 2 has a total
  capacity of 79.25 GiB"), where the device catalogue holds nvidia-smi's 81,920 MiB: against 79.25 GiB the same
  replay does not fit. The margin either way is inside the error the trained rows show, so this row is not
  evidence for the model either way yet.
"""
    if only:
        print(body)
        return
    RESULTS.write_text(body.rstrip() + "\n", encoding="utf-8")
    print(body)


if __name__ == "__main__":
    main()
