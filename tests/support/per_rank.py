"""Per-rank comparisons of a real ``measure --nproc`` run with ``shard --estimate`` and the calculated state (the
FSDP1 tests: plain, QLoRA, hybrid), and the one launcher of the ground-truth probes as ranks
(:func:`run_probe`: ``tests/truths/sharding_probe.py``, ``fsdp1_probe.py``, ``fsdp1_mixed_precision_probe.py``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document, load


def run_probe(probe: Path, nproc: int, *args: str | os.PathLike[str], timeout: int = 180) -> None:
    """``PROBE ARGS...`` as NPROC ranks, started as ``torchrun --nproc_per_node NPROC`` starts them (gloo on the CPU,
    one thread per rank, the Hub offline; :func:`ledgerspec.derivations.measure.launch.run_ranks`, forked from a
    preloaded server in the test session): a ground truth run per rank; the test fails with the end of its stderr
    when a rank fails."""
    from ledgerspec.derivations.measure import launch
    from ledgerspec.derivations.measure.dist import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code, stderr = launch.run_ranks([str(probe), *map(str, args)], nproc, env, free_port(), timeout)
    assert code == 0, stderr[-3000:]


def probe_ranks(
    probe: Path, nproc: int, source: Path, out: Path, *options: str | os.PathLike[str], timeout: int = 180
) -> list[Any]:
    """:func:`run_probe` of a probe run as ``PROBE SOURCE OUT [OPTIONS]`` that writes what each rank holds to
    ``OUT/rank{r}.json``: the ranks' reports, in rank order."""
    run_probe(probe, nproc, source, out, *options, timeout=timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def measured(path: Path, nproc: int) -> Document:
    """Resolve the ledger at ``path``, give it a target device and an activations figure (fixtures), write it back,
    run ``measure --nproc`` on it and return the measured document."""
    from ledgerspec import resolve
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render
    from tests.support import run_cli

    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture")
    atomic_write(path, render(doc.data, doc.text))
    code, _, err = run_cli("measure", path, "--nproc", str(nproc))
    assert code == 0, err
    return load(path)


def fp32_fsdp2_ledger(tmp: Path, name: str, training: str, *replaced: tuple[str, str]) -> Path:
    """``tests/data/sharding/tiny-lora-mp.ledger.yaml`` (the tiny Llama, LoRA r=5, FSDP2 on 2 ranks) without its
    mixed-precision policy, the ``training`` section appended and each ``(old, new)`` of ``replaced`` applied (each
    must be there), written as ``tmp/NAME.ledger.yaml`` beside a copy of the tiny model."""
    from tests.support import TESTS

    data = TESTS / "data" / "sharding"
    shutil.copytree(data / "tiny", tmp / "tiny", dirs_exist_ok=True)
    text = (data / "tiny-lora-mp.ledger.yaml").read_text(encoding="utf-8")
    policy = "  mixed_precision_policy:\n    param_dtype: bfloat16\n    reduce_dtype: float32\n"
    for old, new in ((policy, ""), *replaced):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / f"{name}.ledger.yaml"
    path.write_text(text + training, encoding="utf-8")
    return path


def fsdp2_ranks_agree(path: Path, nproc: int = 2) -> tuple[list[dict[str, Any]], Any]:
    """``measure --nproc`` of the FSDP2 ledger at ``path`` against ``shard --estimate --target cpu`` of it, rank by
    rank (:func:`assert_rank_agrees` with :func:`gloo_slack` of the calculated FSDP2 plan): the measured ranks and
    the estimate."""
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    doc = measured(path, nproc)
    real = doc.plain["x-measure-per-rank"]["ranks"]
    assert len(real) == nproc
    estimated = shard(load(path), nproc=nproc, estimate=True, target="cpu").estimate
    assert estimated is not None
    plan = S.fsdp2(document_descriptors(doc), nproc, "adamw_torch")
    slack = gloo_slack(plan.unit_unsharded)
    for r in real:
        assert_rank_agrees(r, estimated.ranks[r["rank"]], plan.ranks[r["rank"]], slack)
    return real, estimated


def gloo_slack(unit_unsharded: Mapping[str, int]) -> int:
    """How much more a real gloo rank may hold at a compute-phase peak than the simulation: the two largest gathered
    units (the root's included), ``sum`` of the two largest of ``unit_unsharded``.

    gloo runs each collective on its own thread, and its work object keeps the collective's tensors (an all-gather's
    output buffer, a reduce-scatter's input) until that thread lets go of it, after the rank has moved on; the fake
    process group of the simulation completes at once. On a busy machine that moves a measured peak up by the
    buffers of the collectives still held. Observed on the tiny fp32 model (layer unit 258,784 B, root 577,440 B):
    0 B alone; under load 65,448 B (a backward peak moved by 516 B of activations and 64,932 B of temporaries:
    not one tensor), one layer unit, one layer unit + 18,432 B, and once (CI, two jobs at a time on 2 cores)
    exactly the root's all-gather buffer (577,440 B; its bf16 twin, 288,720 B, on the bf16 model). Never less than
    the simulation, and never more than the two largest units' buffers."""
    sizes = sorted(unit_unsharded.values(), reverse=True)
    return sum(sizes[:2])


def assert_rank_agrees(real: dict[str, Any], est: Any, calc: Any, slack: int, components: bool = True) -> None:
    """One measured rank against its simulation and calculation: the model-state phases to the byte, the compute
    phases a lower bound at most ``slack`` (:func:`gloo_slack`) under the measurement, the measured components
    equal to the calculated state (and, with ``components``, to the simulated), and so is the calculated row
    ``measure`` writes beside them (``x-measure-per-rank``'s ``calculated``)."""
    for name, want in real["phases"].items():
        got = est.phases[name]
        if name.startswith("after_"):
            assert got == want, (real["rank"], name)
        else:
            assert 0 <= want - got <= slack, (real["rank"], name, want, got)
    m = real["measured"]
    if components:
        assert {k: m[k] for k in est.components} == est.components
    assert (m["frozen_base"], m["adapter"], m["gradients"], m["optimizer"]) == (
        calc.frozen_base,
        calc.adapter,
        calc.gradients,
        calc.optimizer + calc.optimizer_host,
    )
    written = real["calculated"]
    assert (
        written["frozen_base"],
        written["adapter"],
        written["gradients"],
        written["optimizer"] + written["optimizer_host"],
    ) == (m["frozen_base"], m["adapter"], m["gradients"], m["optimizer"]), (real["rank"], written)
