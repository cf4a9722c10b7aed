"""QLoRA under FSDP1 per rank (issue 16): PEFT's FSDP-QLoRA as transformers' Trainer + accelerate run it.

``FullyShardedDataParallel`` with PEFT's auto-wrap policy and ``use_orig_params``, bitsandbytes 4-bit weights stored
in the loaded float dtype (``bnb_4bit_quant_storage`` = bf16, "Use PEFT QLoRA and FSDP", PEFT
docs/source/accelerate/fsdp.md): each decoder layer's packed 4-bit weights are flattened with its norms into one bf16
flat parameter and sharded like it; the quantization constants stay on the modules, whole on every rank, where
bitsandbytes' ``Linear4bit.forward`` finds them for the gathered weight. The real run here is FSDP1 under torchrun
(gloo, 2 ranks) with real bitsandbytes 4-bit weights quantized on the CPU (bitsandbytes 0.50).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.shard import state as S
from tests.support import TESTS, run_cli
from tests.support.per_rank import assert_rank_agrees, gloo_slack, measured, probe_ranks

DATA = TESTS / "data" / "sharding"

QLORA = (
    "  loaded_dtype: float32\n  quantized: false\n",
    "  loaded_dtype: bfloat16\n  quantized: true\n  quantization: {type: nf4, bits: 4, storage_dtype: bfloat16, "
    "double_quant: true, compute_dtype: bfloat16}\n",
)


def _ledger(tmp: Path, source: str, storage: str = "bfloat16") -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / source).read_text(encoding="utf-8")
    for old, new in (("  strategy: fsdp2\n", "  strategy: fsdp1\n"), ("kind: LoRA", "kind: QLoRA"), QLORA):
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace("storage_dtype: bfloat16", f"storage_dtype: {storage}")
    path = tmp / "fsdp1-qlora.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shard_calculates_qlora_under_fsdp1(tmp_path: Path) -> None:
    """No longer refused: the packed bf16 4-bit weights join their layer's flat parameter (one dtype per unit)."""
    pytest.importorskip("bitsandbytes")
    from ledgerspec.derivations.shard.model import document_descriptors

    path = _ledger(tmp_path, "tiny-lora.ledger.yaml")
    code, out, err = run_cli("shard", path)
    assert code == 0, err
    assert out.startswith("FSDP1 on 2 ranks")
    ext = load(path).plain["parallelism"]["x-per-rank"]
    descs = document_descriptors(load(path))
    packed = [d for d in descs if d.kind == "param" and len(d.shape) == 2 and d.shape[1] == 1]
    assert packed and all(d.dtype == "bfloat16" for d in packed)  # (n + 1) // 4 x 1 in bf16: what bnb stores
    units = S.flat_units(S.peft_fsdp1_units(descs), 2)
    assert all(units[d.unit].dtype == "bfloat16" for d in packed)
    assert ext["ranks"][0]["frozen_base"]["value"] > 0


def test_qlora_under_fsdp1_with_uint8_storage_is_refused(tmp_path: Path) -> None:
    """FSDP1 flattens a unit into one dtype: uint8 packed weights next to bf16 norms cannot be (FSDP1: "Must flatten
    tensors with uniform dtype"); refused with the line of ``storage_dtype``, the ledger untouched."""
    path = _ledger(tmp_path, "tiny-lora.ledger.yaml", storage="uint8")
    before = path.read_bytes()
    code, _, err = run_cli("shard", path, "--estimate")
    assert code == 1 and "bnb_4bit_quant_storage = bfloat16" in err and "Traceback" not in err, err
    line = next(i for i, t in enumerate(before.decode().splitlines(), 1) if "storage_dtype: uint8" in t)
    assert f"{path.name}:{line}:" in err
    assert path.read_bytes() == before


