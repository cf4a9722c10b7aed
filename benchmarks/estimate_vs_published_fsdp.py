"""The per-rank estimate against published multi-GPU runs, each re-estimated with its real strategy (FSDP1).

    python benchmarks/estimate_vs_published_fsdp.py            # writes benchmarks/results/published-multi-gpu.md
    python benchmarks/estimate_vs_published_fsdp.py --only fms-mistral-7b-lora-2gpu-bs2

No tuning constants: each run's setup is translated into a ledger (``benchmarks/published-multi-gpu/*.ledger.yaml``,
committed, every choice explained in its comments) and ``ledgerspec shard --estimate`` simulates one FSDP1 step per
rank (fake tensors, a fake process group). Nothing is fitted to the published figures.

Source: fms-acceleration's reference benchmarks, ``scripts/benchmarks/refs/a100_80gb.csv`` (IBM,
foundation-model-stack/fms-acceleration, file last changed in commit 24bdadb, 2025-02-07), produced by
``scripts/run_benchmarks.sh`` with ``scripts/benchmarks/{benchmark.py, accelerate.yaml, defaults.yaml,
scenarios.yaml}`` and the stack of ``scripts/benchmarks/refs/requirements.txt`` (torch 2.4.1, transformers 4.48.1,
peft 0.13.2, accelerate 1.0.1, trl 0.13.0, bitsandbytes 0.43.3, flash-attn 2.7.3, fms-hf-tuning 2.5.0) on
A100-SXM4-80GB GPUs. The setup stated there:

- accelerate.yaml: ``distributed_type: FSDP`` (FSDP1, ``FullyShardedDataParallel``), ``fsdp_sharding_strategy: 1``
  (FULL_SHARD), ``TRANSFORMER_BASED_WRAP`` (the Trainer replaces it by PEFT's ``fsdp_auto_wrap_policy``),
  ``fsdp_backward_prefetch: BACKWARD_PRE``, ``fsdp_cpu_ram_efficient_loading: true``, ``fsdp_offload_params: false``,
  ``mixed_precision: 'no'``;
- defaults.yaml: ``gradient_checkpointing: True`` (transformers 4.48 then passes ``use_reentrant: True``),
  ``gradient_accumulation_steps: 1``, ``use_flash_attn: True``, ``max_steps: 100``;
- benchmark.py defaults: ``--packing_matrix True``, ``--max_seq_len_matrix 4096``, effective batch 4 and 8 on 1 and 2
  GPUs (so 2 and 4 sequences per rank on 2 GPUs);
- scenarios.yaml: "standard-peft" (LoRA r=16, alpha 16, dropout 0.1 on q/k/v/o, ``torch_dtype: bfloat16``, no
  ``bf16``) and "baseline-peft-bnb" (the same LoRA, ``bf16: True``, bitsandbytes nf4 with double quantization, compute
  and ``bnb_4bit_quant_storage`` = bfloat16 under FSDP: ``plugins/accelerated-peft/.../framework_plugin_bnb.py``).

The published figures are transformers' ``TrainerMemoryTracker`` figures of rank 0 only (scripts/benchmarks/README.md:
"When in distributed mode, the Trainer will only log the rank 0 memory"): ``mem_peak_torch_mem_alloc_in_bytes`` =
``torch.cuda.max_memory_allocated()`` over ``trainer.train()`` (peak statistics reset when it starts; the model is
wrapped inside it), ``mem_torch_mem_alloc_in_bytes`` = ``torch.cuda.memory_allocated()`` when ``train()`` returns;
``mem_nvidia_mem_reserved`` = ``nvidia-smi memory.used`` peak minus its first sample, averaged over the GPUs
(CUDA context, allocator cache and NCCL buffers included), shown, not compared.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402

LEDGERS = ROOT / "benchmarks" / "published-multi-gpu"
RESULTS = ROOT / "benchmarks" / "results" / "published-multi-gpu.md"
FMS = (
    "https://github.com/foundation-model-stack/fms-acceleration/blob/876e2ed6fc4e966785e3f4315f5ee3cdf8e3d097/"
    "scripts/benchmarks/refs/a100_80gb.csv"
)
#: transformers 4.48.1, ``src/transformers/loss/loss_utils.py`` lines 36-39 (``ForCausalLMLoss``): ``logits =
#: logits.float()`` then ``shift_logits = logits[..., :-1, :].contiguous()``; from transformers 4.49.0 on the labels are
#: padded and shifted instead (``nn.functional.pad(labels, (0, 1))``) and the logits are only viewed
LOSS_SOURCE = "https://github.com/huggingface/transformers/blob/v4.48.1/src/transformers/loss/loss_utils.py#L36-L39"


@dataclass(frozen=True)
class Run:
    """One published run: its ledger and the figures of the source's row (bytes; nvidia-smi in MiB)."""

    key: str  # the ledger's name without .ledger.yaml
    label: str
    source_row: str  # how to find the row in the source
    peak: int  # mem_peak_torch_mem_alloc_in_bytes
    after: int  # mem_torch_mem_alloc_in_bytes
    nvidia_mib: float  # mem_nvidia_mem_reserved
    sequences: int  # per rank
    tokens: int = 4096
    vocab: int = 32000

    @property
    def loss_copy(self) -> int:
        """transformers 4.48's fp32 ``shift_logits`` copy: ``sequences x (tokens - 1) x vocab x 4`` bytes."""
        return self.sequences * (self.tokens - 1) * self.vocab * 4


