"""Every published run the device-level prediction is compared with, in one table (issue 23's two criteria).

    python benchmarks/device_summary.py     # writes benchmarks/results/device-summary.md (in a second)

Nothing is estimated here: the rows are read from the committed comparison pages, each written by its own benchmark
from published measurements (`device.md`, `device-fsdp.md`, `device-gptq.md`: fms-acceleration's nvidia-smi peaks
on A100s; `device-answerai.md`: Answer.AI's peak reserved on RTX 3090/4090s; `liger-runs.md`: fms-acceleration's
runs with fused kernels, some of which ledgerspec does not model). The two criteria: the device-level peak against
the published figure (median over the runs that trained), and the published outcome (trained, or ran out of memory)
against the verdict. `device-sibling.md` is left out: it is a calibration from a trained run, not a prediction.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import markdown_table, publish  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS = RESULTS_DIR / "device-summary.md"
#: a difference above this (either way) is an outlier the page it comes from explains
OUTLIER = 0.05


@dataclass(frozen=True)
class Page:
    """One comparison page: where its cells are (0-based, in its main table's rows)."""

    file: str
    figure: str  # what the published figure is: nvidia-smi's peak, or the allocator's peak reserved
    published: int
    predicted: int
    difference: int  # the page's own difference cell (from unrounded figures), "-" where the run did not train
    trained: Callable[[list[str]], bool]
    verdict: Callable[[list[str]], str]
    #: why the tool does not model these runs' whole step ("": it does)
    not_modelled: str = ""
    key: int = 1  # the cell naming the ledger


def _fits(verdict: str) -> bool:
    return verdict.startswith("fits")


PAGES = (
    Page("device.md", "nvidia-smi", 5, 6, 7, lambda c: c[10] == "ran", lambda c: c[11]),
    Page("device-fsdp.md", "nvidia-smi", 5, 6, 7, lambda c: c[10] == "ran", lambda c: c[11]),
    Page("device-gptq.md", "nvidia-smi", 5, 6, 7, lambda c: c[10] == "ran", lambda c: c[11]),
    Page("device-answerai.md", "peak reserved", 5, 6, 7, lambda c: True, lambda c: c[9]),  # every published run trained
    Page(
        "liger-runs.md",
        "nvidia-smi",
        10,
        11,
        12,
        lambda c: c[13].startswith("ran"),
        lambda c: c[13].split(" / ", 1)[1],
        "fms's fused-ops-and-kernels plugin (foak: its cross-entropy, fused LoRA, Unsloth's RMSNorm and RoPE)",
        key=0,
    ),
)


#: why each run more than :data:`OUTLIER` off is off, in a line, by its page's discussion (the page has the figures and
#: the sources); "not identified" where the page says so. A new outlier without a line here fails the summary's test.
_TWO_GPU = (
    "the 2-GPU fms rows hold 0.5-2.7 GiB per GPU above the prediction, about the same at 2 and 4 sequences (not "
    "activations); NCCL 2.20.5's source gives 288 MiB, inside the catalogue: not identified without a GPU run "
    "(`measure --device cuda --nproc 2` records `outside_allocator.per_rank`)"
)
_GPTQ = (
    "the GPTQ stack's reserve above the allocated peak is short by {}: not identified; its Triton kernels' "
    "modules and autotuning are a hypothesis, not measured"
)
_AT_THE_TOP = (
    "near the top of its RTX 3090: replayed against the high end of the catalogue's range outside the allocator, the "
    "allocator frees its cache and reserves about the published figure (an explanation after the fact)"
)
REASONS = {
    "fms-mistral-7b-qlora-2gpu-bs2": _TWO_GPU,
    "fms-mistral-7b-qlora-2gpu-bs4": _TWO_GPU,
    "fms-mistral-7b-full-2gpu-bs2": _TWO_GPU,
    "fms-mistral-7b-full-2gpu-bs4": _TWO_GPU,
    "fms-mistral-7b-full-1gpu-bs8": (
        "the step reaches the card: the replay completes only by freeing its cache (83.97 GiB without a limit), the "
        "run did too (nvidia-smi lower at 8 sequences than at 4), and nvidia-smi's one-second samples can miss the top"
    ),
    "fms-mistral-7b-gptq-lora-1gpu-bs4": _GPTQ.format("1.0-4.4 GiB on one GPU"),
    "fms-mistral-7b-gptq-lora-1gpu-bs8": _GPTQ.format("1.0-4.4 GiB on one GPU"),
    "fms-mistral-7b-gptq-lora-2gpu-bs2": _GPTQ.format("2.3-4.2 GiB per GPU on two"),
    "fms-mistral-7b-gptq-lora-2gpu-bs4": _GPTQ.format("2.3-4.2 GiB per GPU on two"),
    "fms-mixtral-8x7b-gptq-lora-2gpu-bs2": _GPTQ.format("2.3-4.2 GiB per GPU on two"),
    "fms-mixtral-8x7b-gptq-lora-2gpu-bs4": _GPTQ.format("2.3-4.2 GiB per GPU on two"),
    "aai-llama-2-7b-qlora-2gpu-2048-bs10": _AT_THE_TOP,
    "aai-llama-2-7b-qlora-2gpu-2048-bs8-ddp": _AT_THE_TOP,
    "aai-llama-2-7b-qlora-2gpu-2048-bs12-offload": (
        "the miss: up to the request that fails the replay reserves 22.29 GiB (the run's published peak: 22.38 GiB), "
        "then the allocator's retry after freeing its cache lacks 227 MiB, decided by fragmentation (with "
        "`expandable_segments:True` it fits); one block decides it: in the second iteration a 384 MiB float32 block "
        "(by its size and place, the final RMSNorm's upcast of the hidden states, kept for backward) is cut from a "
        "cached 2.93 GiB logits-sized segment, the allocator's best fit for it; given a segment of its own the "
        "replay completes against the card (peak reserved 22.29 GiB, -0.4 %): the outcome turns on one placement, "
        "which only a GPU trace of the run can check"
    ),
    "aai-llama-2-70b-qlora-2gpu-2048-bs2-offload": (
        "`train.py` quantizes each weight on the GPU before wrapping and leaves its quantization state there, in "
        "segments shared with the quantization's temporaries: not simulated"
    ),
}


@dataclass(frozen=True)
class Row:
    page: Page
    run: str
    ledger: str
    published: float
    predicted: float
    trained: bool
    verdict: str
    #: the page's difference, a fraction (None: the run did not train)
    difference: float | None

    @property
    def outcome_predicted(self) -> bool:
        return self.trained == _fits(self.verdict)

    def cells(self) -> list[str]:
        d = self.difference
        return [
            f"`{self.page.file}`",
            self.run,
            self.page.figure,
            f"{self.published:.2f}",
            f"{self.predicted:.2f}",
            "-" if d is None else f"{d:+.1%}",
            "trained" if self.trained else "out of memory",
            self.verdict.split(" (")[0],
            "yes" if self.outcome_predicted else "**no**",
        ]


def table_rows(path: Path) -> list[list[str]]:
    """The cells of the first table's rows in ``path`` (its header and separator left out)."""
    out: list[list[str]] = []
    started = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| "):
            if started and not line.startswith("| ---"):
                out.append([c.strip() for c in line.strip().strip("|").split(" | ")])
            started = True
        elif started and out:
            break
    return out


def rows_of(page: Page, results: Path = RESULTS_DIR) -> list[Row]:
    out = []
    for c in table_rows(results / page.file):
        ledger = c[page.key].strip("`").removesuffix(".ledger.yaml")
        trained = page.trained(c)
        d = float(c[page.difference].rstrip("%")) / 100 if trained else None
        out.append(
            Row(page, c[0], ledger, float(c[page.published]), float(c[page.predicted]), trained, page.verdict(c), d)
        )
    return out


#: rows within the outlier bound that agree through the allocator's free-and-retry at the top of the card, not
#: through the reserve below it (``device-answerai.md`` gives their figures without a limit)
CAPPED_AGREEMENT = (
    "Within 5 % by the free-and-retry: the two Mistral-7B v0.2 QLoRA rows on 2 x RTX 4090 replay well above the "
    "published peak without a limit, as the Llama-2-7B QLoRA rows at 10 to 12 sequences do, and meet the published "
    "figure because their replays reach the top of the card, free the cache and retry (`device-answerai.md`, under "
    "the rows more than 5 % off): they check that path, not the reserve below the top."
)


def _summary(rows: list[Row]) -> str:
    diffs = [r.difference for r in rows if r.difference is not None]
    misses = [r for r in rows if not r.outcome_predicted]
    within = sum(abs(d) <= OUTLIER for d in diffs)
    oom = sum(not r.trained for r in rows)
    return (
        f"{len(rows)} runs, {len(diffs)} trained and {oom} out of memory. The predicted peak against the "
        f"published one, runs that trained: median {statistics.median(diffs):+.1%}, median of the absolute differences "
        f"{statistics.median(map(abs, diffs)):.1%}, {within} of {len(diffs)} within {OUTLIER:.0%}. The published "
        f"outcome is predicted for {len(rows) - len(misses)} of {len(rows)}"
        + (
            "; not for "
            + "; ".join(f"{r.run} (`{r.page.file}`: {'trained' if r.trained else 'out of memory'}, predicted "
                        f"{r.verdict.split(' (')[0]})" for r in misses)
            if misses
            else ""
        )
        + "."
    )  # fmt: skip


def body(results: Path = RESULTS_DIR) -> str:
    modelled = [r for p in PAGES if not p.not_modelled for r in rows_of(p, results)]
    other = [r for p in PAGES if p.not_modelled for r in rows_of(p, results)]
    outliers = [r for r in modelled if r.difference is not None and abs(r.difference) > OUTLIER]
    by_page: dict[str, list[Row]] = {}
    for r in outliers:
        by_page.setdefault(r.page.file, []).append(r)
    header = [
        "page",
        "run",
        "published figure",
        "published GiB",
        "predicted GiB",
        "difference",
        "published outcome",
        "verdict",
        "outcome predicted",
    ]
    unmodelled = "; ".join(sorted({f"`{p.file}`: {p.not_modelled}" for p in PAGES if p.not_modelled}))
    return (
        f"""# The device-level prediction against every published run it is compared with

Command: `python benchmarks/device_summary.py` (reads the committed pages below; estimates nothing, so it names no
machine: each page names the one its estimates ran on). The published figure is nvidia-smi's peak (`memory.used`
less its first sample; fms-acceleration's A100 runs) or the caching allocator's peak reserved (Answer.AI's runs);
the predicted one is the device-level peak (the allocator model's reserved bytes plus what lies outside the
allocator) or the peak reserved, to match. A verdict at the edge (it completes only with the typical bytes outside
the allocator) is `does not fit` (`docs/estimate.md`, the verdict on the device).

## Runs whose whole step ledgerspec models

{_summary(modelled)}

Outliers, more than {OUTLIER:.0%} off, each discussed on its page (under "What the figures say"), in a line here:

"""
        + "\n".join(
            f"- `{r.page.file}`, {r.run}, {r.difference:+.1%}: {REASONS.get(r.ledger, 'NOT EXPLAINED')}"
            for rs in by_page.values()
            for r in rs
            if r.difference is not None
        )
        + f"""

{CAPPED_AGREEMENT}

{chr(10).join(markdown_table(header, [r.cells() for r in modelled]))}

## Runs with kernels ledgerspec does not model

{unmodelled}. The estimate runs transformers' and PEFT's modules in their place, so these rows measure what the
unmodelled kernels are worth, not the allocator model (`liger-runs.md` discusses each).

{_summary(other)}

{chr(10).join(markdown_table(header, [r.cells() for r in other]))}
"""
    )


def main() -> None:
    publish(body(), RESULTS, partial=False)


if __name__ == "__main__":
    main()
