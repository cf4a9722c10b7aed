"""The naive article's table rows (a popular article on LoRA VRAM), estimated component by component.

    python benchmarks/estimate_naive_audit.py     # section "naive-audit" of benchmarks/results/estimate.md

Rows: LLaMA-7B, Mistral-7B, LLaMA-13B; batch 1, sequence 2048, FP16, AdamW, LoRA r=16 on q_proj/v_proj;
gradient checkpointing off and on; attention sdpa (transformers' default) and eager. The article's own
arithmetic (for 7B: weights 14 GB + gradients 14 GB + AdamW 28 GB, i.e. 2 + 2 + 4 B per parameter of the
WHOLE model, + 10-20 GB of activations) is printed next to it. docs/naive-article-audit.md discusses the result.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine, write_section  # noqa: E402
from ledgerspec.contract.document import load  # noqa: E402
from ledgerspec.derivations.estimate import sweep  # noqa: E402
from ledgerspec.derivations.estimate.estimator import estimate  # noqa: E402

ARTICLE = ROOT / "tests" / "data" / "estimate" / "article"
#: the article's table (GB, decimal as it writes them): without / with gradient checkpointing
TABLE = {
    "llama-7b": ("LLaMA-7B", (66, 76), (40, 50)),
    "mistral-7b": ("Mistral-7B", (60, 70), (38, 48)),
    "llama-13b": ("LLaMA-13B", (120, 140), (80, 100)),
}


def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    lines = [
        "## The naive article's table, estimated (`benchmarks/estimate_naive_audit.py`)",
        "",
        f"Machine: {machine()}.",
        "",
        "GB = 10^9 B. Estimate: predicted peak allocated (CUDA kernels modelled), and its components. "
        "The article's arithmetic for the same model: 2 B weights + 2 B gradients + 4 B AdamW per parameter of "
        "the whole model (its 14 + 14 + 28 GB for 7B).",
        "",
        "| model | ckpt | attention | frozen base | adapter | gradients | AdamW state | activations | "
        "peak allocated | article's range | article's weights+grads+AdamW (8 B/param) | time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (label, off, on) in TABLE.items():
        base = load(ARTICLE / f"{name}.ledger.yaml")
        for ckpt in (False, True):
            for attention in ("sdpa", "eager"):
                doc = sweep.apply(base, {"gradient_checkpointing": ckpt, "attention_implementation": attention})
                t0 = time.perf_counter()
                est = estimate(doc)
                secs = time.perf_counter() - t0
                c = est.components
                params = c["frozen_base"] // 2  # fp16 base: 2 bytes per parameter
                naive = params * (2 + 2 + 4)
                rng = on if ckpt else off
                lines.append(
                    f"| {label} | {'on' if ckpt else 'off'} | {attention} | {gb(c['frozen_base'])} | "
                    f"{gb(c['adapter'])} | {gb(c['gradients'])} | {gb(c['optimizer'])} | "
                    f"{gb(est.activations)} | **{gb(est.peak_allocated)}** | {rng[0]}-{rng[1]} | "
                    f"{gb(naive)} | {secs:.1f} s |"
                )
                print(lines[-1], flush=True)
    write_section("naive-audit", "\n".join(lines))


if __name__ == "__main__":
    main()
