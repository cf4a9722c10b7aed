"""FSDP1 per rank, calculated (:func:`ledgerspec.derivations.shard.state.fsdp1`) == the real flat parameters (issue 16).

Each case launches ``torchrun --nproc_per_node N`` on ``tests/truths/fsdp1_probe.py``: the tiny uneven Llama with
PEFT LoRA wrapped by ``FullyShardedDataParallel`` as transformers' Trainer + accelerate wrap it (PEFT's
``fsdp_auto_wrap_policy``, ``use_orig_params=True``, gloo on the CPU: FSDP1 runs there with torch 2.13), one AdamW
step, and every rank writes the flat parameters and state it really holds. The figures under test come from the
meta model's descriptors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, one_worker_each
from tests.support.per_rank import assert_rank_agrees, gloo_slack, measured, probe_ranks

DATA = TESTS / "data" / "sharding"
PROBE = TESTS / "truths" / "fsdp1_probe.py"

# (ledger, ranks, SHARD_GRAD_OP)
CASES = [
    ("tiny-lora.ledger.yaml", 2, False),  # fp32: alignment to 4 elements, vocab 1001 and LoRA rank 5 uneven
    ("tiny-lora-bf16-r2.ledger.yaml", 3, True),  # bf16 base + fp32 LoRA r=2: one dtype per flat parameter
    ("tiny-lora-mp.ledger.yaml", 2, False),  # MixedPrecision(param_dtype=bf16): alignment by the compute dtype
    # full fine-tuning (issue 26): accelerate's transformer-based wrap, every flat parameter trainable
    ("tiny-full-bf16.ledger.yaml", 3, False),
]


def test_flat_parameter_layout_by_hand() -> None:
    """Alignment to 16 bytes of the compute dtype before each parameter, then padding to the world size."""
    descs = [
        S.ParamDesc("a", (3, 3), "float32", False, "u"),  # 9 elements at 0
        S.ParamDesc("b", (5,), "float32", False, "u"),  # 3 padding, then at 12 (a multiple of 16 / 4)
        S.ParamDesc("c", (2, 3), "bfloat16", True, "v"),
    ]
    units = S.flat_units(descs, 3)
    assert [start for _, start in units["u"].offsets] == [0, 12]
    assert units["u"].numel == 18 and units["u"].shard_numel == 6  # 17 rounded up to a multiple of 3
    assert units["v"].numel == 6
    assert S.flat_units(descs, 3, use_orig_params=False)["u"].numel == 15  # no alignment: 14 -> 15
    assert S.flat_units(descs, 3, param_dtype="bfloat16")["u"].offsets[1][1] == 16  # 8-element alignment


def test_one_dtype_per_flat_parameter() -> None:
    descs = [S.ParamDesc("a", (4,), "float32", True, "u"), S.ParamDesc("b", (4,), "bfloat16", False, "u")]
    with pytest.raises(ValueError, match="uniform dtype"):
        S.flat_units(descs, 2)


@pytest.fixture(
    scope="module",
    params=one_worker_each("fsdp1", CASES, [f"{c[0]}-{c[1]}ranks{'-shard_grad_op' if c[2] else ''}" for c in CASES]),
)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import mixed_precision

    ledger, nproc, shard_grad_op = request.param
    flags = ["--shard-grad-op"] if shard_grad_op else []
    ranks = probe_ranks(PROBE, nproc, DATA / ledger, tmp_path_factory.mktemp("fsdp1"), *flags)
    doc = load(DATA / ledger)
    mp = mixed_precision(doc)
    descs = document_descriptors(doc)
    if doc.get("method", "kind").text() != "full":  # PEFT's wrap policy; full: decoder layers + root
        descs = S.peft_fsdp1_units(descs)
    plan = S.fsdp1(
        descs, nproc, "adamw_torch", reshard_after_forward=not shard_grad_op, param_dtype=mp.param_dtype if mp else None
    )
    return {"ranks": ranks, "plan": plan, "world": nproc}


@pytest.mark.slow
def test_the_units_and_their_flat_parameters_exact(case: dict[str, Any]) -> None:
    plan: S.Fsdp1Plan = case["plan"]
    for real in case["ranks"]:
        got = {u["unit"]: u for u in real["units"]}
        assert set(got) == set(plan.units)
        for name, unit in plan.units.items():
            assert got[name]["numel"] == unit.numel, name
            assert got[name]["local_numel"] == unit.shard_numel, name
            assert got[name]["dtype"] == unit.dtype and got[name]["requires_grad"] == unit.trainable, name


@pytest.mark.slow
def test_rank_totals_exact(case: dict[str, Any]) -> None:
    for real, calc in zip(case["ranks"], case["plan"].ranks, strict=True):
        units = real["units"]
        frozen = sum(u["local_bytes"] for u in units if not u["requires_grad"]) + real["buffers_bytes"]
        adapter = sum(u["local_bytes"] for u in units if u["requires_grad"])
        grads = sum(u["grad_bytes"] for u in units)
        state = real["optimizer_state"].values()
        moments = sum(v for s in state for k, v in s.items() if k != "step")
        steps = sum(s.get("step", 0) for s in state)
        assert (calc.frozen_base, calc.adapter, calc.gradients, calc.optimizer, calc.optimizer_host) == (
            frozen,
            adapter,
            grads,
            moments,
            steps,
        ), f"rank {real['rank']}"


@pytest.mark.slow
def test_gathered_parameters_exact(case: dict[str, Any]) -> None:
    plan: S.Fsdp1Plan = case["plan"]
    for real, calc in zip(case["ranks"], plan.ranks, strict=True):
        if plan.reshard_after_forward:  # the root + the layer, when a decoder layer starts
            assert calc.gathered == real["gathered_at_layer_forward_max"]
        else:  # SHARD_GRAD_OP: every unit still gathered when the forward returns
            assert calc.gathered == real["gathered_after_forward"] == sum(plan.unit_unsharded.values())


def _fsdp1_ledger(tmp: Path) -> Path:
    import shutil

    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora.ledger.yaml").read_text(encoding="utf-8")
    assert "  strategy: fsdp2\n" in text
    path = tmp / "fsdp1.ledger.yaml"
    path.write_text(text.replace("  strategy: fsdp2\n", "  strategy: fsdp1\n"), encoding="utf-8")
    return path


def test_shard_writes_the_fsdp1_state(tmp_path: Path) -> None:
    """``parallelism.strategy: fsdp1``: ``shard`` writes the FSDP1 plan (checked against real runs above), not FSDP2's:
    LoRA A with 5 rows on 2 ranks is padded to 3 rows by FSDP2 but shares a flat parameter of 360 elements evenly
    under FSDP1, so the adapter shards differ."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard.model import document_descriptors
    from tests.support import run_cli

    path = _fsdp1_ledger(tmp_path)
    code, out, err = run_cli("shard", path)
    assert code == 0, err
    assert out.startswith("FSDP1 on 2 ranks")
    ext = load(path).plain["parallelism"]["x-per-rank"]
    assert ext["strategy"].startswith("fsdp1") and "FULL_SHARD" in ext["strategy"]
    descs = document_descriptors(load(path))
    calc = S.fsdp1(S.peft_fsdp1_units(descs), 2)
    fsdp2 = S.fsdp2(descs, 2)
    for row, rs, r2 in zip(ext["ranks"], calc.ranks, fsdp2.ranks, strict=True):
        assert row["adapter"]["value"] == rs.adapter != r2.adapter
        assert row["optimizer"]["value"] == rs.optimizer
        assert row["gathered_parameters"]["value"] == rs.gathered


