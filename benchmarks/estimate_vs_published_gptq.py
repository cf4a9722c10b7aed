"""The estimate of GPTQ-LoRA (a GPTQ base in the step, issue 26) against fms-acceleration's published runs.

    python benchmarks/estimate_vs_published_gptq.py      # writes benchmarks/results/published-gptq.md
    python benchmarks/estimate_vs_published_gptq.py --only fms-mistral-7b-gptq-lora-1gpu-bs4

Source: fms-acceleration's reference benchmarks, ``scripts/benchmarks/refs/a100_80gb.csv`` at commit 876e2ed (the
file as last changed in 24bdadb, the version the other published tables read), scenario "accelerated-peft-gptq"
(``scripts/benchmarks/scenarios.yaml``: ``fp16: True``, ``torch_dtype: float16``, LoRA r=16 alpha=16 dropout 0.1 on
q/k/v/o), ``framework_config`` accelerated-peft-autogptq (``plugins/accelerated-peft``: the vendored GPTQModel's
triton v2 ``QuantLinear``, PEFT's ``GPTQLoraLinear``), on one A100-SXM4-80GB (``benchmark.py`` runs one GPU as plain
``python``: no accelerate launch, no FSDP). Each run's ledger is ``benchmarks/published-gptq/*.ledger.yaml``;
``ledgerspec estimate`` simulates its step (fake tensors). Nothing is fitted to the published figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import FMS_A100_CSV, TRACKER_HEADER, device_word, markdown_table  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

LEDGERS = ROOT / "benchmarks" / "published-gptq"
RESULTS = ROOT / "benchmarks" / "results" / "published-gptq.md"
FMS = FMS_A100_CSV
#: the two cuBLAS workspaces a CUDA training step allocates through the caching allocator on an A100 (one per
#: thread's handle: the Python thread and the autograd engine's; ``devices/outside.yaml``, ``cublas``): in the
#: published allocated figures, never in the estimate's tensors
CUBLAS = 2 * 8_519_680


@dataclass(frozen=True)
class Run:
    """One published row (bytes; nvidia-smi in MiB): ``mem_peak_torch_mem_alloc_in_bytes``,
    ``mem_torch_mem_alloc_in_bytes``, ``mem_nvidia_mem_reserved``; None: the row has no figure (the run failed)."""

    key: str
    label: str
    csv_line: int
    peak: int | None
    after: int | None
    nvidia_mib: int
    #: 2: FSDP1 on two GPUs (rank 0's figures, simulated by ``shard --estimate``)
    gpus: int = 1


RUNS = [
    Run(
        "fms-mistral-7b-gptq-lora-1gpu-bs4",
        "Mistral-7B GPTQ, 4 x 4096 tokens",
        102,
        16_404_148_736,
        4_336_806_912,
        20010,
    ),
    Run(
        "fms-mistral-7b-gptq-lora-1gpu-bs8",
        "Mistral-7B GPTQ, 8 x 4096 tokens",
        104,
        28_442_489_344,
        4_337_200_128,
        33858,
    ),
    Run(
        "fms-mixtral-8x7b-gptq-lora-1gpu-bs4",
        "Mixtral-8x7B-Instruct GPTQ, 4 x 4096 tokens",
        110,
        36_041_912_832,
        23_974_571_008,
        37596,
    ),
    Run(
        "fms-mixtral-8x7b-gptq-lora-1gpu-bs8",
        "Mixtral-8x7B-Instruct GPTQ, 8 x 4096 tokens",
        112,
        48_080_253_440,
        23_974_964_224,
        50208,
    ),
    Run(
        "fms-llama-2-70b-gptq-lora-1gpu-bs4",
        "Llama-2-70B GPTQ, 4 x 4096 tokens",
        118,
        67_069_711_872,
        36_122_332_160,
        71926,
    ),
    Run(
        "fms-llama-2-70b-gptq-lora-1gpu-bs8",
        "Llama-2-70B GPTQ, 8 x 4096 tokens",
        120,
        None,
        None,
        80778,
    ),
    Run(
        "fms-mistral-7b-gptq-lora-2gpu-bs2",
        "Mistral-7B GPTQ, FSDP1 2 GPUs, 2 x 4096 per rank",
        103,
        9_442_125_824,
        2_261_204_480,
        14887,
        gpus=2,
    ),
    Run(
        "fms-mistral-7b-gptq-lora-2gpu-bs4",
        "Mistral-7B GPTQ, FSDP1 2 GPUs, 4 x 4096 per rank",
        105,
        15_987_599_360,
        2_261_401_088,
        23023,
        gpus=2,
    ),
    Run(
        "fms-mixtral-8x7b-gptq-lora-2gpu-bs2",
        "Mixtral-8x7B-Instruct GPTQ, FSDP1 2 GPUs, 2 x 4096 per rank",
        111,
        20_432_607_232,
        12_044_369_408,
        27105,
        gpus=2,
    ),
    Run(
        "fms-mixtral-8x7b-gptq-lora-2gpu-bs4",
        "Mixtral-8x7B-Instruct GPTQ, FSDP1 2 GPUs, 4 x 4096 per rank",
        113,
        27_446_670_336,
        12_044_566_016,
        32530,
        gpus=2,
    ),
    Run(
        "fms-llama-2-70b-gptq-lora-2gpu-bs2",
        "Llama-2-70B GPTQ, FSDP1 2 GPUs, 2 x 4096 per rank",
        119,
        45_637_991_424,
        18_219_929_088,
        52716,
        gpus=2,
    ),
    Run(
        "fms-llama-2-70b-gptq-lora-2gpu-bs4",
        "Llama-2-70B GPTQ, FSDP1 2 GPUs, 4 x 4096 per rank",
        121,
        None,
        None,
        80935,
        gpus=2,
    ),
]


@dataclass(frozen=True)
class Row:
    run: Run
    peak: int
    peak_phase: str
    state: int  # frozen base + adapter + optimizer state: what is allocated when train() returns
    phases: dict[str, int]
    seconds: float
    #: 2 GPUs: rank 0's device-level verdict on the ledger's A100-80GB (the allocator model's replay plus what lies
    #: outside it): (device peak, fits, fits only with the outside-allocator catalogue's typical figure)
    device: tuple[int, bool, bool] | None = None

    def cells(self) -> list[str]:
        r = self.run

        def diff(a: int, b: int | None) -> str:
            return "-" if b is None else f"{(a - b) / b:+.2%}"

        def gb(b: int | None, missing: str) -> str:
            return missing if b is None else f"{b / 1e9:.2f}"

        return [
            r.label,
            f"`{r.key}.ledger.yaml`",
            gb(r.peak, "- (out of memory)"),
            f"{self.peak / 1e9:.2f}",
            diff(self.peak, r.peak),
            gb(r.after, "-"),
            f"{self.state / 1e9:.2f}",
            diff(self.state, r.after),
            f"{r.nvidia_mib / 1024:.2f}",
        ]


HEADER = TRACKER_HEADER


def estimate_run(run: Run) -> Row:
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate.estimator import estimate

    started = time.perf_counter()
    doc = load(LEDGERS / f"{run.key}.ledger.yaml")
    if run.gpus > 1:
        from ledgerspec.derivations.shard.sharder import shard

        sharded = shard(doc, estimate=True, target="cuda").estimate
        assert sharded is not None and sharded.strategy == "fsdp1"
        r0 = sharded.ranks[0]
        memory = doc.get("result", "target_device", "memory").size()
        verdict = sharded.fits(memory)[0] if memory else None
        uncertain = bool(sharded.device and sharded.device[0].uncertain)
        phases, c = dict(r0.phases), r0.components
        peak_phase = max(("forward_peak", "backward_peak", "optimizer_step_peak", "steady_state_peak"), key=phases.get)
        # FSDP1 with use_orig_params frees a flat parameter's sharded gradient only at the next forward
        # (``_reset_flat_param_grad_info_if_needed``, from the root's ``_pre_forward``): held when train() returns
        return Row(
            run,
            r0.peak,
            peak_phase,
            c["frozen_base"] + c["adapter"] + c["gradients"] + c["optimizer"],
            phases,
            time.perf_counter() - started,
            (verdict.peak, verdict.fits, uncertain) if verdict is not None else None,
        )
    est = estimate(doc, target="cuda")
    c = est.components
    return Row(
        run,
        est.peak_allocated,
        est.peak_phase,
        c["frozen_base"] + c["adapter"] + c["optimizer"],
        dict(est.phases),
        time.perf_counter() - started,
    )


EXPLAINED = """## What each figure includes, and every difference