RUNS = [
    Run(
        "fms-mistral-7b-lora-2gpu-bs2",
        "Mistral-7B LoRA, 2 x 4096 tokens per rank",
        "standard-peft, framework_config none, Mistral-7B-v0.1, num_gpus 2, per_device_train_batch_size 2",
        15_144_870_400,
        7_368_030_720,
        18678,
        2,
    ),
    Run(
        "fms-mistral-7b-lora-2gpu-bs4",
        "Mistral-7B LoRA, 4 x 4096 tokens per rank",
        "standard-peft, framework_config none, Mistral-7B-v0.1, num_gpus 2, per_device_train_batch_size 4",
        21_959_827_968,
        7_368_227_328,
        26328,
        4,
    ),
    Run(
        "fms-mistral-7b-qlora-2gpu-bs2",
        "Mistral-7B QLoRA nf4, 2 x 4096 tokens per rank",
        "baseline-peft-bnb, Mistral-7B-v0.1, num_gpus 2, per_device_train_batch_size 2",
        9_424_594_432,
        2_244_525_568,
        13164,
        2,
    ),
    Run(
        "fms-mistral-7b-qlora-2gpu-bs4",
        "Mistral-7B QLoRA nf4, 4 x 4096 tokens per rank",
        "baseline-peft-bnb, Mistral-7B-v0.1, num_gpus 2, per_device_train_batch_size 4",
        15_970_067_968,
        2_244_722_176,
        21182,
        4,
    ),
    Run(
        "fms-llama-2-70b-qlora-2gpu-bs2",
        "Llama-2-70B QLoRA nf4, 2 x 4096 tokens per rank",
        "baseline-peft-bnb, NousResearch/Llama-2-70b-hf, num_gpus 2, per_device_train_batch_size 2",
        46_685_287_936,
        19_266_743_808,
        51988,
        2,
    ),
]


@dataclass(frozen=True)
class Row:
    """What the estimate says for one run (rank 0, the rank the source logs)."""

    run: Run
    peak: int  # predicted peak of rank 0
    after: int  # frozen base + adapter + optimizer state of rank 0 (gradients freed by zero_grad)
    phases: dict[str, int]
    activations: int
    seconds: float

    @staticmethod
    def diff(estimated: int, published: int) -> float:
        return (estimated - published) / published

    def cells(self) -> list[str]:
        r = self.run
        with_copy = self.peak + r.loss_copy
        return [
            r.label,
            f"`{r.key}.ledger.yaml`",
            f"{r.peak / 1e9:.2f}",
            f"{self.peak / 1e9:.2f}",
            f"{self.diff(self.peak, r.peak):+.1%}",
            f"{r.loss_copy / 1e9:.2f}",
            f"{with_copy / 1e9:.2f}",
            f"{self.diff(with_copy, r.peak):+.1%}",
            f"{r.after / 1e9:.2f}",
            f"{self.after / 1e9:.2f}",
            f"{self.diff(self.after, r.after):+.1%}",
            f"{r.nvidia_mib / 1024:.2f}",
        ]


HEADER = [
    "run",
    "ledger",
    "published peak GB",
    "estimated peak GB (FSDP1)",
    "difference",
    "4.48 loss copy GB",
    "estimate + loss copy GB",
    "difference",
    "published after train() GB",
    "estimated model state GB",
    "difference",
    "nvidia-smi peak GiB (not compared)",
]


def estimate_run(run: Run) -> Row:
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.shard.sharder import shard

    doc = load(LEDGERS / f"{run.key}.ledger.yaml")
    started = time.perf_counter()
    est = shard(doc, estimate=True, target="cuda").estimate
    seconds = time.perf_counter() - started
    assert est is not None and est.strategy == "fsdp1", run.key
    r0 = est.ranks[0]
    after = r0.components["frozen_base"] + r0.components["adapter"] + r0.components["optimizer"]
    return Row(run, r0.peak, after, dict(r0.phases), r0.activations, seconds)


