"""``ledgerspec shard --estimate``: a simulated FSDP2 step per rank (fake tensors, fake process group).

Expected figures come from :mod:`ledgerspec.derivations.shard.state` (checked against real shards in
``test_sharding_fsdp2.py``); the comparison with a real measured run is in ``test_measure_dist.py``. QLoRA is
the same tiny ledger with its decoder-layer linears in bitsandbytes nf4, ``bnb_4bit_quant_storage`` = bfloat16 (the
edits of ``test_measure_dist.QLORA_EDITS``); the fake 4-bit layers' FSDP2 layout is checked against what bitsandbytes
really packs and what the measured run (``measure --nproc``) shards.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from ledgerspec.derivations.shard.fsdp.simulate import rank_groups
from tests.support import TESTS, one_worker_each, run_cli

DATA = TESTS / "data" / "sharding"
LEDGER = "tiny-lora.ledger.yaml"
#: the LoRA ledger turned into QLoRA: bf16 base quantized to nf4 (double quant) with bf16 quant storage
QLORA_EDITS = [
    ("kind: LoRA", "kind: QLoRA"),
    (
        "  loaded_dtype: float32\n  quantized: false\n",
        "  loaded_dtype: bfloat16\n  quantized: true\n  quantization: {type: nf4, bits: 4, storage_dtype: "
        "bfloat16, double_quant: true, compute_dtype: bfloat16}\n",
    ),
]


def _desc(name: str, shape: tuple[int, ...]) -> S.ParamDesc:
    return S.ParamDesc(name, shape, "float32", True)


@pytest.mark.parametrize(
    ("shapes", "world", "groups"),
    [
        ([(8, 4), (6,)], 2, {0: [0, 1]}),  # even rows: every rank holds the same bytes
        ([(1001, 72), (6,)], 2, {0: [0], 1: [1]}),  # 501 + 500 rows
        ([(5, 72)], 3, {0: [0, 1], 2: [2]}),  # chunks of 2, 2, 1
        ([(2, 4)], 4, {0: [0, 1], 2: [2, 3]}),  # torch.chunk leaves ranks 2 and 3 empty
    ],
)
def test_ranks_with_the_same_rows_share_one_simulation(
    shapes: list[tuple[int, ...]], world: int, groups: dict[int, list[int]]
) -> None:
    assert rank_groups([_desc(f"p{i}", s) for i, s in enumerate(shapes)], world) == groups


def _copy(tmp: Path, ledger: str = LEDGER, edits: list[tuple[str, str]] | None = None) -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / ledger).read_text(encoding="utf-8")
    for old, new in edits or []:
        assert old in text, old
        text = text.replace(old, new)
    (tmp / ledger).write_text(text, encoding="utf-8")
    return tmp / ledger


@pytest.fixture(scope="module", params=one_worker_each("shard-estimate", ["lora", "qlora"]))
def estimated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ledger's ``shard --estimate`` (reshard_after_forward true), set up once per kind for every test that reads
    it: its per-rank result, the calculated FSDP2 plan, the single-device estimate's activations of the same ledger
    (``estimate`` reads no ``parallelism.reshard_after_forward``), and what every fake 4-bit forward of the simulation
    saw (:func:`test_qlora_forward_uses_the_gathered_packed_weight`; the spy only records, then calls the forward)."""
    pytest.importorskip("torch")
    from torch.distributed.tensor import DTensor

    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.qlora import fake_4bit_linear_class
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    edits = QLORA_EDITS if request.param == "qlora" else None
    doc = load(_copy(tmp_path_factory.mktemp("shard-estimate"), edits=edits))
    single = estimate(doc, target="cpu").activations
    cls = fake_4bit_linear_class()
    original = cls.forward
    seen: list[tuple[tuple[int, int], tuple[int, ...], bool, str]] = []

    def spy(self: Any, x: Any) -> Any:
        w = self.weight
        seen.append(((self.out_features, self.in_features), tuple(w.shape), isinstance(w, DTensor), str(w.dtype)))
        return original(self, x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "forward", spy)
        result = shard(doc, estimate=True, target="cpu", device_memory=1 << 30)
    plan = S.fsdp2(document_descriptors(doc), 2, "adamw_torch", reshard_after_forward=True)
    return {"result": result, "plan": plan, "doc": doc, "kind": request.param, "single": single, "seen": seen}


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_static_phases_are_the_calculated_shards(estimated: dict[str, Any]) -> None:
    for est, calc in zip(estimated["result"].estimate.ranks, estimated["plan"].ranks, strict=True):
        assert est.phases["after_load"] == calc.frozen_base
        assert est.phases["after_optimizer_init"] == calc.frozen_base + calc.adapter
        c = est.components
        assert (c["frozen_base"], c["adapter"], c["gradients"]) == (calc.frozen_base, calc.adapter, calc.gradients)
        assert c["optimizer"] == calc.optimizer + calc.optimizer_host  # target cpu: the step scalars count too


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_each_rank_is_simulated_with_its_own_rows(estimated: dict[str, Any]) -> None:
    r0, r1 = estimated["result"].estimate.ranks
    assert r0.simulated_as == 0 and r1.simulated_as == 1
    # rank 0 owns more rows (501 of 1001, 3 of 5 ...): more optimizer state, and more step temporaries on top
    assert (
        r0.phases["optimizer_step_peak"] - r1.phases["optimizer_step_peak"]
        >= (estimated["plan"].ranks[0].optimizer - estimated["plan"].ranks[1].optimizer)
        > 0
    )


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_compute_holds_gathered_units_and_unsharded_activations(estimated: dict[str, Any]) -> None:
    plan = estimated["plan"]
    for est, calc in zip(estimated["result"].estimate.ranks, plan.ranks, strict=True):
        assert est.phases["forward_peak"] >= calc.frozen_base + calc.adapter + calc.gathered + est.activations
        assert est.activations > 0
    assert plan.ranks[0].gathered < sum(plan.unit_unsharded.values())  # never the whole model gathered