def test_a_rank_models_the_declared_bitsandbytes_as_one_gpu_does(tmp_path: Path) -> None:
    """``software.bitsandbytes: 0.42.0``: a simulated rank keeps each 4-bit layer's input for backward, as versions
    before 0.43.2 did (``ctx.tensors = (A, B)``), by the bytes the one-GPU estimate keeps for it (that estimate is
    held to a real Trainer on the patched bitsandbytes in tests/derivations/engine/test_trainer_truth.py). Before,
    ``shard`` ran the installed side whatever the ledger declared: the two ranks below were the same to the byte."""
    pytest.importorskip("bitsandbytes")
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.estimate import estimate
    from ledgerspec.derivations.shard.sharder import shard

    path = _ledger(tmp_path, "tiny-lora.ledger.yaml")
    text = path.read_text(encoding="utf-8").replace("dropout: 0.0", "dropout: 0.1")
    rank, one = {}, {}
    for version in ("0.42.0", "0.50.0"):  # dropout: the layers' inputs are kept by nothing else
        doc = from_text(text.replace("identity:", f"software:\n  bitsandbytes: {version}\nidentity:"), str(path))
        est = shard(doc, estimate=True, target="cuda").estimate
        assert est is not None
        rank[version] = est.ranks[0].phases
        one[version] = estimate(doc, target="cuda").phases
    for phase in ("forward_peak", "backward_peak", "steady_state_peak"):
        kept = one["0.42.0"][phase] - one["0.50.0"][phase]
        assert kept > 0, phase
        assert rank["0.42.0"][phase] - rank["0.50.0"][phase] == kept, phase


@pytest.mark.slow
def test_simulated_fsdp1_qlora_ranks_agree_with_the_real_run(tmp_path: Path) -> None:
    """``measure --nproc 2`` (a real FSDP1 QLoRA run per rank: torchrun, gloo, bitsandbytes 4-bit weights quantized on
    the CPU, PEFT LoRA, one AdamW step) against ``shard --estimate --target cpu`` (FSDP1 under fake tensors and a fake
    process group, bitsandbytes' layers replaced by fake 4-bit layers holding the packed weight) and the calculated
    state. The model-state phases and components agree to the byte; compute phases are a lower bound by at most the
    two largest gathered units (gloo's collective thread, as for LoRA). Observed alone on the machine: every phase of
    both ranks to the byte (steady-state peak 1,959,242 B)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _ledger(tmp_path, "tiny-lora-measure.ledger.yaml")
    doc = measured(path, 2)
    assert doc.plain["parallelism"]["strategy"] == "fsdp1"
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 2)
    slack = gloo_slack(plan.unit_unsharded)
    estimated = shard(load(path), estimate=True, target="cpu").estimate
    assert estimated is not None and estimated.strategy == "fsdp1"
    assert "packed 4-bit weights" in estimated.method
    for real, est, calc in zip(doc.plain["x-measure-per-rank"]["ranks"], estimated.ranks, plan.ranks, strict=True):
        assert_rank_agrees(real, est, calc, slack)


@pytest.mark.slow
def test_calculated_state_equals_transformers_loaded_4bit_model_under_fsdp1(tmp_path: Path) -> None:
    """The independent truth: ``tests/truths/fsdp1_probe.py --pretrained`` has transformers load a tiny checkpoint with
    the ledger's ``BitsAndBytesConfig`` (bitsandbytes quantizing on the CPU), PEFT inject the LoRA, and FSDP1 wrap it
    as the Trainer does, under torchrun (gloo, 2 ranks); no ledgerspec code builds, quantizes or wraps the model. Every
    flat parameter's padded numel, local shard and dtype, and each rank's frozen (shards + buffers + the whole
    quantization states), adapter, gradient and optimizer bytes equal :func:`ledgerspec.derivations.shard.state.fsdp1`
    over the meta model's descriptors."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ledgerspec.derivations.shard.model import document_descriptors

    path = _ledger(tmp_path, "tiny-lora.ledger.yaml")
    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(DATA / "tiny")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(checkpoint)
    probe = TESTS / "truths" / "fsdp1_probe.py"
    ranks = probe_ranks(probe, 2, path, tmp_path / "ranks", "--pretrained", checkpoint, timeout=240)
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(load(path))), 2)
    for real, calc in zip(ranks, plan.ranks, strict=True):
        got = {u["unit"]: u for u in real["units"]}
        assert set(got) == set(plan.units)
        for name, unit in plan.units.items():
            assert (got[name]["numel"], got[name]["local_numel"], got[name]["dtype"]) == (
                unit.numel,
                unit.shard_numel,
                unit.dtype,
            ), name
        units = real["units"]
        frozen = sum(u["local_bytes"] for u in units if not u["requires_grad"])
        frozen += real["buffers_bytes"] + real["quant_state_bytes"]
        state = real["optimizer_state"].values()
        moments = sum(v for s in state for k, v in s.items() if k != "step")
        assert (calc.frozen_base, calc.adapter, calc.gradients, calc.optimizer) == (
            frozen,
            sum(u["local_bytes"] for u in units if u["requires_grad"]),
            sum(u["grad_bytes"] for u in units),
            moments,
        ), f"rank {real['rank']}"
