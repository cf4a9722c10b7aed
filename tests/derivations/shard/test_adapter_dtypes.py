"""Adapter and base dtypes through every command that runs a training step (issue 16, item 6).

bf16 adapters on a bf16 base crashed ``shard --estimate`` only: the simulated workload cast the adapters AFTER
``fully_shard``, so AdamW met float32 state and a bfloat16 gradient (``aten.lerp_``), and the message blamed
tracing the model. The ground truth of what a real run does is :func:`test_real_fsdp2_state_follows_the_param_dtype`:
a real FSDP2 run (gloo, in this process) with torch's own AdamW, no ledgerspec code; the commands are then run for
every adapter dtype (fp32, bf16) x base dtype (bf16, fp16, fp32) and compared with the calculated per-rank state
(itself checked against real shards in ``test_sharding_fsdp2.py``) and with the real single-device run
(``measure --device cpu``).
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
LEDGER = "tiny-lora.ledger.yaml"
ADAPTERS = ["float32", "bfloat16"]
BASES = ["bfloat16", "float16", "float32"]
COMBOS = [(a, b) for a in ADAPTERS for b in BASES]
FP32 = ("float32", "float32")  # the sharding ledger as it is


def _ledger(tmp: Path, adapter: str, base: str) -> Path:
    if not (tmp / "tiny").exists():
        shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / LEDGER).read_text(encoding="utf-8")
    for old, new in (
        ("  loaded_dtype: float32\n", f"  loaded_dtype: {base}\n"),
        ("  dtype: float32\n", f"  dtype: {adapter}\n"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / f"{adapter}-on-{base}.ledger.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_real_fsdp2_state_follows_the_param_dtype(dtype: str) -> None:
    """torch's FSDP2 + AdamW on real tensors (gloo, one rank, this process): a parameter sharded in dtype D gets its
    gradient and its ``exp_avg``/``exp_avg_sq`` in D (``FSDPParam.init_dtype_attrs`` keeps ``orig_dtype``; AdamW's
    ``_init_group`` uses ``zeros_like(p)``), the ``step`` scalar stays float32 on the CPU."""
    torch = pytest.importorskip("torch")
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        d = getattr(torch, dtype)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)).to(d)
        fully_shard(model[0])
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 8, dtype=d)).float().square().sum().backward()
        opt.step()
        for p in model.parameters():
            state = opt.state[p]
            assert p.dtype == p.grad.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == d
            assert state["step"].dtype == torch.float32
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _check_shard_estimate(path: Path) -> None:
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    doc = load(path)
    result = shard(doc, estimate=True, target="cpu")
    descs = document_descriptors(doc)
    adapter = doc.get("adapter", "dtype").text()
    assert {d.dtype for d in descs if d.trainable} == {adapter}
    plan = S.fsdp2(descs, 2, "adamw_torch", reshard_after_forward=True)
    for est, calc in zip(result.estimate.ranks, plan.ranks, strict=True):
        assert est.phases["after_optimizer_init"] == calc.frozen_base + calc.adapter
        c = est.components
        assert (c["frozen_base"], c["adapter"], c["gradients"]) == (calc.frozen_base, calc.adapter, calc.gradients)
        # exp_avg + exp_avg_sq in the adapter dtype (the truth above), plus the float32 step scalars on the CPU
        assert c["optimizer"] == calc.optimizer + calc.optimizer_host
        assert calc.optimizer == 2 * sum(
            S.param_shard(d, 2, est.rank, "adamw_torch").rows * (d.nbytes // d.shape[0]) for d in descs if d.trainable
        )


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_bf16_adapters_on_a_bf16_base_shard_estimate(tmp_path: Path) -> None:
    """The case of the issue: ``shard --estimate`` runs the step and its state is the calculated bf16 state."""
    pytest.importorskip("torch")
    _check_shard_estimate(_ledger(tmp_path, "bfloat16", "bfloat16"))


@pytest.mark.slow
@pytest.mark.parametrize(("adapter", "base"), [c for c in COMBOS if c not in (("bfloat16", "bfloat16"), FP32)])
def test_every_dtype_combination_shard_estimate(tmp_path: Path, adapter: str, base: str) -> None:
    """Every combination but bf16 on bf16 (the test above) and fp32 adapters on the fp32 base: that one is
    ``tiny-lora.ledger.yaml`` unchanged, whose ``shard --estimate`` ``test_shard_estimate.py`` simulates and compares
    with the same calculated shards (``test_static_phases_are_the_calculated_shards``); the fp32 optimizer state
    of the plan is checked here on the bf16 and fp16 bases."""
    pytest.importorskip("torch")
    _check_shard_estimate(_ledger(tmp_path, adapter, base))


@pytest.mark.slow
@pytest.mark.parametrize(("adapter", "base"), COMBOS)
def test_every_dtype_combination_estimate_equals_the_real_run(tmp_path: Path, adapter: str, base: str) -> None:
    """``estimate`` (fake tensors) against ``measure --device cpu`` (real tensors, a child process): the model state
    phases and the adapter, gradient and optimizer components agree to the byte."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.measure.measurer import measure, measured_components

    path = _ledger(tmp_path, adapter, base)
    est = estimate(load(path), target="cpu")
    doc = load(path)
    real = measure(doc, device="cpu").result
    for phase in ("after_load", "after_adapter_injection", "after_optimizer_init"):
        assert est.phases[phase] == real.phases[phase].figure, phase
    got = measured_components(real)
    for comp in ("frozen_base", "adapter", "gradients", "optimizer"):
        assert est.components[comp] == got[comp], comp
    if adapter == "bfloat16":  # bf16 moments: 2 x 2 bytes an element, not float32's 2 x 4 (= 4 x the adapter)
        assert est.components["optimizer"] < 4 * est.components["adapter"]