- **Published**: rank 0's `TrainerMemoryTracker` figures of `trainer.train()` (`torch.cuda.max_memory_allocated()` and
  `torch.cuda.memory_allocated()` when it returns), GB = 1e9 B. **Estimated**: the largest simulated phase (one
  step, then a steady-state step with AdamW's state), and frozen base + adapters + AdamW state for after `train()`
  (the Trainer's `zero_grad` frees the gradients; on 2 GPUs FSDP1 keeps the adapters' sharded gradients, below).
- **The base**: the published checkpoints' main branches, 4-bit with act-order; group size 128 for
  `TheBloke/Mistral-7B-v0.1-GPTQ`, none (-1) for `TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ` and
  `TheBloke/Llama-2-70B-GPTQ`. No config is shipped here; the group sizes are read off the published after-`train()`
  figures: with group size -1 the Mistral base would be 0.13 GB smaller, with 128 the Mixtral base 0.89 GB and the
  Llama-2-70B base 1.32 GB larger, each off by far more than the 17 MB left below. The frozen base is the census's
  exact GPTQ storage (`qweight`, `qzeros`, `scales`, `g_idx` per QuantLinear; the embeddings, norms and head in
  float16: PEFT's k-bit preparation upcasts nothing on a model marked `quantization_method = "gptq"`).
- **Mixtral's layout**: the declared transformers 4.48.1 builds each of the 32 x 8 experts as `nn.Linear` modules
  `w1`, `w3` (4,096 -> 14,336) and `w2` (14,336 -> 4,096) and loops over them (`stack/legacy_moe`, as in
  `published-moe.md`); the plugin's vendored GPTQModel loads every one of them, and q/k/v/o, as a triton v2
  `QuantLinear`, and leaves the router `block_sparse_moe.gate` (4,096 -> 8) an `nn.Linear` in float16: its Mixtral
  definition's `layer_modules` do not name it (`gptqmodel/models/mixtral.py`, applied by `models/base.py`
  `from_quantized`, lines 1142-1162 at 876e2ed). 896 QuantLinear layers, 23.27 GB; checked on a tiny Mixtral
  against the upstream QuantLinear and that definition (`tests/derivations/engine/test_gptq.py`).
- **The step**: the triton v2 `QuantLinear` of fms-acceleration's vendored GPTQModel (the weight dequantized to a
  float16 (in, out) workspace in forward and again in backward; nothing kept for backward but its own buffers:
  `ledgerspec/derivations/engine/gptq.py`, checked against those source files in
  `tests/derivations/engine/test_gptq.py`), PEFT 0.13.2's `GPTQLoraLinear.forward` (declared `peft: 0.13.2`: no
  input cast under autocast; known difference `peft-gptq-lora-input-cast`), fp16 autocast with a GradScaler,
  reentrant checkpointing, flash-attention 2, transformers 4.48.1's loss (the shifted float32 logits copied, known
  difference `transformers-causal-lm-loss-shift-copy`).
