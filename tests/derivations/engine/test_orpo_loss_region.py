"""The autocast region TRL 1.16's ``ORPOTrainer``/``CPOTrainer`` open around ``get_batch_loss_metrics`` on a 4-bit base
with bf16 (``autocast(self.accelerator.device.type)``, orpo_trainer.py:886-891, cpo_trainer.py:926-931): torch's
default autocast dtype of the device the trainer runs on (``torch.autocast`` reads ``torch.get_autocast_dtype``),
bfloat16 on the CPU, float16 on CUDA; the estimate's CUDA target opens it on its CPU fake tensors, where the emulated
CUDA autocast casts. The truths (test_orpo_truth.py, test_cpo_truth.py) run the CPU's; no truth sees the region at a
phase's peak (docs/objectives.md), so this checks its plumbing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def _loop(objective: str, loss_autocast: bool, device_type: str, target: str | None) -> Any:
    from ledgerspec.derivations.engine.cpo import CPOLoop
    from ledgerspec.derivations.engine.orpo import ORPOLoop

    spec = SimpleNamespace(loss_autocast=loss_autocast, autocast_dtype="bfloat16")
    w = SimpleNamespace(spec=spec, device_type=device_type, **({"target": target} if target else {}))
    return (ORPOLoop if objective == "orpo" else CPOLoop)(w)


@pytest.mark.parametrize("objective", ["orpo", "cpo"])
@pytest.mark.parametrize(
    ("target", "dtype"), [(None, torch.bfloat16), ("cpu", torch.bfloat16), ("cuda", torch.float16)]
)
def test_the_region_is_the_devices_default_autocast(objective: str, target: str | None, dtype: Any) -> None:
    loop = _loop(objective, True, "cpu", target)
    with loop.loss_region():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    assert not torch.is_autocast_enabled("cpu")


def test_without_trls_casts_there_is_no_region() -> None:
    with _loop("orpo", False, "cpu", "cuda").loss_region():
        assert not torch.is_autocast_enabled("cpu")