@pytest.mark.slow
def test_bf16_adapters_measured_per_rank(tmp_path: Path) -> None:
    """The real FSDP2 run (``measure --nproc 2``, torchrun, gloo) of bf16 adapters on a bf16 base: the ranks hold the
    calculated bf16 state."""
    pytest.importorskip("peft")
    from ledgerspec import resolve
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render
    from ledgerspec.derivations.shard.model import document_descriptors

    path = _ledger(tmp_path, "bfloat16", "bfloat16")
    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture")
    atomic_write(path, render(doc.data, doc.text))
    code, _, err = run_cli("measure", path, "--nproc", "2")
    assert code == 0, err
    doc = load(path)
    plan = S.fsdp2(document_descriptors(doc), 2, "adamw_torch", reshard_after_forward=True)
    for real, calc in zip(doc.plain["x-measure-per-rank"]["ranks"], plan.ranks, strict=True):
        m = real["measured"]
        assert (m["adapter"], m["gradients"], m["optimizer"]) == (
            calc.adapter,
            calc.gradients,
            calc.optimizer + calc.optimizer_host,
        )


def test_an_optimizer_step_failure_is_reported_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the optimizer's update names the optimizer step, never the model's tracing."""
    torch = pytest.importorskip("torch")

    def broken(self: Any, closure: Any = None) -> Any:
        raise RuntimeError("expected dtype torch.float32 for `end`, but got dtype torch.bfloat16")

    monkeypatch.setattr(torch.optim.AdamW, "step", broken)
    path = _ledger(tmp_path, "bfloat16", "bfloat16")
    for args in (["estimate", "--target", "cpu"], ["shard", "--estimate", "--target", "cpu"]):
        code, _, err = run_cli(*args, path)
        assert code == 1, err
        assert "simulated optimizer step failed" in err and "after forward and backward" in err, err
        assert "cannot be traced" not in err, err
        line = path.read_text(encoding="utf-8").splitlines().index("  name: adamw_torch") + 1
        assert f"{path.name}:{line}:" in err, err  # pointed at optimizer.name