#: tiny-lora-measure.ledger.yaml turned into FSDP1 runs: FULL_SHARD (with and without checkpointing: the
#: recomputation re-gathers each layer in backward), SHARD_GRAD_OP, accelerate's bf16
#: (MixedPrecision(bf16, bf16) over a bf16 base with fp32 adapters, the Trainer's loop under autocast)
MEASURED = {
    "full_shard": [("  strategy: fsdp2\n", "  strategy: fsdp1\n")],
    "full_shard-checkpointing": [
        ("  strategy: fsdp2\n", "  strategy: fsdp1\n"),
        ("  gradient_checkpointing: false\n", "  gradient_checkpointing: true\n  checkpointing_kind: non-reentrant\n"),
    ],
    "shard_grad_op": [
        ("  strategy: fsdp2\n", "  strategy: fsdp1\n"),
        ("  reshard_after_forward: true\n", "  reshard_after_forward: false\n"),
    ],
    # the options a user's accelerate config sets (absent: the Trainer's defaults, no prefetch)
    "backward_pre-forward_prefetch": [
        ("  strategy: fsdp2\n", "  strategy: fsdp1\n  backward_prefetch: BACKWARD_PRE\n  forward_prefetch: true\n"),
    ],
    "use_orig_params-false": [("  strategy: fsdp2\n", "  strategy: fsdp1\n  use_orig_params: false\n")],
    # full fine-tuning (issue 26): accelerate's transformer-based wrap, every flat parameter trained
    "full-fine-tuning": [
        ("  strategy: fsdp2\n", "  strategy: fsdp1\n"),
        (
            "  kind: LoRA\n  rank: 5\n  alpha: 10\n  dropout: 0.0\n"
            "  target_modules: [q_proj, k_proj, v_proj, o_proj, up_proj, down_proj]\n  bias: none\n",
            "  kind: full\n",
        ),
        ("adapter:\n  dtype: float32\n", ""),
    ],
    # accelerate's own bf16 policy for FSDP1 (set_mixed_precision: param, reduce and buffer dtype bf16)
    "accelerate-bf16-policy": [
        (
            "  strategy: fsdp2\n",
            "  strategy: fsdp1\n  mixed_precision_policy: {param_dtype: bfloat16, reduce_dtype: bfloat16, "
            "buffer_dtype: bfloat16}\n",
        ),
        ("  loaded_dtype: float32\n", "  loaded_dtype: bfloat16\n"),
        (
            "optimizer:\n  name: adamw_torch\n",
            "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: bf16\n",
        ),
    ],
    "accelerate-bf16": [
        ("  strategy: fsdp2\n", "  strategy: fsdp1\n  mixed_precision_policy: {param_dtype: bfloat16}\n"),
        ("  loaded_dtype: float32\n", "  loaded_dtype: bfloat16\n"),
        (
            "optimizer:\n  name: adamw_torch\n",
            "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: bf16\n",
        ),
    ],
}


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_backward_prefetch_keeps_one_more_unit_gathered_in_backward(tmp_path: Path) -> None:
    """``backward_prefetch: backward_pre`` all-gathers the next unit before the current one's gradients: the simulated
    backward peak is one decoder-layer unit (the calculated unsharded flat parameter) above no prefetch, the
    forward peak unchanged."""
    pytest.importorskip("peft")
    import shutil

    from ledgerspec import resolve
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    peaks = {}
    for word in ("no_prefetch", "backward_pre"):
        path = tmp_path / f"{word}.ledger.yaml"
        path.write_text(
            text.replace("  strategy: fsdp2\n", f"  strategy: fsdp1\n  backward_prefetch: {word}\n"), encoding="utf-8"
        )
        doc = load(path)
        resolve(doc, offline=True)
        est = shard(doc, nproc=2, estimate=True, target="cpu").estimate
        assert est is not None
        peaks[word] = est.ranks[0].phases
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 2)
    unit = max(v for k, v in plan.unit_unsharded.items() if k != S.ROOT)
    assert peaks["backward_pre"]["forward_peak"] == peaks["no_prefetch"]["forward_peak"]
    assert peaks["backward_pre"]["backward_peak"] - peaks["no_prefetch"]["backward_peak"] == unit


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MEASURED))
def test_simulated_ranks_agree_with_the_measured_fsdp1_run(tmp_path: Path, kind: str) -> None:
    """``measure --nproc 2`` (a real FSDP1 run per rank: torchrun, gloo) against ``shard --estimate`` (FSDP1 under fake
    tensors and a fake process group) and the calculated state. The model-state phases and components agree to the
    byte; the compute phases are a lower bound at most the two largest gathered units under the measurement, as for
    FSDP2 (gloo's collectives run on their own thread: :func:`tests.support.per_rank.gloo_slack`).
    Observed alone on the machine: every phase of both ranks to the byte in every case. Simulated steady-state
    peaks (the Trainer's default, no backward prefetch): full_shard 2,678,196 B (BACKWARD_PRE: 2,913,780 B, one
    more unit), 1,996,724 B with checkpointing, shard_grad_op 3,191,284 B, accelerate bf16 1,849,484 B (with
    accelerate's whole policy, buffer_dtype bf16 too: 1,849,448 B, the rotary inv_freq buffer cast to bf16 at the
    first forward, 36 B less in the measured and simulated frozen base alike)."""
    pytest.importorskip("peft")
    import shutil

    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import mixed_precision
    from ledgerspec.derivations.shard.sharder import shard

    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    for old, new in MEASURED[kind]:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "fsdp1.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    doc = measured(path, 2)
    assert doc.plain["parallelism"]["strategy"] == "fsdp1"
    mp = mixed_precision(doc)
    descs = document_descriptors(doc)
    plan = S.fsdp1(
        descs if kind == "full-fine-tuning" else S.peft_fsdp1_units(descs),
        2,
        reshard_after_forward=kind != "shard_grad_op",
        param_dtype=mp.param_dtype if mp else None,
        use_orig_params=kind != "use_orig_params-false",
        buffer_dtype=mp.buffer_dtype if mp else None,
    )
    slack = gloo_slack(plan.unit_unsharded)
    estimated = shard(load(path), estimate=True, target="cpu").estimate
    assert estimated is not None
    for real, est, calc in zip(doc.plain["x-measure-per-rank"]["ranks"], estimated.ranks, plan.ranks, strict=True):
        assert_rank_agrees(real, est, calc, slack)