EXPLAINED = f"""## What each published figure includes, and every difference

- **Peak** (`mem_peak_torch_mem_alloc_in_bytes`): `torch.cuda.max_memory_allocated()` of rank 0 over
  `trainer.train()`: tensors only, no CUDA context, no allocator cache, no NCCL buffers (those are in the
  nvidia-smi column, shown for scale and not compared). The estimate is the same quantity: the largest phase of rank
  0's simulated FSDP1 step (512-byte allocator rounding). The window of `train()` also holds the FSDP1 wrapping
  (`accelerator.prepare` runs inside it); the simulation starts from the wrapped model.
- **The loss copy (the largest difference on the Mistral rows; not modelled, quantified):** the runs used
  transformers 4.48.1, whose `ForCausalLMLoss` upcasts the logits to float32 and then copies them shifted
  (`shift_logits = logits[..., :-1, :].contiguous()`, {LOSS_SOURCE}); transformers 4.49.0 and later (the installed
  one too) pad and shift the labels instead and only view the logits. One more float32 tensor of
  `sequences x 4,095 x 32,000` values is alive at the loss and, through the slice's backward, at the start of
  backward, where the simulated peak is: 1.05 GB at 2 sequences per rank, 2.10 GB at 4. The column "estimate + loss
  copy" adds exactly that tensor (a shape, nothing fitted); the estimate itself does not, because it runs the
  installed transformers.
- **After `train()`** (`mem_torch_mem_alloc_in_bytes`): `torch.cuda.memory_allocated()` of rank 0 when `train()`
  returns: the frozen-base and adapter shards, the buffers, and AdamW's state for this rank's elements (the Trainer's
  `model.zero_grad()` has freed the gradients). The estimate's figure is rank 0's simulated
  `frozen_base + adapter + optimizer` components; every row agrees within 2.0%.
- **Not modelled, each small here:** CUDA stream overlap (with `BACKWARD_PRE` an all-gather may be in flight while a
  unit computes: at most one more decoder layer, 0.44 GB for a Mistral-7B bf16 layer, 0.11 GB for its 4-bit layer);
  flash-attn 2.7.3's own kernels versus the estimate's CUDA attention model; TRL 0.13's packing (the estimate packs
  the same 4,096 tokens per sequence); PEFT 0.13.2 versus the installed PEFT (both keep float32 adapters, gathered
  in bf16 by FSDP1's `MixedPrecision` on the QLoRA rows; the LoRA input cast is the same); bitsandbytes 0.43.3 versus
  0.50 (after 0.43.2 both keep no 4-bit layer input for backward).
- **The published peak is the maximum over 100 steps of packed data**; every step has the same shape (packing to
  4,096 tokens), so a step's peak is the run's, unless something outside the step is higher (next item).
"""

SEVENTY = """## Llama-2-70B QLoRA does not land, and what is known about why

The estimate is {diff} ({gap:.2f} GB under the published peak; {diff_copy} with the loss copy), while rank 0's model
state after `train()` agrees within {after}: the sharding is right, the step is not. What the {gap:.2f} GB is not:

- not the loss copy: it is 1.05 GB (the vocabulary and tokens are those of the Mistral rows);
- not something left per decoder layer: {gap:.2f} GB over 80 layers is {per_layer:.0f} MB a layer; the same
  mechanism on Mistral-7B's 32 layers (hidden 4,096, half of 8,192) would leave about 1-4 GB there (scaling with the
  hidden size or its square, at 2 or 4 sequences per rank), and the Mistral rows are within 0.1-0.7 GB of the
  published peaks once the loss copy is added;
- not the gathered units: one 4-bit Llama-2-70B layer gathered is 0.43 GB, the root 1.05 GB.

Not settled without a GPU and the model. What the window of `max_memory_allocated` holds and the simulated step does
not: everything `train()` does before the first step, above all the FSDP1 wrapping (`sync_module_states`) of a model
loaded with `fsdp_cpu_ram_efficient_loading`, whose rank 0 holds the weights on the CPU until they reach the GPU unit
by unit; on the Mistral rows that window cannot be the peak (they agree), on a 70B model it is larger in every unit.
A run with the Trainer's per-stage memory on the GPUs would settle it; the ledger is committed so the run is
re-estimated as soon as the cause is modelled.
"""


