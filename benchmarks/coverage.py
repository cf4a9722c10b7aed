"""The coverage matrix: every architecture family with a shipped real config x LoRA/QLoRA x resolve/estimate.

One command: ``python benchmarks/coverage.py [--only NAME ...] [--check]``. Each cell runs in this process
(imports once): ``resolve`` and ``estimate`` (CUDA target, layer extrapolation as the CLI does it) on an intake
built from the family's ``examples/configs/<name>/config.json``: LoRA r16 all-linear (lora_dropout 0: PEFT's
expert-parameter wrapper refuses any other value, see the DeepSeek row with dropout 0.05), bf16 base, fp32 adapters,
AdamW, gradient checkpointing, one row of 256 tokens; QLoRA is the same on a bitsandbytes nf4 base with double
quantization (for the GPTQ row: the published GPTQ base). A cell is ``✓`` with its figure (total parameters for
resolve, predicted peak for estimate), ``✓`` plus the limits the tools named (their notes), or ``refused:`` with
the one-line reason the tool gave. A cell runs as the command does: validate's input checks first (the preflight
of ``ledgerspec resolve``/``estimate``), then the step. Results go to ``benchmarks/results/coverage.md`` with the
machine it ran on; ``tests/benchmarks/test_coverage.py`` re-runs every resolve cell of the committed matrix (and
some estimate cells) and compares the text.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, memory_bytes  # noqa: E402  (benchmarks/machine.py)

CONFIGS = ROOT / "examples" / "configs"
RESULTS = ROOT / "benchmarks" / "results" / "coverage.md"


@dataclass(frozen=True)
class Family:
    family: str
    config: str
    attention: str = "sdpa"
    dropout: float = 0.0
    qlora: str = "nf4"  # the QLoRA column's base: nf4 (bitsandbytes) or the published quantization (gptq)
    loaded: str = "bfloat16"
    #: why the estimate cells are not run (a named limit), None: run them
    no_estimate: str | None = None


FAMILIES = [
    Family("Llama 2", "llama-2-7b"),
    Family("Llama 3.x", "llama-3.2-1b"),
    Family("SmolLM2", "smollm2-1.7b"),
    Family("Qwen2.5 dense", "qwen2.5-0.5b"),
    Family("Qwen3 dense", "qwen3-8b"),
    Family("Qwen3 MoE", "qwen3-30b-a3b"),
    Family("Gemma 2", "gemma-2-9b", attention="eager"),
    Family("Gemma 3 (text)", "gemma-3-1b-it"),
    Family("Gemma 3 (vision-language)", "gemma-3-4b-it"),
    Family("Mistral", "mistral-7b-v0.1"),
    Family("Mistral NeMo", "mistral-nemo-12b"),
    Family("Mixtral", "mixtral-8x7b"),
    Family("Phi-3", "phi-3-mini-4k"),
    Family("Phi-4", "phi-4"),
    Family("OLMo-2", "olmo-2-7b"),
    Family("DeepSeek-V2", "deepseek-v2-lite"),
    Family("DeepSeek-V2, lora_dropout 0.05", "deepseek-v2-lite", dropout=0.05),
    Family(
        "DeepSeek-V3",
        "deepseek-v3",
        no_estimate="not run here: the layers are not periodic (3 dense, then MoE), so all 61 layers x 256 experts "
        "are traced in full: over 5 min a cell on 2 cores",
    ),
    Family("gpt-oss", "gpt-oss-20b", attention="eager"),
    Family("Qwen2.5-VL", "qwen2.5-vl-7b"),
    Family("Qwen3-VL", "qwen3-vl-8b"),
    Family("Llama 3.2 Vision", "llama-3.2-11b-vision"),
    Family("Qwen2.5 GPTQ (published int4 base)", "qwen2.5-7b-instruct-gptq-int4", qlora="gptq", loaded="float16"),
]
COLUMNS = ("LoRA resolve", "LoRA estimate", "QLoRA resolve", "QLoRA estimate")


def intake(f: Family, kind: str) -> str:
    quant = ""
    if kind == "QLoRA" and f.qlora == "nf4":
        quant = (
            "  quantization: {type: nf4, double_quant: true, compute_dtype: bfloat16, storage_dtype: uint8}\n"
            "  quantized: true\n"
        )
    elif kind == "QLoRA" and f.qlora == "gptq":  # the kernel transformers loads through gptqmodel (TorchLinear)
        quant = "  quantization: {type: gptq, kernel: torch}\n  quantized: true\n"
    elif kind == "QLoRA":
        quant = f"  quantization: {{type: {f.qlora}}}\n  quantized: true\n"
    return f"""ledgerspec: intake/v1
identity:
  model_id: coverage/{f.config}
  config_path: {CONFIGS / f.config / "config.json"}