NO_SHARD = [
    ("  strategy: fsdp2\n", "  strategy: fsdp1\n"),
    (
        "  parameter_placement: sharded\n  gradient_placement: sharded\n  optimizer_placement: sharded\n"
        "  reshard_after_forward: true\n",
        "  parameter_placement: replicated\n  gradient_placement: replicated\n  optimizer_placement: replicated\n",
    ),
]


#: NO_SHARD variants beyond the plain one: a MixedPrecision policy in another dtype than the stored one (FSDP1 makes
#: each unit's low-precision copy at its forward and frees it after, the root's too: nothing is kept into backward)
NO_SHARD_VARIANTS = {
    "plain": [],
    "mixed-precision": [
        (
            "  strategy: fsdp1\n",
            "  strategy: fsdp1\n  mixed_precision_policy: {param_dtype: bfloat16, reduce_dtype: bfloat16}\n",
        ),
        (
            "optimizer:\n  name: adamw_torch\n",
            "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: bf16\n",
        ),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(NO_SHARD_VARIANTS))
def test_no_shard_ranks_agree_with_the_measured_fsdp1_run(tmp_path: Path, variant: str) -> None:
    """FSDP1's NO_SHARD (``parameter_placement: replicated``, Answer.AI's ``--sharding_strategy ddp``): ``measure
    --nproc 2`` runs real ``FullyShardedDataParallel(sharding_strategy=NO_SHARD)`` on two gloo ranks; ``shard
    --estimate`` simulates one rank of a group of one (FSDP1 runs NO_SHARD there). Each measured rank holds what
    the simulated rank holds: the model-state phases to the byte, every flat parameter whole on both ranks (the
    calculated state on one rank), nothing gathered, and the measurement keeps the placements replicated."""
    pytest.importorskip("peft")
    import shutil

    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import mixed_precision
    from ledgerspec.derivations.shard.sharder import shard

    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    for old, new in NO_SHARD + NO_SHARD_VARIANTS[variant]:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "no_shard.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    doc = measured(path, 2)
    assert {k: doc.plain["parallelism"][k] for k in ("strategy", "parameter_placement", "optimizer_placement")} == {
        "strategy": "fsdp1",
        "parameter_placement": "replicated",
        "optimizer_placement": "replicated",
    }
    mp = mixed_precision(doc)
    param_dtype = mp.param_dtype if mp else None
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 1, param_dtype=param_dtype)
    whole = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 2, param_dtype=param_dtype)
    assert plan.ranks[0].frozen_base > whole.ranks[0].frozen_base
    assert (plan.ranks[0].gathered == 0) == (mp is None)  # only a copy in another dtype is made
    result = shard(load(path), estimate=True, target="cpu")
    estimated = result.estimate
    assert estimated is not None and len(estimated.ranks) == 1 and estimated.world_size == 2
    assert "no_shard" in result.extension and "NO_SHARD" in result.extension["strategy"]
    real_ranks = doc.plain["x-measure-per-rank"]["ranks"]
    assert len(real_ranks) == 2
    for real in real_ranks:  # no all-gather, an all-reduce in place: no collective buffer gloo could hold (slack 0)
        assert_rank_agrees(real, estimated.ranks[0], plan.ranks[0], 0)