def render(rows: list[Row], elapsed: float) -> str:
    import torch
    import transformers

    lines = [
        "# Per-rank estimate vs published multi-GPU runs (FSDP1, as they ran)",
        "",
        "Command: `python benchmarks/estimate_vs_published_fsdp.py`. Machine (for the estimate): "
        f"{cpu_model()}, torch {torch.__version__}, transformers {transformers.__version__}; no GPU used "
        f"({elapsed:.0f} s for all rows).",
        "",
        f"Source: fms-acceleration's reference benchmarks, `scripts/benchmarks/refs/a100_80gb.csv` ({FMS}): "
        "2 x A100-SXM4-80GB, FSDP1 (`FullyShardedDataParallel`, FULL_SHARD) through accelerate 1.0.1 and "
        "transformers 4.48.1's Trainer, packed 4,096-token sequences, gradient checkpointing, flash-attention 2, "
        "LoRA r=16 on q/k/v/o. The docstring of the script lists every setting and where it is stated; each "
        "ledger says how it was translated. Published = rank 0's `TrainerMemoryTracker` figures (bytes, shown in "
        "GB = 1e9 B).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "| " + " | ".join("---" for _ in HEADER) + " |",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    lines += [
        "",
        "Rank 0's simulated phases (GB; the estimate is their maximum):",
        "",
        "| run | forward | backward | optimizer step | steady state | activations | estimate s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        p = row.phases
        lines.append(
            f"| {row.run.label} | {p['forward_peak'] / 1e9:.2f} | {p['backward_peak'] / 1e9:.2f} | "
            f"{p['optimizer_step_peak'] / 1e9:.2f} | {p['steady_state_peak'] / 1e9:.2f} | "
            f"{row.activations / 1e9:.2f} | {row.seconds:.0f} |"
        )
    lines += ["", "Source rows: " + "; ".join(f"{r.run.key}: {r.run.source_row}" for r in rows) + ".", ""]
    lines += [verdict(rows), "", EXPLAINED, doubling(rows)]
    seventy = next((r for r in rows if "70b" in r.run.key), None)
    if seventy is not None:
        gap = (seventy.run.peak - seventy.peak) / 1e9
        lines.append(
            SEVENTY.format(
                diff=f"{Row.diff(seventy.peak, seventy.run.peak):+.1%}",
                diff_copy=f"{Row.diff(seventy.peak + seventy.run.loss_copy, seventy.run.peak):+.1%}",
                after=f"{abs(Row.diff(seventy.after, seventy.run.after)):.1%}",
                gap=gap,
                per_layer=gap * 1000 / 80,
            )
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    """Which runs land within 10% (the issue's target), as the estimate stands and with the loss copy."""
    raw = [r.run.label for r in rows if abs(Row.diff(r.peak, r.run.peak)) <= 0.10]
    copy = [r.run.label for r in rows if abs(Row.diff(r.peak + r.run.loss_copy, r.run.peak)) <= 0.10]
    return (
        f"Within 10% of the published peak: {len(raw)} of {len(rows)} runs as estimated ({', '.join(raw) or 'none'}); "
        f"{len(copy)} of {len(rows)} with the quantified loss copy of transformers 4.48 added "
        f"({', '.join(copy) or 'none'})."
    )


def doubling(rows: list[Row]) -> str:
    """Doubling the sequences per rank: published vs estimated increase, and the loss copy's share of the gap."""
    by_key = {r.run.key: r for r in rows}
    out = []
    for kind in ("lora", "qlora"):
        two, four = by_key.get(f"fms-mistral-7b-{kind}-2gpu-bs2"), by_key.get(f"fms-mistral-7b-{kind}-2gpu-bs4")
        if two is None or four is None:
            continue
        pub, est = (four.run.peak - two.run.peak) / 1e9, (four.peak - two.peak) / 1e9
        copy = (four.run.loss_copy - two.run.loss_copy) / 1e9
        out.append(
            f"Mistral-7B {'QLoRA' if kind == 'qlora' else 'LoRA'}, 2 -> 4 sequences per rank: published +{pub:.2f} GB, "
            f"estimated +{est:.2f} GB; the loss copy grows by {copy:.2f} GB of the {pub - est:.2f} GB."
        )
    return ("\n\n".join(out) + "\n") if out else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", action="append", help="estimate only this run (its ledger name); prints, writes nothing"
    )
    args = parser.parse_args()
    runs = [r for r in RUNS if not args.only or r.key in args.only]
    started = time.perf_counter()
    rows = []
    for run in runs:
        row = estimate_run(run)
        rows.append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
    if not args.only:
        RESULTS.write_text(render(rows, time.perf_counter() - started), encoding="utf-8")


if __name__ == "__main__":
    main()