@pytest.mark.slow
@pytest.mark.parametrize("reshard", ["true", "false", None])
def test_per_rank_activations_are_the_single_device_activations(
    estimated: dict[str, Any], tmp_path: Path, reshard: str | None
) -> None:
    """FSDP2 shards parameters, not activations: a rank's microbatch holds what one device's does. Gathered layers
    are freed by resizing their storage to 0 (no tensor op): a tracker that missed it counted every layer's
    weights as activations. QLoRA: the 4-bit layers save nothing but their (gathered, frozen) packed weight.
    The single-device estimate is the fixture's (``estimate`` reads no ``reshard_after_forward``: one trace per
    kind), and so is the ledger's own ``reshard_after_forward: true`` simulation; false and unset are simulated here."""
    from ledgerspec.derivations.shard.sharder import shard

    if reshard == "true":  # the fixture's ledger as it is
        ranks = estimated["result"].estimate.ranks
    else:
        path = _copy(tmp_path, edits=QLORA_EDITS if estimated["kind"] == "qlora" else None)
        text = path.read_text(encoding="utf-8")
        line = "  reshard_after_forward: true\n"
        assert line in text
        new = f"  reshard_after_forward: {reshard}\n" if reshard else ""
        path.write_text(text.replace(line, new), encoding="utf-8")
        ranks = shard(load(path), estimate=True, target="cpu").estimate.ranks
    assert [r.activations for r in ranks] == [estimated["single"]] * len(ranks)


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_written_as_calculated_with_method_and_fit(estimated: dict[str, Any]) -> None:
    block = estimated["doc"].plain["parallelism"]["x-per-rank"]["estimate"]
    assert block["source"] == "CALCULATED" and block["target"] == "cpu"
    assert "fake process group" in block["method"] and "NCCL" in block["method"]
    assert ("packed 4-bit weights sharded" in block["method"]) == (estimated["kind"] == "qlora")
    assert block["device_memory"] == 1 << 30 and block["fits"] is True
    peaks = [r["peak_allocated"]["value"] for r in block["ranks"]]
    assert block["worst_rank_peak"]["value"] == max(peaks)
    assert all(r["peak_allocated"]["source"] == "CALCULATED" and r["fits"] for r in block["ranks"])


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_does_not_fit_exits_1_and_still_writes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = _copy(tmp_path)
    code, out, err = run_cli("shard", path, "--estimate", "--device-memory", "1MiB")
    assert code == 1, err
    assert "2 x 1.00 MiB: does NOT fit on the device" in out
    block = load(path).plain["parallelism"]["x-per-rank"]["estimate"]
    assert block["fits"] is False and block["target"] == "cuda"
    # decided on the device (issue 23): the CUDA context and NCCL's buffers alone are more than 1 MiB, so the first
    # segment of the load cannot be had
    assert all(r["oom_phase"] == "after_load" for r in block["ranks"])
    assert all(r["verdict"]["decided_by"] == "allocated" for r in block["ranks"])


@pytest.mark.parametrize(
    ("ledger", "args", "message"),
    [
        (LEDGER, ["--device-memory", "24GiB"], "need --estimate"),
        (LEDGER, ["--estimate", "--device-memory", "lots"], "--device-memory"),
        ("tiny-qlora-uint8-storage.ledger.yaml", ["--estimate"], "bnb_4bit_quant_storage = bfloat16"),
    ],
)
def test_refusals_change_nothing(tmp_path: Path, ledger: str, args: list[str], message: str) -> None:
    path = _copy(tmp_path, ledger)
    before = path.read_bytes()
    code, _, err = run_cli("shard", path, *args)
    assert code != 0 and message in err and "Traceback" not in err
    assert path.read_bytes() == before