@pytest.mark.parametrize(
    ("line", "message", "exit_code"),
    [
        ("  backward_prefetch: sometimes\n", "backward_prefetch 'sometimes' is not one of", 2),
        ("  use_orig_params: maybe\n", "expected a switch", 1),  # the schema's finding, as for any switch
    ],
)
def test_a_bad_fsdp1_option_is_one_line_at_its_place(tmp_path: Path, line: str, message: str, exit_code: int) -> None:
    pytest.importorskip("torch")
    from tests.support import run_cli

    path = _fsdp1_ledger(tmp_path)
    text = path.read_text(encoding="utf-8").replace("  strategy: fsdp1\n", "  strategy: fsdp1\n" + line)
    path.write_text(text, encoding="utf-8")
    before = path.read_bytes()
    code, _, err = run_cli("shard", path)
    at = text.splitlines().index(line.rstrip("\n")) + 1
    assert code == exit_code and f"{path.name}:{at}:" in err and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and path.read_bytes() == before


def test_the_fsdp1_storage_check_replacements_were_read_in_the_installed_torch() -> None:
    """The simulation replaces three private FSDP1 functions for fake tensors
    (:mod:`ledgerspec.derivations.shard.fsdp.storage_checks`); they are the ones the replacements were written against
    only on the torch release recorded there. Pinned: a torch upgrade fails here until the patches are re-checked."""
    torch = pytest.importorskip("torch")
    from ledgerspec.derivations.shard.fsdp.storage_checks import CHECKED, unchecked_function

    installed = torch.__version__.split("+")[0]
    assert installed in CHECKED, (
        f"torch {installed} is installed; FSDP1's storage-check replacements were read in torch {', '.join(CHECKED)}. "
        "Re-check the patches: read the functions of REPLACED in ledgerspec/derivations/shard/fsdp/storage_checks.py "
        "again, adapt fake_storage_checks to them, and record this release's digests in CHECKED"
    )
    assert unchecked_function() is None