software:
  attention_implementation: {f.attention}
method:
  kind: {kind}
  rank: 16
  alpha: 32
  dropout: {f.dropout}
  target_modules: all-linear
base_model:
  loaded_dtype: {f.loaded}
{quant}adapter:
  dtype: float32
workload:
  max_length: 256
  microbatch: 1
optimizer:
  name: adamw_torch
memory_options:
  gradient_checkpointing: true
"""


@dataclass
class Cell:
    ok: bool
    text: str
    seconds: float
    limits: list[str] = field(default_factory=list)

    def render(self) -> str:
        if not self.ok:
            return f"refused: {self.text}"
        if self.limits:
            return f"✓ {self.text}; limits: " + " / ".join(self.limits)
        return f"✓ {self.text}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _short(note: str) -> str:
    """The first clause of a note (the matrix names the limit; resolve's output has the figures and hints)."""
    return note.split(":", 1)[0].strip()


def checked_intake(f: Family, kind: str, step: str) -> Any:
    """The cell's intake as ``ledgerspec resolve``/``estimate`` reads it before importing torch: the header, then
    validate's input checks (:func:`ledgerspec.faces.preflight.preflight`: a rule such as LS030 refuses here).
    Raises the command's :class:`~ledgerspec.errors.LedgerspecError`; cheap (no torch)."""
    from ledgerspec.contract.document import from_text, require_header
    from ledgerspec.faces.preflight import preflight

    doc = require_header(from_text(intake(f, kind), f"<{f.config} {kind}>"), step)
    preflight(doc, step)
    return doc


def refusal(exc: Any) -> Cell:
    return Cell(False, exc.message + (f" (hint: {exc.hint})" if exc.hint else ""), 0.0)


def run_cell(f: Family, kind: str, step: str) -> Cell:
    """One cell as the command runs it: :func:`checked_intake`, then the step."""
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.resolve.resolver import resolve
    from ledgerspec.errors import LedgerspecError

    started = time.perf_counter()
    try:
        doc = checked_intake(f, kind, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if step == "resolve":
                result = resolve(doc, offline=True)
                text = (
                    f"{result.figures.total_parameters:,} params, frozen base {_gib(result.figures.frozen_base_bytes)}"
                )
                limits = [_short(n) for n in result.notes]
            else:
                est = estimate(doc, target="cuda")
                text = f"peak {_gib(est.peak_allocated)} ({est.peak_phase})"
                limits = ["text-only batch"] if "vision-language model" in est.method else []
    except LedgerspecError as exc:
        cell = refusal(exc)
        cell.seconds = time.perf_counter() - started
        return cell
    return Cell(True, text, time.perf_counter() - started, limits)


def render(rows: dict[str, dict[str, Cell]], seconds: float) -> str:
    out = [
        "# Coverage matrix",
        "",
        f"`python benchmarks/coverage.py` on {cpu_model()} ({os.cpu_count()} cores), "
        f"{memory_bytes() / 2**30:.0f} GiB, Python {platform.python_version()}; total {seconds:.0f} s.",
        "",
        "Each cell: `resolve` or `estimate` (CUDA target) of LoRA r16 all-linear (lora_dropout 0 unless the row",
        "says otherwise), bf16 base, fp32 adapters, AdamW, gradient checkpointing, 1 x 256 tokens; QLoRA: bitsandbytes",
        "nf4 + double quant (the GPTQ row: its published GPTQ int4 base). `✓` with the figure; the limits the tool",
        "named (its notes: `ledgerspec resolve` prints their figures and hints); `refused:` with the tool's reason.",
        "",
        "| family | config | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for f in FAMILIES:
        cells = rows.get(f.family)
        if cells is None:
            continue
        line = [f.family, f"`{f.config}`"] + [cells[c].render().replace("|", "\\|") for c in COLUMNS]
        out.append("| " + " | ".join(line) + " |")
    out.append("")
    out.append(
        "Seconds per cell (this machine, imports excluded): "
        + ", ".join(
            f"{f.config} {sum(c.seconds for c in rows[f.family].values()):.0f}" for f in FAMILIES if f.family in rows
        )
    )
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows: dict[str, dict[str, Cell]] = {}
    for f in FAMILIES:
        if args.only and f.config not in args.only:
            continue
        rows[f.family] = {}
        for column in COLUMNS:
            kind, step = column.split()
            cell = (
                Cell(True, f"limit: {f.no_estimate}", 0.0)
                if step == "estimate" and f.no_estimate
                else run_cell(f, kind, step)
            )
            rows[f.family][column] = cell
            print(f"{f.family:40} {column:15} {cell.seconds:5.1f}s {cell.render()[:150]}", flush=True)
    Path(args.output).write_text(render(rows, time.perf_counter() - started))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