def test_direct_callers_of_the_estimate_are_refused_uint8_storage(tmp_path: Path) -> None:
    """``shard`` checks the storage first; ``estimate_per_rank`` guards itself too (never a wrong number)."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard.fsdp.simulate import estimate_per_rank
    from ledgerspec.errors import LedgerspecError

    doc = load(_copy(tmp_path, "tiny-qlora-uint8-storage.ledger.yaml"))
    with pytest.raises(LedgerspecError, match="bnb_4bit_quant_storage = bfloat16"):
        estimate_per_rank(doc, 2, [], target="cpu")


def _fsdp_layouts(doc: Any, workload_class: Any, rank: int) -> dict[str, tuple[Any, ...]]:
    """``{name: (dense (out, in), full size, padded shard size, local rows, dtype)}`` of every 4-bit weight FSDP2
    sharded on ``rank`` (``fully_shard`` on the meta device: the layout, no memory)."""
    import contextlib
    import warnings

    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.shard.fsdp.workload import fsdp_params, sharded_workload
    from ledgerspec.derivations.shard.simulation import fake_process_group
    from ledgerspec.derivations.stack.build import load_config

    spec = WorkloadSpec.from_document(doc)
    args = (spec.attention, "cpu") if workload_class.__name__ == "EstimateWorkload" else ()
    layouts: dict[str, tuple[Any, ...]] = {}
    with fake_process_group(rank, 2), warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        workload = sharded_workload(workload_class)(doc, spec, load_config(doc), *args)
        if hasattr(workload, "stack"):
            stack.enter_context(workload.stack)
        workload.prepare()
        names = {id(m): n for n, m in workload.model.named_modules()}
        for fp in fsdp_params(workload.model):
            module = fp._module_info.module
            if fp._module_info.param_name == "weight" and tuple(fp._orig_size)[1:] == (1,):
                layouts[f"{names[id(module)]}.weight"] = (
                    (module.out_features, module.in_features),
                    tuple(fp._orig_size),
                    tuple(fp.padded_sharded_param_size),
                    int(fp.sharded_size[0]),
                    fp.sharded_param.dtype,
                )
    return layouts


@pytest.mark.parametrize("rank", [0, 1])
def test_qlora_fake_packed_weights_are_sharded_as_the_measured_ones(tmp_path: Path, rank: int) -> None:
    """The estimate's Fake4bitLinear weights get FSDP2's layout of the real run's packed Params4bit (what ``measure
    --nproc`` shards) and of what bitsandbytes packs: full packed shape, padded shard, local rows, bf16."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf
    import torch

    from ledgerspec.derivations.engine.workload import Workload
    from ledgerspec.derivations.estimate.estimator import _estimate_workload_class

    doc = load(_copy(tmp_path, edits=QLORA_EDITS))
    fake = _fsdp_layouts(doc, _estimate_workload_class(), rank)
    real = _fsdp_layouts(doc, Workload, rank)
    assert len(fake) == 2 * 7 and fake == real  # q/k/v/o/gate/up/down of 2 layers
    for (out, inp), full, padded, rows, dtype in fake.values():
        data, _ = bnbf.quantize_4bit(
            torch.zeros(out, inp, dtype=torch.bfloat16),
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.bfloat16,
        )
        assert full == tuple(data.shape) and dtype == data.dtype == torch.bfloat16
        assert padded == (-(-full[0] // 2), 1)
        assert rows == S.chunk_rows(full[0], 2)[rank]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_qlora_forward_uses_the_gathered_packed_weight(estimated: dict[str, Any]) -> None:
    """Every fake 4-bit forward sees its layer's all-gathered packed weight (the whole packed shape, a plain tensor
    FSDP2 unsharded), never the rank's DTensor shard (the fixture's simulation, spied on); the LoRA ledger has no
    4-bit layer to see."""
    seen = estimated["seen"]
    if estimated["kind"] == "lora":
        assert seen == []
        return
    # k/v (36 x 72, grouped-query), q/o (72 x 72), gate/up (200 x 72), down (72 x 200); 2 ranks x 14 layers (x steps)
    assert {s[0] for s in seen} == {(36, 72), (72, 72), (200, 72), (72, 200)} and len(seen) >= 2 * 2 * 7
    for (out, inp), shape, is_shard, dtype in seen:
        assert shape == S.packed_4bit_shape(out * inp, "bfloat16") and not is_shard and dtype == "torch.bfloat16"


def test_an_unset_reshard_is_reported_as_fsdp2s_default(tmp_path: Path) -> None:
    """Unset, FSDP2 reshards the layers but keeps the root gathered: neither true nor false."""
    pytest.importorskip("torch")
    path = _copy(tmp_path)
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("  reshard_after_forward: true\n", ""), encoding="utf-8")
    code, out, err = run_cli("shard", path, "--nproc", "2")
    assert code == 0, err
    assert "reshard_after_forward=fsdp2 default" in out
    assert load(path).plain["parallelism"]["x-per-rank"]["reshard_after_forward"] == "fsdp2 default"
