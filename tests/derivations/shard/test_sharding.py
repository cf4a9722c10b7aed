"""Per-rank arithmetic (FSDP2 chunking and padding, ZeRO, QLoRA rule) and the ``ledgerspec shard`` command.

Expected figures come from torch / bitsandbytes objects built here or from hand arithmetic written out in the
test; the real sharded tensors under torchrun are compared in ``test_sharding_fsdp2.py``.
"""

from __future__ import annotations

import shutil
from math import prod
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, CliRunner

DATA = TESTS / "data" / "sharding"


@pytest.mark.parametrize("dim0", [1, 2, 5, 7, 36, 72, 200, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_rows_follow_torch_chunk(dim0: int, world: int) -> None:
    import torch

    chunks = list(torch.chunk(torch.empty(dim0, 3), world, dim=0))
    real = [c.shape[0] for c in chunks] + [0] * (world - len(chunks))
    assert S.chunk_rows(dim0, world) == real
    assert S.padded_rows(dim0, world) == chunks[0].shape[0]


def test_torch_chunk_can_leave_a_rank_empty() -> None:
    """5 rows on 4 ranks: torch.chunk makes 3 chunks of 2, 2, 1; FSDP2 gives rank 3 an empty shard."""
    assert S.chunk_rows(5, 4) == [2, 2, 1, 0]


def _p(
    name: str, shape: tuple[int, ...], trainable: bool, unit: str = S.ROOT, dtype: str = "float32", kind: str = "param"
) -> S.ParamDesc:
    return S.ParamDesc(name, shape, dtype, trainable, unit, kind)


def test_param_shard_pads_storage_not_optimizer_state() -> None:
    a = _p("lora_A", (5, 72), True)
    # 3 ranks: chunk 2 rows -> rows 2, 2, 1; every rank allocates 2 x 72 fp32 = 576 B
    shards = [S.param_shard(a, 3, r, "adamw_torch") for r in range(3)]
    assert [s.rows for s in shards] == [2, 2, 1]
    assert [s.storage for s in shards] == [576, 576, 576]
    assert [s.gradient for s in shards] == [576, 576, 576]
    assert [s.optimizer for s in shards] == [2 * 576, 2 * 576, 2 * 288]
    assert [s.optimizer_host for s in shards] == [4, 4, 4]
    frozen = S.param_shard(_p("w", (1001, 72), False, dtype="bfloat16"), 2, 1, "adamw_torch")
    assert (frozen.rows, frozen.storage, frozen.gradient, frozen.optimizer) == (500, 501 * 72 * 2, 0, 0)


def test_fused_adam_keeps_step_on_device() -> None:
    s = S.param_shard(_p("a", (4, 4), True), 2, 0, "adamw_torch_fused")
    assert (s.optimizer, s.optimizer_host) == (2 * 2 * 4 * 4 + 4, 0)


def test_fsdp2_gathered_units_follow_reshard_after_forward() -> None:
    params = [
        _p("emb", (10, 4), False),
        _p("l0.w", (6, 4), False, "l0"),
        _p("l1.w", (9, 4), False, "l1"),
        _p("l1.a", (3, 4), True, "l1"),
        _p("inv_freq", (2,), False, kind="buffer"),
    ]
    # unsharded bytes per unit on 2 ranks: W * ceil(d0/W) * row * 4
    root, l0, l1 = 2 * 5 * 4 * 4, 2 * 3 * 4 * 4, 2 * 5 * 4 * 4 + 2 * 2 * 4 * 4
    assert S.unit_unsharded_bytes(params, 2) == {S.ROOT: root, "l0": l0, "l1": l1}
    default = S.fsdp2(params, 2, "adamw_torch", reshard_after_forward=True)
    assert default.gathered_units == [S.ROOT, "l1"]
    assert default.ranks[0].gathered == root + l1
    kept = S.fsdp2(params, 2, "adamw_torch", reshard_after_forward=False)
    assert kept.ranks[1].gathered == root + l0 + l1
    # buffers are replicated: both ranks hold all 8 bytes of inv_freq on top of their frozen shards
    assert default.ranks[0].frozen_base == (5 + 3 + 5) * 4 * 4 + 8


def test_zero_stages_by_hand() -> None:
    # 4 ranks; frozen 1000 B, trainable 101 B, grads 101 B, optimizer 808 B, buffers 8 B
    z1, z2, z3 = (S.zero(s, 4, 1000, 101, 101, 808, replicated_bytes=8) for s in (1, 2, 3))
    assert (z1.parameters, z1.gradients, z1.optimizer) == (1109, 101, 202)
    assert (z2.parameters, z2.gradients, z2.optimizer) == (1109, 26, 202)
    assert (z3.parameters, z3.gradients, z3.optimizer) == (250 + 26 + 8, 26, 202)
    o2 = S.zero(2, 4, 1000, 101, 101, 808, offload=True)
    assert (o2.device_total, o2.host) == (1101, 202 + 26)
    o3 = S.zero(3, 4, 1000, 101, 101, 808, offload=True)
    assert (o3.device_total, o3.host) == (0, 202 + 26 + 250 + 26)
    # ZeRO-3's persistent parameters (at most stage3_param_persistence_threshold elements; here 200 B of the frozen
    # and 41 B of the trainable): whole on every device beside their partitions; under offload_param the partitions,
    # theirs too, are on the host (DeepSpeed 0.19.8 marks them persistent after partitioning them)
    p3 = S.zero(3, 4, 1000, 101, 101, 808, persistent_frozen=200, persistent_trainable=41)
    assert p3.parameters == 250 + 26 + 200 + 41
    po = S.zero(3, 4, 1000, 101, 101, 808, offload=True, persistent_frozen=200, persistent_trainable=41)
    assert (po.parameters, po.host) == (200 + 41, 202 + 26 + 250 + 26)
    assert po.to_device_per_micro_step == o3.to_device_per_micro_step  # an upper bound: every partition fetched
    # stages 1 and 2 keep whole parameters: persistence changes nothing there
    assert S.zero(2, 4, 1000, 101, 101, 808, persistent_frozen=200) == S.zero(2, 4, 1000, 101, 101, 808)


@pytest.mark.parametrize(
    ("storage", "loaded", "ok"),
    [
        ("bfloat16", "bfloat16", True),
        ("bf16", "bfloat16", True),
        ("float16", "fp16", True),
        ("uint8", "bfloat16", False),
        ("float32", "bfloat16", False),
        (None, "bfloat16", False),
    ],
)
def test_qlora_needs_quant_storage_equal_to_float_dtype(storage: str | None, loaded: str, ok: bool) -> None:
    why = S.qlora_shardable(storage, loaded)
    assert (why is None) == ok
    if not ok:
        assert why is not None and "bnb_4bit_quant_storage" in why


@pytest.mark.parametrize("storage", ["uint8", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(72, 72), (36, 72), (200, 72), (7, 9)])
def test_packed_4bit_shape_matches_bitsandbytes(storage: str, shape: tuple[int, int]) -> None:
    import torch
    from bitsandbytes.functional import quantize_4bit

    packed, _state = quantize_4bit(torch.randn(*shape), quant_type="nf4", quant_storage=getattr(torch, storage))
    assert S.packed_4bit_shape(prod(shape), storage) == tuple(packed.shape)
    assert str(packed.dtype).removeprefix("torch.") == storage


def test_fsdp2_rejects_optimizers_without_elementwise_state() -> None:
    with pytest.raises(ValueError, match="adamw_8bit"):
        S.fsdp2([_p("a", (4, 4), True)], 2, "adamw_8bit")


# -- the command -----------------------------------------------------------------------------------------


def _copy(tmp_path: Path, name: str) -> Path:
    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    shutil.copy(DATA / name, tmp_path / name)
    return tmp_path / name


@pytest.mark.slow
def test_shard_writes_calculated_per_rank_figures(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, "tiny-lora.ledger.yaml")
    code, out, err = cli("shard", path, "--nproc", "3", "--offline")
    assert code == 0, err
    assert "FSDP2 on 3 ranks" in out
    doc = load(path)
    ext = doc.get("parallelism", "x-per-rank").value
    assert ext["world_size"] == 3 and [r["rank"] for r in ext["ranks"]] == [0, 1, 2]
    for r in ext["ranks"]:
        for key in ("frozen_base", "adapter", "gradients", "optimizer", "gathered_parameters", "model_state"):
            assert r[key]["source"] == "CALCULATED" and r[key]["method"]
    # rank 2 owns fewer rows of the uneven LoRA A (5 rows: 2, 2, 1) and vocab (1001: 334, 334, 333)
    assert ext["ranks"][2]["optimizer"]["value"] < ext["ranks"][0]["optimizer"]["value"]
    assert set(ext["zero"]) == {"zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_offload"}
    assert "# kept" not in path.read_text()
    code, out, err = cli("validate", path)
    assert code == 0, out + err
    assert cli("shard", path, "--nproc", "3", "--check", "--offline")[0] == 0  # idempotent
    assert cli("shard", path, "--nproc", "2", "--check", "--offline")[0] == 1


@pytest.mark.parametrize(
    ("strategy", "code", "first"), [("ddp", 0, "declared: ddp (every rank holds"), ("zero-3", 1, "")]
)
def test_a_strategy_that_shards_nothing_is_said_and_an_unknown_one_refused(
    tmp_path: Path, cli: CliRunner, strategy: str, code: int, first: str
) -> None:
    """The table below is FSDP2's: for ddp it is a what-if, said first; an unknown name (once simulated as FSDP2,
    ZeRO-3's 1.86 GiB per rank read as 2.22 MiB) is LS017, before torch."""
    path = _copy(tmp_path, "tiny-lora.ledger.yaml")
    path.write_text(path.read_text("utf-8").replace("  strategy: fsdp2\n", f"  strategy: {strategy}\n"), "utf-8")
    got, out, err = cli("shard", path, "--nproc", "2", "--offline")
    assert got == code, err
    if first:
        assert out.splitlines()[0].startswith(first) and "FSDP2 on 2 ranks" in out.splitlines()[1]
    else:
        assert "unknown strategy 'zero-3': did you mean 'zero3'?" in err and out == ""


def test_measure_of_ranks_refuses_a_strategy_that_shards_nothing(tmp_path: Path, cli: CliRunner) -> None:
    """It ran FSDP2 ranks for ``strategy: ddp`` and wrote ``strategy: fsdp2`` over the declared one."""
    path = _copy(tmp_path, "tiny-lora.ledger.yaml")
    path.write_text(path.read_text("utf-8").replace("  strategy: fsdp2\n", "  strategy: ddp\n"), "utf-8")
    before = path.read_bytes()
    code, _, err = cli("measure", path, "--nproc", "2", "--device", "cpu")
    assert code == 2 and "the declared strategy ddp shards nothing" in err and "`ledgerspec measure FILE`" in err
    assert path.read_bytes() == before


@pytest.mark.slow
def test_shard_qlora_with_float_storage_shards_the_packed_weights(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, "tiny-qlora-bf16-storage.ledger.yaml")
    out_path = tmp_path / "out.yaml"
    code, _out, err = cli("shard", path, "-o", out_path, "--offline")
    assert code == 0, err
    ranks = load(out_path).get("parallelism", "x-per-rank").value["ranks"]
    assert len(ranks) == 2
    assert path.read_text() == (DATA / "tiny-qlora-bf16-storage.ledger.yaml").read_text()  # -o leaves FILE


def test_shard_qlora_with_uint8_storage_is_flagged(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, "tiny-qlora-uint8-storage.ledger.yaml")
    before = path.read_text()
    code, _out, err = cli("shard", path, "--offline")
    assert code == 1
    assert "bnb_4bit_quant_storage = bfloat16" in err and "storage_dtype" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    line = next(i for i, text in enumerate(before.splitlines(), 1) if "storage_dtype: uint8" in text)
    col = before.splitlines()[line - 1].index("storage_dtype") + 1
    assert err.startswith(f"{path}:{line}:{col}: shard: ")  # points at storage_dtype itself
    assert path.read_text() == before


def test_shard_without_rank_count_is_a_usage_error(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, "tiny-lora.ledger.yaml")
    path.write_text(path.read_text().replace("  gpu_count: 2\n", ""))
    code, _out, err = cli("shard", path, "--offline")
    assert code == 2 and "--nproc" in err


@pytest.mark.slow
def test_shard_with_an_8bit_optimizer_says_why(tmp_path: Path, cli: CliRunner) -> None:
    path = _copy(tmp_path, "tiny-lora.ledger.yaml")
    path.write_text(path.read_text().replace("name: adamw_torch", "name: adamw_8bit"))
    code, _out, err = cli("shard", path, "--offline")
    assert code == 1 and "optimizer" in err and "Traceback" not in err


def test_shard_sizes_an_intake_but_never_writes_into_it(tmp_path: Path) -> None:
    from tests.support import EXAMPLES, run_cli

    shutil.copytree(EXAMPLES, tmp_path / "examples")
    intake = tmp_path / "examples" / "llama-2-7b-lora.intake.yaml"
    before = intake.read_bytes()
    code, out, err = run_cli("shard", str(intake), "--nproc", "2")
    assert code == 0, err
    assert "FSDP2 on 2 ranks" in out and "an intake: nothing written" in err
    assert intake.read_bytes() == before
