"""The committed comparison of peak reserved memory with Answer.AI's published 2-GPU runs
(`benchmarks/results/device-answerai.md`) re-derives: its published cells are the article's figures (transcribed here
apart from the script), its arithmetic and its summary hold, and a re-run of a row gives the committed cells."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script, outside_ci_sample
from tests.support.results import ledger_rows

RESULTS = REPO_ROOT / "benchmarks" / "results" / "device-answerai.md"
SCRIPT = REPO_ROOT / "benchmarks" / "device_vs_published_answerai.py"

#: benchmarks_03_2024.md at e877dda, "Case Study: A Dual 3090 'Basement Rig'": 2 x RTX 3090, FSDP;
#: (model, train type, context length, batch size) -> (Peak Memory (GiB), peak allocated GiB where the article gives it)
SOURCE: dict[tuple[Any, ...], tuple[float, float | None]] = {
    ("llama-2-7b", "qlora", 512, 1): (4.98, None),  # first table
    ("llama-2-7b", "qlora", 2048, 1): (5.21, None),
    ("llama-2-7b", "lora", 512, 1): (10.24, 8.28),  # second table; "the peak allocated memory is 8.28 GiB vs 9.16 GiB"
    ("llama-2-7b", "lora", 2048, 1): (10.22, 9.16),
    ("llama-2-7b", "qlora", 2048, 4): (11.22, None),  # third table, context length 2048
    ("llama-2-7b", "qlora", 2048, 10): (20.97, None),
    ("llama-2-7b", "lora", 2048, 4): (16.14, None),
    ("llama-2-7b", "lora", 2048, 6): (21.35, None),
    # the `--sharding_strategy ddp` table ("specifying `ddp` as the sharding strategy"): FSDP1 NO_SHARD
    ("llama-2-7b", "qlora", 2048, 8, "ddp"): (20.94, None),
    ("llama-2-7b", "lora", 2048, 4, "ddp"): (22.04, None),
    ("yi-34b", "qlora", 2048, 2): (23.05, None),  # "What About CPU Offloading?": Yi 34B, CPU Offload False
    # --use_cpu_offload True: "Case Study: A Dual 4090 'Budget Workstation'", its Llama-2 7B table (CPU Offload True)
    ("llama-2-7b", "lora", 2048, 10, "offload"): (22.69, None),
    ("llama-2-7b", "qlora", 2048, 12, "offload"): (22.38, None),
    ("yi-34b", "qlora", 2048, 4, "offload"): (22.98, None),  # "What About CPU Offloading?": CPU Offload True
    ("llama-2-70b", "qlora", 2048, 2, "offload"): (14.92, None),  # "Llama 70B"
    # the dual 4090 case study's "Bonus: Mistral 7B" table (Mistral 7B v0.2 Base, QLoRA, CPU Offload True)
    ("mistral-7b-v0.2", "qlora", 2048, 12, "offload"): (22.54, None),
    ("mistral-7b-v0.2", "qlora", 24576, 1, "offload"): (22.54, None),
}
#: the shipped config each model's ledgers build (examples/configs/<folder>)
MODEL_IDS = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "yi-34b": "01-ai/Yi-34B",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "mistral-7b-v0.2": "mistral-community/Mistral-7B-v0.2",
}
#: the dual 4090 case study's rows (the others ran on the dual 3090)
ON_4090 = {
    ("llama-2-7b", "lora", 2048, 10, "offload"),
    ("llama-2-7b", "qlora", 2048, 12, "offload"),
    ("mistral-7b-v0.2", "qlora", 2048, 12, "offload"),
    ("mistral-7b-v0.2", "qlora", 24576, 1, "offload"),
}
#: published runs (all trained) the replay predicts not to fit: the page says so, with the figures
MISSES = {"aai-llama-2-7b-qlora-2gpu-2048-bs12-offload"}

pytestmark = pytest.mark.skipif(not RESULTS.exists(), reason="no committed results: run the benchmark")


def words(n: int) -> str:
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    words += " seventeen eighteen nineteen twenty"
    return words.split()[n]


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script(SCRIPT, "device_published_answerai_benchmark")


def _key(model: str, kind: str, length: int, batch: int, sharding: str = "") -> str:
    return f"aai-{model}-{kind}-2gpu-{length}-bs{batch}" + (f"-{sharding}" if sharding else "")


def test_every_published_run_has_its_ledger_and_row(bench: Any) -> None:
    keys = [_key(*k) for k in SOURCE]
    assert [r.key for r in bench.RUNS] == keys == list(ledger_rows(RESULTS))
    for source, key in zip(SOURCE, keys, strict=True):
        model, kind, length, batch, *sharding = source
        text = (bench.LEDGERS / f"{key}.ledger.yaml").read_text(encoding="utf-8")
        assert f"  model_id: {MODEL_IDS[model]}\n" in text, key
        assert f"  config_path: ../../examples/configs/{model}/config.json\n" in text, key
        assert f"  max_length: {length}\n" in text and f"  microbatch: {batch}\n" in text, key
        assert f"  kind: {'QLoRA' if kind == 'qlora' else 'LoRA'}\n" in text, key
        # train.py at 50efa1e: its defaults and the case study's flags (the ledgers' comments cite each)
        settings = [
            "  rank: 64\n",
            "  alpha: 16\n",
            "  dropout: 0.1\n",
            "  target_modules: [k_proj, q_proj, v_proj, up_proj, down_proj, gate_proj]\n",
            "  loaded_dtype: bfloat16\n",
            "adapter:\n  dtype: bfloat16\n",
            "  gradient_checkpointing: true\n  checkpointing_kind: reentrant\n",
            '  loop: custom\n  mixed_precision: "no"\n  max_grad_norm: 0\n',
            "  loss_item_each_step: true\n",
            "  gpu_count: 2\n  strategy: fsdp1\n",
            f"  cpu_offload: {'true' if sharding == ['offload'] else 'false'}\n"
            + ("" if sharding == ["ddp"] else "  reshard_after_forward: true\n")
            + "  use_orig_params: false\n",
            "  limit_all_gathers: true\n  backward_prefetch: backward_pre\n  sync_module_states: true\n",
            "  activation_checkpointing: true\n",
            f"target_device: {{name: NVIDIA GeForce RTX {'4090' if source in ON_4090 else '3090'}, memory: 24 GiB}}",
        ]
        if kind == "qlora":
            settings.append(
                "quantization: {type: nf4, bits: 4, double_quant: true, compute_dtype: bfloat16, storage_dtype: "
                "bfloat16}"
            )
        else:
            settings.append("  quantized: false\n")
        placement = "replicated" if sharding == ["ddp"] else "sharded"  # train.py's ddp: ShardingStrategy.NO_SHARD
        settings.append("".join(f"  {k}_placement: {placement}\n" for k in ("parameter", "gradient", "optimizer")))
        for setting in settings:
            assert setting in text, (key, setting)


def test_published_cells_are_the_source_figures() -> None:
    rows = ledger_rows(RESULTS)
    for source, (reserved, allocated) in SOURCE.items():
        cells = rows[_key(*source)]
        assert cells[5] == f"{reserved:.2f}"
        assert cells[2] == (f"{allocated:.2f}" if allocated else "-")


def test_the_arithmetic_and_the_summary() -> None:
    rows = ledger_rows(RESULTS)
    diffs, allocated = [], []
    for key, c in rows.items():
        diff = (float(c[6]) - float(c[5])) / float(c[5])
        assert abs(diff - float(c[7].rstrip("%")) / 100) <= 0.0005 + 0.006 / float(c[5]), key  # roundings
        diffs.append(diff)
        assert abs(float(c[6]) - float(c[3]) - float(c[8])) <= 0.011, key  # reserve above allocated
        if c[2] != "-":
            a = (float(c[3]) - float(c[2])) / float(c[2])
            assert abs(a - float(c[4].rstrip("%")) / 100) <= 0.0005 + 0.006 / float(c[2]), key
            allocated.append(float(c[4].rstrip("%")) / 100)
        # every published run trained: the replay says so but for the misses, which the page names with their figures
        assert c[9].startswith("does not fit" if key in MISSES else "fits"), key
    text = " ".join(RESULTS.read_text(encoding="utf-8").split())
    summary = (RESULTS.parent / "device-summary.md").read_text(encoding="utf-8")
    assert f"(median {statistics.median(float(c[7].rstrip('%')) / 100 for c in rows.values()):+.1%})." in text
    assert abs(statistics.median(diffs)) <= 0.05  # the bar, on the allocator's own figure
    assert "Peak allocated against the article's two figures: " + ", ".join(f"{x:+.1%}" for x in allocated) in text
    # the row at the card's limit is the one the text explains, with the table's figures
    # the rows more than 5 % off are the ones the text discusses, each with the table's figures
    limit = [c for c in rows.values() if abs(float(c[7].rstrip("%"))) > 5]
    assert limit and f"**The rows more than 5 % off** (the {words(len(limit))} of them): " in text
    for key, c in rows.items():
        if abs(float(c[7].rstrip("%"))) > 5:
            assert f"{c[0]}: the replay reserves {c[6]} GiB" in text, c[0]
            said = text.split(f"{c[0]}: the replay reserves {c[6]} GiB")[1].split(";")[0]
            assert ("runs out of memory" in said and "where the run trained" in said) == (key in MISSES), key
            if key in MISSES:  # a miss near the top: what decided it, and the setting the verdict names
                after = text.split(f"{c[0]}: the replay reserves {c[6]} GiB")[1].split(" GiB); ")[0]
                assert "decided by fragmentation" in after, key
                assert "the verdict names PYTORCH_CUDA_ALLOC_CONF=" in after, key
                # up to the request that fails, the replay reserves about the run's published peak (within the
                # issue's 5 %): the two part at the allocator's retry after freeing its cache
                before = text.split(f"{c[0]}: the replay reserves {c[6]} GiB")[1].split(" GiB, against the run's")[0]
                peak = float(before.rsplit("up to that request the replay reserves ", 1)[1])
                assert f"against the run's published peak reserved of {c[5]} GiB" in text, key
                assert abs(peak - float(c[5])) / float(c[5]) <= 0.05, (key, peak)
                # and how fragile the miss is: one block, given a segment of its own, lets the replay complete, with
                # a peak reserved within the 5 % of the run's (the summary page says so in a line)
                rest = text.split(f"{c[0]}: the replay reserves {c[6]} GiB")[1].split(". ")[0]
                assert "one block decides it: a " in rest, key
                done = float(rest.split("completes against the card, peak reserved ")[1].split(" GiB")[0])
                assert abs(done - float(c[5])) / float(c[5]) <= 0.05, (key, done)
                line = next(x for x in summary.splitlines() if x.startswith(f"- `device-answerai.md`, {c[0]}, "))
                size = rest.split("one block decides it: a ")[1].split(" MiB")[0]
                assert f"a {size} MiB float32 block" in line and f"(peak reserved {done:.2f} GiB, " in line, key


# one row re-estimated (a 7B LoRA FSDP1 step on two ranks, every layer traced, and its replays: about 25 s): the one
# with CPU offload, which takes the most of the simulation (the device's stream alone, the wrapping on the device); the
# other rows' cells are held by the arithmetic above and by the benchmark's own run (CI time: the 512-token row's
# re-estimate, 25 s more, was dropped at stop 56; CI skips this one too since stop 57: CONTRIBUTING.md)
@pytest.mark.slow
@outside_ci_sample("FSDP1 CPU offload: real runs in shard/test_offload_real.py, its device verdict in test_offload.py")
@pytest.mark.parametrize("key", ["aai-llama-2-7b-lora-2gpu-2048-bs10-offload"])
def test_a_row_re_estimated_gives_the_committed_cells(bench: Any, key: str) -> None:
    run = next(r for r in bench.RUNS if r.key == key)
    assert bench.estimate_run(run).cells() == ledger_rows(RESULTS)[run.key]


def test_the_pages_that_cite_this_table_cite_its_figures() -> None:
    """`docs/outside-allocator.md` and `device-fsdp.md` conclude from this table: their figures are its figures."""
    rows = ledger_rows(RESULTS)
    diffs = [float(c[7].rstrip("%")) for c in rows.values()]
    close = [abs(d) for d in diffs if abs(d) <= 5]
    rest = max(close)
    said = f"{words(len(close))} of {words(len(diffs))}"
    for page in (REPO_ROOT / "docs" / "outside-allocator.md", REPO_ROOT / "benchmarks" / "results" / "device-fsdp.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert f"{said}" in text and f"within {rest:.1f} %" in text, page.name
        assert f"median {statistics.median(diffs):+.1f} %" in text, page.name
