"""DPO/KTO with a separate reference model (``objective_settings.reference: model``) on several ranks: TRL 1.16 shards
the reference model too (``prepare_fsdp``/``prepare_deepspeed``, dpo_trainer.py:984-990), which neither ``shard
--estimate`` nor ``measure --nproc`` builds yet: both refuse it in one line at the field, before any trace or
process starts; a GPTQ base beside a reference model too (its layout is built for the policy only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.errors import LedgerspecError
from tests.support import TESTS

DATA = TESTS / "data" / "sharding"


def _ledger(tmp: Path, objective: str = "dpo") -> Path:
    shutil.copytree(DATA / "tiny", tmp / "tiny")
    text = (DATA / "tiny-lora-mp.ledger.yaml").read_text(encoding="utf-8")
    text += f"training:\n  loop: trainer\n  objective: {objective}\n  objective_settings: {{reference: model}}\n"
    (tmp / "ref.ledger.yaml").write_text(text, encoding="utf-8")
    return tmp / "ref.ledger.yaml"


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_shard_estimate_refuses_a_reference_model_on_several_ranks(tmp_path: Path, objective: str) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard.sharder import shard

    with pytest.raises(LedgerspecError, match="TRL shards the reference model too") as err:
        shard(load(_ledger(tmp_path, objective)), nproc=2, estimate=True, target="cpu")
    assert "\n" not in str(err.value) and "one device" in (err.value.hint or "")


def test_measure_nproc_refuses_a_reference_model(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.measure.dist import make_request

    with pytest.raises(LedgerspecError, match="TRL shards the reference model too") as err:
        make_request(load(_ledger(tmp_path)), 2, "cpu", 2)
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_a_gptq_base_beside_a_reference_model_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    text = _ledger(tmp_path).read_text(encoding="utf-8")
    gptq = "  quantized: true\n  quantization: {type: gptq, bits: 4, kernel: torch}\n"
    text = text.replace("  quantized: false\n", gptq)
    assert "type: gptq" in text
    with pytest.raises(LedgerspecError, match="reference model beside a GPTQ base") as err:
        WorkloadSpec.from_document(from_text(text, str(tmp_path / "ref.ledger.yaml")))
    assert "\n" not in str(err.value)
