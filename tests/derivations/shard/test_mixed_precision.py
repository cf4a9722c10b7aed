"""FSDP2 mixed precision (``parallelism.mixed_precision_policy``): calculated, simulated, measured per rank (issue 16).

The ground truths: ``tests/truths/sharding_probe.py`` (torch's own ``fully_shard(mp_policy=MixedPrecisionPolicy(...))``
under torchrun, gloo; compared with the calculated state in ``test_sharding_fsdp2.py``: gathered units in
``param_dtype``, everything else in the parameters' dtype, to the byte) and ``measure --nproc 2`` (a real FSDP2
run per rank) against ``shard --estimate`` (the simulated one). Two policies: the classic one (fp32 shards,
``param_dtype=bfloat16``, ``reduce_dtype=float32``) and what accelerate 1.15 builds for ``mixed_precision: bf16``
(``MixedPrecisionPolicy(bf16, bf16)``, fp32 trainable parameters, autocast in the Trainer's forward).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, run_cli

DATA = TESTS / "data" / "sharding"
LEDGER = "tiny-lora-mp.ledger.yaml"
#: accelerate's `mixed_precision: bf16` under FSDP2: bf16 base, fp32 adapters, MixedPrecisionPolicy(bf16, bf16),
#: the Trainer's loop under autocast
ACCELERATE_BF16 = [
    ("  loaded_dtype: float32\n", "  loaded_dtype: bfloat16\n"),
    ("    reduce_dtype: float32\n", "    reduce_dtype: bfloat16\n"),
    (
        "optimizer:\n  name: adamw_torch\n",
        "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: bf16\n",
    ),
]
NO_POLICY = [("  mixed_precision_policy:\n    param_dtype: bfloat16\n    reduce_dtype: float32\n", "")]


def _copy(tmp: Path, edits: list[tuple[str, str]] | None = None, name: str = LEDGER) -> Path:
    if not (tmp / "tiny").exists():
        shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / LEDGER).read_text(encoding="utf-8")
    for old, new in edits or []:
        assert old in text, old
        text = text.replace(old, new)
    (tmp / name).write_text(text, encoding="utf-8")
    return tmp / name


def test_a_policy_dtype_must_be_floating(tmp_path: Path) -> None:
    path = _copy(tmp_path, [("    param_dtype: bfloat16\n", "    param_dtype: int8\n")])
    before = path.read_bytes()
    code, _, err = run_cli("shard", path)
    line = path.read_text(encoding="utf-8").splitlines().index("    param_dtype: int8") + 1
    assert code == 2, err
    assert f"{path.name}:{line}:" in err and "param_dtype must be a floating dtype" in err, err
    assert "Traceback" not in err and path.read_bytes() == before


def test_buffer_dtype_is_fsdp1s_only(tmp_path: Path) -> None:
    """FSDP2's ``MixedPrecisionPolicy`` has no ``buffer_dtype`` (torch ``_fully_shard/_fsdp_api.py``): declared under
    FSDP2 it is one line at its place, exit 2, the file untouched."""
    path = _copy(tmp_path, [("    reduce_dtype: float32\n", "    reduce_dtype: float32\n    buffer_dtype: bfloat16\n")])
    before = path.read_bytes()
    code, _, err = run_cli("shard", path)
    line = path.read_text(encoding="utf-8").splitlines().index("    buffer_dtype: bfloat16") + 1
    assert code == 2 and f"{path.name}:{line}:" in err and "buffer_dtype is FSDP1's" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and path.read_bytes() == before


def test_gathered_units_are_in_param_dtype(tmp_path: Path) -> None:
    """Every parameter of the ledger is float32: gathered in bfloat16 they take exactly half the bytes; the shards,
    gradients and optimizer state do not change (the probe's truth, ``test_sharding_fsdp2.py``)."""
    pytest.importorskip("torch")
    with_policy = _copy(tmp_path, name="with.ledger.yaml")
    without = _copy(tmp_path, NO_POLICY, name="without.ledger.yaml")
    for path in (with_policy, without):
        code, _, err = run_cli("shard", path)
        assert code == 0, err
    a = load(with_policy).plain["parallelism"]["x-per-rank"]
    b = load(without).plain["parallelism"]["x-per-rank"]
    assert a["mixed_precision_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert "mixed_precision_policy" not in b
    for ra, rb in zip(a["ranks"], b["ranks"], strict=True):
        assert 2 * ra["gathered_parameters"]["value"] == rb["gathered_parameters"]["value"] > 0
        assert "in bfloat16" in ra["gathered_parameters"]["method"]
        for key in ("frozen_base", "adapter", "gradients", "optimizer"):
            assert ra[key]["value"] == rb[key]["value"], key


def _resolved(tmp: Path, edits: list[tuple[str, str]] | None) -> Path:
    from ledgerspec import resolve
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render

    path = _copy(tmp, edits)
    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture")
    atomic_write(path, render(doc.data, doc.text))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("edits", [None, ACCELERATE_BF16], ids=["bf16-param-fp32-reduce", "accelerate-bf16"])
def test_simulated_ranks_agree_with_the_real_fsdp2_run(tmp_path: Path, edits: list[tuple[str, str]] | None) -> None:
    """``shard --estimate`` (fake tensors, fake process group) against ``measure --nproc 2`` (torchrun, gloo, the
    declared policy passed to ``fully_shard``): the model-state phases and components to the byte; the compute
    phases a lower bound at most three gathered layer units under the measurement. gloo runs collectives on its own
    thread: a prefetched unit's all-gather output and a finished unit's buffers can still be alive at the peak (see
    ``test_measure_dist.py``). Observed: alone on the machine, every phase of both ranks to the byte, both
    policies; in the full suite on the loaded 2-core machine, once, accelerate's bf16 steady state 288,720 B over
    the estimate on rank 1 (two bf16 layer units of 129,392 B + 29,936 B)."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import mixed_precision
    from ledgerspec.derivations.shard.sharder import shard

    path = _resolved(tmp_path, edits)
    code, _, err = run_cli("measure", path, "--nproc", "2")
    assert code == 0, err
    doc = load(path)
    mp = mixed_precision(doc)
    assert mp is not None
    plan = S.fsdp2(document_descriptors(doc), 2, "adamw_torch", param_dtype=mp.param_dtype)
    unit = max(v for k, v in plan.unit_unsharded.items() if k != S.ROOT)
    estimated = shard(load(path), estimate=True, target="cpu").estimate
    assert estimated is not None
    real_ranks: list[dict[str, Any]] = list(doc.plain["x-measure-per-rank"]["ranks"])
    for real, est in zip(real_ranks, estimated.ranks, strict=True):
        for name, want in real["phases"].items():
            got = est.phases[name]
            if name.startswith("after_"):
                assert got == want, (real["rank"], name)
            else:
                assert 0 <= want - got <= 3 * unit, (real["rank"], name, want, got)
        assert {k: real["measured"][k] for k in est.components} == est.components
    if edits is None:  # the policy is what the runs did: without it the layers compute on float32 gathered weights
        without = shard(load(_copy(tmp_path, NO_POLICY, name="nopolicy.ledger.yaml")), estimate=True, target="cpu")
        assert without.estimate is not None
        for a, b in zip(estimated.ranks, without.estimate.ranks, strict=True):
            assert a.phases["forward_peak"] < b.phases["forward_peak"]