- **After `train()`**: 17.45 MB (Mistral and Mixtral, 4 sequences: 17,450,496 B both), 17.84 MB (Mistral and
  Mixtral, 8: 17,843,712 B both) and 17.47 MB (Llama-2-70B) low.
  17.04 MB of it are the two cuBLAS workspaces (8,519,680 B per handle on an A100, one handle for the Python thread
  and one for the autograd engine's thread): allocated through PyTorch's caching allocator, so in the published
  figures, but no tensors, so never in the estimate (`ledgerspec/derivations/devices/outside.yaml`, `cublas`). The
  rest, 0.41 / 0.80 / 0.43 MB, grows with the batch: three int64 tensors of batch x 4,096 are 0.39 / 0.79 / 0.39 MB,
  as if the last batch were still held when the tracker reads memory (the Trainer's loop still has it in scope there;
  plausible, not verified); the last 18-33 KB are not identified.
- **Mistral-7B and Mixtral-8x7B peaks**: 18.2 MB and 19.4 MB low, of which 17.04 MB are the same cuBLAS workspaces;
  the rest (1.1 MB, 2.4 MB) grows with the batch and is not identified. The two models differ from their published
  peaks by the same bytes (18,177,024 B at 4 sequences, 19,430,400 B at 8), so none of it is the model, its MoE
  layout or the routing. The peak is at the end of the forward: the checkpointed layer inputs and what the loss keeps
  for backward (the float16 logits, their float32 copy, the shifted copy of 4.48.1's loss); Mixtral's expert
  transients (the estimate gives each expert an even share of the tokens, a fake tensor has no router values) are
  gone by then.
- **Llama-2-70B, 4 x 4096 tokens**: +1.59 GB (+2.4%). The estimate's peak is in backward, while every checkpointed
  layer input is still held (21.48 GB, the whole of the activations at that moment) and 11.08 GB were made in
  backward: the recompute of the last decoder layer and its backward (its MLP's float16 16,384 x 28,672 tensors are
  0.94 GB each; the dequantized down projection 0.47 GB); at the end of the forward the estimate holds 65.86 GB
  (steady state), 1.21 GB below the published peak. Where the published run's backward holds 1.59 GB less than the
  simulation of the installed stack (transformers 5's Llama layer, torch 2.13's checkpoint) is not identified;
  the other 70B run the tables compare (QLoRA nf4 on 2 GPUs, `published-multi-gpu.md`) has its peak elsewhere.
- **Llama-2-70B, 8 x 4096 tokens**: the published row has no memory figures (the run did not finish; nvidia-smi shows
  the 80 GB card full); the estimate predicts a peak above the card's 80 GiB, so it agrees that the run cannot fit.
- **Two GPUs (FSDP1)**: `benchmark.py` launches the 2-GPU rows with `accelerate launch` and its `accelerate.yaml`
  (FSDP1, `FULL_SHARD`, `TRANSFORMER_BASED_WRAP`, which the Trainer replaces by PEFT's `fsdp_auto_wrap_policy`); with
  `fp16` accelerate 1.0.1 sets `MixedPrecision(param_dtype = reduce_dtype = buffer_dtype = float16)` (a GPTQ model
  is not bitsandbytes': the Trainer's QLoRA override does not apply). The plugin makes each `QuantLinear`'s `qweight`
  and `qzeros` frozen float16 `nn.Parameter` views of their int32 bytes, so that FSDP1 flattens and shards them with
  the layer's norms (and Mixtral's routers), and views them back as int32 in the forward; `scales` and `g_idx` stay
  buffers, whole on every rank (`autogptq_utils.py`, `build_patch_to_view_tensor_to_parameter_for_fsdp_gptq`,
  registered by `framework_plugin_autogptq.py` when `world_size > 1` under FSDP). `shard --estimate` runs that model
  through FSDP1 under fake tensors (rank 0 shown; `engine/gptq.py` `as_fsdp_parameters`, equal on a tiny model to
  the plugin's own function and, per rank and phase, to a real FSDP1 run on the CPU:
  `tests/derivations/engine/test_gptq.py`), with the rest of the 2-GPU QLoRA rows' translation (`published-moe.md`,
  `published-multi-gpu.md`): BACKWARD_PRE backward prefetch (the runs' accelerate.yaml), transformers 4.48.1's
  checkpoint around each FSDP1 unit.
- **2 GPUs, after `train()`**: 17.25 MB (2 sequences per rank) and 17.44 MB (4) low on Mistral and Mixtral alike
  (17,246,464 B and 17,443,072 B; Llama-2-70B 17,253,120 B), of which 17.04 MB are the cuBLAS workspaces and 0.20 /
  0.39 MB the three int64 batch tensors as on one GPU. The estimate counts the adapters' sharded gradients as still
  allocated: FSDP1 with `use_orig_params` frees a flat parameter's gradient only at the next forward
  (`_reset_flat_param_grad_info_if_needed`, called from the root's `_pre_forward`, torch
  `distributed/fsdp/_runtime_utils.py`), after the Trainer's `zero_grad(set_to_none=True)` cleared the original
  parameters' gradients; without them every 2-GPU row would be low by one adapter shard more (27.26 MB for Mistral and
  Mixtral).
- **2 GPUs, peaks**: +1.7% to +4.9%, 0.37-0.79 GB above the published peaks. Each simulated peak is in the
  backward of the steady-state step (the forward peaks are far lower: 33.67 against 46.43 GB on Llama-2-70B), and
  the excess grows with the tokens on the rank: 5.6 to 5.9 times tokens x hidden size x 2 B on every 2-GPU row
  (Mistral-7B and Mixtral, hidden 4,096: 0.39 / 0.79 GB and 0.37 / 0.77 GB at 2 / 4 sequences; Llama-2-70B, hidden
  8,192: 0.79 GB at 2), as on the Llama-2-70B 1-GPU row, the other one whose simulated peak is in backward (5.9);
  the 1-GPU rows whose peak is at the end of the forward agree within 0.11%. The LoRA dropout (0.1 on q/k/v/o) is
  8 of those units in the simulated backward of the recomputed layer (the same Mistral row with `dropout: 0` peaks
  0.54 GB lower, 1.6% below the published peak), so the published backward holds most of what the simulation keeps
  for the adapters' dropout but not all; the rest is not identified without a GPU run of the declared stack.
- **Llama-2-70B, FSDP1, 4 x 4096 tokens per rank**: the published row has no memory figures (the run did not finish;
  nvidia-smi reads 79.04 GiB, the card full). The allocated estimate does not predict the failure: rank 0's allocated
  peak is 73.17 GB (68.15 GiB); the device-level model (the caching allocator replayed, plus the CUDA context, NCCL
  and the rest outside it) puts the rank at the edge of the card's 79.25 GiB CUDA total, and a step at the edge does
  not fit (the verdict column above: `does not fit, at the edge`, it completes only with the typical bytes outside
  the allocator; `device-gptq.md` compares it). With the backward excess of the other 2-GPU rows (about 1.6 GB at
  this size) the real allocated peak would be lower still; why the real run did not finish (the allocator's
  fragmentation on the GPU, NCCL's buffers at this size, or something outside the step) is not settled without a
  GPU run.
- **Not modelled** in the allocated figures: the CUDA context and the allocator cache (the nvidia-smi column, not
  compared; the 2-GPU device verdicts model both).
"""


def render(rows: list[Row], elapsed: float) -> str:
    import torch
    import transformers

    lines = [
        "# GPTQ-LoRA: estimate vs published runs (issue 26)",
        "",
        "Command: `python benchmarks/estimate_vs_published_gptq.py`. Machine (for the estimate): "
        f"{cpu_model()}, torch {torch.__version__}, transformers {transformers.__version__}; no GPU used "
        f"({elapsed:.0f} s for all rows).",
        "",
        f"Source: fms-acceleration's reference benchmarks, `scripts/benchmarks/refs/a100_80gb.csv` ({FMS}), scenario "
        "`accelerated-peft-gptq`, `framework_config` accelerated-peft-autogptq, one or two A100-SXM4-80GB (FSDP1): "
        "LoRA r=16 alpha=16 "
        "dropout 0.1 on q/k/v/o over a 4-bit GPTQ base loaded in float16, fp16 mixed precision, AdamW (torch), packed "
        "4,096-token sequences, gradient checkpointing, flash-attention 2, transformers 4.48.1 (its per-expert "
        "Mixtral layout, built as declared) / PEFT 0.13.2 / torch 2.4.1 (`refs/requirements.txt`). Published = "
        "`TrainerMemoryTracker` figures (GB = 1e9 B); CSV lines " + ", ".join(str(r.run.csv_line) for r in rows) + ".",
        "",
        *markdown_table(HEADER, [row.cells() for row in rows]),
        "",
        "Simulated phases (GB; the estimate is their maximum):",
        "",
        "| run | after load | forward | backward | optimizer step | steady state | peak phase | device verdict "
        "(2 GPUs, rank 0, of 80 GiB) | estimate s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        p = row.phases
        device = "-"
        if row.device is not None:
            word = device_word(row.device[1], row.device[2])
            device = f"{word}, device peak {row.device[0] / 2**30:.2f} GiB"
        lines.append(
            f"| {row.run.label} | {p['after_load'] / 1e9:.2f} | {p['forward_peak'] / 1e9:.2f} | "
            f"{p['backward_peak'] / 1e9:.2f} | {p['optimizer_step_peak'] / 1e9:.2f} | "
            f"{p['steady_state_peak'] / 1e9:.2f} | {row.peak_phase} | {device} | {row.seconds:.0f} |"
        )
    compared = [r for r in rows if r.run.peak is not None]
    diffs = [(r.peak - r.run.peak) / r.run.peak for r in compared if r.run.peak]
    within = sum(abs(d) <= 0.10 for d in diffs)
    median = statistics.median(diffs) if diffs else 0.0
    lines += [
        "",
        f"Within 10% of the published peak: {within} of {len(compared)} runs with a published peak; "
        f"median difference {median:+.2%}.",
        "",
        EXPLAINED,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="estimate only this run (its ledger name); writes nothing")
    parser.add_argument("--dump", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    runs = [r for r in RUNS if not args.only or r.key in args.only]
    started = time.perf_counter()
    rows = []
    for run in runs:
        row = estimate_run(run)
        rows.append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
    if args.dump:
        import dataclasses
        import json

        Path(args.dump).write_text(json.dumps([dataclasses.asdict(r) for r in rows]), encoding="utf-8")
    if not args.only:
        RESULTS.write_text(render(rows, time.perf_counter() - started), encoding="utf-8")


if __name__ == "__main__":
    main()