def _other(*args: Any) -> bool:
    """Not the function FSDP1 has (a planted change of a replaced one)."""
    return True


def test_a_changed_fsdp1_function_is_never_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entering the replacements on a torch whose function differs refuses before anything is replaced."""
    torch = pytest.importorskip("torch")
    import torch.distributed.fsdp._flat_param as flat_param

    from ledgerspec.derivations.shard.fsdp.storage_checks import fake_storage_checks
    from ledgerspec.errors import LedgerspecError

    monkeypatch.setattr(flat_param, "_same_storage", _other)
    with pytest.raises(LedgerspecError) as info, fake_storage_checks():
        pytest.fail("the replacements were entered")
    assert f"torch {torch.__version__}'s torch.distributed.fsdp._flat_param._same_storage is not" in info.value.message
    assert flat_param._same_storage is _other and info.value.exit_code == 2


def test_a_changed_fsdp1_function_makes_the_simulation_refuse_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shard --estimate`` of an FSDP1 ledger on a torch whose replaced function changed: one line (exit 2) naming the
    installed torch and the function, with the way out; no traceback, the ledger untouched."""
    torch = pytest.importorskip("torch")
    import torch.distributed.fsdp._flat_param as flat_param

    from tests.support import run_cli

    monkeypatch.setattr(flat_param, "_data_ptr_allocated", _other)  # the last of the three: each one is checked
    path = _fsdp1_ledger(tmp_path)
    before = path.read_bytes()
    code, out, err = run_cli("shard", path, "--estimate", "--target", "cpu")
    assert code == 2 and out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"torch {torch.__version__}'s torch.distributed.fsdp._flat_param._data_ptr_allocated is not" in err, err
    assert "FSDP1 simulation was checked against torch 2.13.0" in err and "ledgerspec measure --nproc" in err, err
    assert path.read_bytes() == before


@pytest.mark.slow
def test_hybrid_shard_on_four_ranks_holds_what_full_shard_holds_on_two(tmp_path: Path) -> None:
    """``shard_group_size: 2`` on 4 ranks: a real FSDP1 ``HYBRID_SHARD`` run (a (replicate=2, shard=2) device mesh,
    torchrun, gloo) per rank against the simulation, which runs the 2-rank ``FULL_SHARD`` step of one shard group:
    model-state phases and components to the byte on every rank (rank r as rank r mod 2), compute phases within the
    gloo-thread tolerance of the other measured tests."""
    pytest.importorskip("peft")
    import shutil

    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    text = text.replace("  strategy: fsdp2\n", "  strategy: fsdp1\n  shard_group_size: 2\n")
    path = tmp_path / "hybrid.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    doc = measured(path, 4)
    real = doc.plain["x-measure-per-rank"]["ranks"]
    assert len(real) == 4
    estimated = shard(load(path), nproc=4, estimate=True, target="cpu")
    assert estimated.estimate is not None and "HYBRID_SHARD" in estimated.extension["hybrid"]
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 2)
    slack = gloo_slack(plan.unit_unsharded)
    for r in real:
        group = r["rank"] % 2
        assert_rank_agrees(r, estimated.estimate.ranks[group], plan.ranks[group], slack, components=False)
