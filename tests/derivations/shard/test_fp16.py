"""fp16 mixed precision with float16 trainable parameters (issue 26): the loss scaler accelerate creates decides
whether the step runs at all.

accelerate 1.15 creates ``ShardedGradScaler`` under FSDP1 (``utils/modeling.py`` ``get_grad_scaler``,
``DistributedType.FSDP``), which unscales float16 gradients, and ``torch.amp.GradScaler`` on one device and under
FSDP2 (``utils/fsdp_utils.py`` ``get_fsdp2_grad_scaler``), which refuses them ("Attempting to unscale FP16
gradients."). Before, every simulation used ``torch.amp.GradScaler``: ``shard --estimate`` of a published fp16
FSDP1 recipe failed in the optimizer step where the real run trains.

The truths: accelerate's own scaler factories (which class), and real FSDP1 / FSDP2 runs on 2 gloo ranks
(``measure --nproc 2``, real tensors, real torch scalers): FSDP1 trains and every phase of both ranks is what
``shard --estimate`` simulates; FSDP2 fails at its first optimizer step, and the simulation says so in one line.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import pytest

from ledgerspec.contract.document import load
from tests.support import TESTS, run_cli

DATA = TESTS / "data" / "sharding"
FP16 = "optimizer:\n  name: adamw_torch\ntraining:\n  loop: trainer\n  mixed_precision: fp16\n"


def _ledger(tmp: Path, strategy: str) -> Path:
    """tiny-lora-measure.ledger.yaml in float16 (base and adapters) with fp16 autocast and a GradScaler, under
    ``strategy``."""
    if not (tmp / "tiny").exists():
        shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora-measure.ledger.yaml").read_text(encoding="utf-8")
    for old, new in (
        ("  strategy: fsdp2\n", f"  strategy: {strategy}\n"),
        ("  sharding: fsdp2\n", f"  sharding: {strategy}\n"),
        ("  loaded_dtype: float32\n", "  loaded_dtype: float16\n"),
        ("adapter:\n  dtype: float32\n", "adapter:\n  dtype: float16\n"),
        ("optimizer:\n  name: adamw_torch\n", FP16),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / f"fp16-{strategy}.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_loss_scaler_is_the_one_accelerate_creates() -> None:
    pytest.importorskip("accelerate")
    from accelerate.utils import get_grad_scaler
    from accelerate.utils.dataclasses import DistributedType
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    from ledgerspec.derivations.engine.workload import Workload
    from ledgerspec.derivations.shard.fsdp.workload import fsdp1_workload, sharded_workload

    nobody = cast(Any, None)  # the class is a property of the workload's kind, not of one workload
    assert fsdp1_workload(Workload).grad_scaler_class(nobody) is type(
        get_grad_scaler(DistributedType.FSDP, device="cpu")
    )
    assert sharded_workload(Workload).grad_scaler_class(nobody) is type(get_fsdp2_grad_scaler(device="cpu"))
    with warnings.catch_warnings():  # one device: accelerate asks for a CUDA scaler, disabled on this machine
        warnings.simplefilter("ignore")
        assert Workload.grad_scaler_class(nobody) is type(get_grad_scaler(DistributedType.NO))


@pytest.mark.slow  # a real 2-rank FSDP1 run and its simulation
def test_fp16_adapters_under_fsdp1_train_and_every_phase_is_simulated(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard
    from tests.support.per_rank import assert_rank_agrees, measured

    path = _ledger(tmp_path, "fsdp1")
    doc = measured(path, 2)
    plan = S.fsdp1(S.peft_fsdp1_units(document_descriptors(doc)), 2, reshard_after_forward=True)
    unit = max(v for k, v in plan.unit_unsharded.items() if k != S.ROOT)
    estimated = shard(load(path), estimate=True, target="cpu").estimate
    assert estimated is not None
    for real, est, calc in zip(doc.plain["x-measure-per-rank"]["ranks"], estimated.ranks, plan.ranks, strict=True):
        assert_rank_agrees(real, est, calc, unit)


@pytest.mark.slow  # a real 2-rank FSDP2 run and its simulation
def test_fp16_adapters_under_fsdp2_fail_as_the_real_run_does_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    path = _ledger(tmp_path, "fsdp2")
    before = path.read_bytes()
    code, _, err = run_cli("measure", path, "--nproc", "2")
    assert code != 0 and "Attempting to unscale FP16 gradients" in err, err  # the real ranks
    code, _, err = run_cli("shard", path, "--nproc", "2", "--estimate", "--target", "cpu")
    at = before.decode().splitlines().index("adapter:") + 2  # adapter.dtype
    assert code == 1, err  # a step that cannot be simulated (docs/estimate.md: exit status)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{path.name}:{at}:" in err and "the declared step cannot run: fp16 loss scaling refuses" in err, err
    assert "(hint: keep the adapters in float32" in err
    assert path.read_bytes() == before
