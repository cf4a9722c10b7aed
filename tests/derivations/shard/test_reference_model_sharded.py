"""DPO/KTO with a separate reference model (``objective_settings.reference: model``) on several ranks (issue 24).

TRL 1.16 shards the reference model too (dpo_trainer.py:984-990, kto_trainer.py the same): under FSDP with
``prepare_fsdp`` (trl/models/utils.py 292-342), which for FSDP2 is ONE ``fully_shard`` of the reference's root (no
unit per decoder layer: its forward gathers the whole model at once, and with the plugin's ``reshard_after_forward``,
True by default, frees it after), under DeepSpeed with ``prepare_deepspeed`` (a ZeRO-3 inference engine, or ZeRO
disabled for the other stages).

- FSDP2: ``measure --nproc 2`` (a real FSDP2 run per rank, gloo) against ``shard --estimate --target cpu``: every
  model-state phase to the byte, the compute phases within gloo's thread slack (every phase was equal to the byte when
  run alone, 2026-12-03: DPO, KTO, DPO with two micro-steps, with ``reshard_after_forward: false`` (the whole reference
  then stays gathered after its forward: the optimizer-step peak 1,048,608 B higher) and DPO on the QLoRA bf16-storage
  model; DPO is kept in CI). The frozen base each rank holds is the policy's shards plus the reference's, counted from
  the model's descriptors.
- FSDP1: ``prepare_fsdp`` wraps the reference per decoder layer there; the same comparison (every phase equal to the
  byte alone, 2026-12-03: DPO, KTO, two micro-steps, ``use_orig_params: false``, bf16 autocast; DPO is kept in CI).
- DeepSpeed ZeRO: TRL's own ``prepare_deepspeed`` gives the reference an engine of its own; its truth is in
  ``test_zero.py`` (``zero3-dpo-ref``).
- A GPTQ base beside a reference model is refused in one line (its layout is built for the policy only).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.errors import LedgerspecError
from tests.support.per_rank import assert_rank_agrees, fp32_fsdp2_ledger, gloo_slack, measured

#: the tiny model's decoder layers (FSDP1 units of the policy's PEFT wrap too, beside one per LoRA module)
LAYERS = ("model.layers.0", "model.layers.1")
REFERENCE = "training:\n  loop: trainer\n  objective: {objective}\n  objective_settings: {{reference: model}}\n"


def _ledger(tmp: Path, objective: str = "dpo", strategy: str = "fsdp2") -> Path:
    replaced = [("  strategy: fsdp2\n", f"  strategy: {strategy}\n")] if strategy != "fsdp2" else []
    return fp32_fsdp2_ledger(tmp, f"{objective}-{strategy}", REFERENCE.format(objective=objective), *replaced)


@pytest.mark.slow
def test_a_reference_model_on_two_fsdp2_ranks_is_the_simulated_step(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _ledger(tmp_path)
    doc = measured(path, 2)
    estimated = shard(load(path), nproc=2, estimate=True, target="cpu").estimate
    assert estimated is not None
    descriptors = document_descriptors(doc)
    policy = S.fsdp2(descriptors, 2, "adamw_torch")
    # the reference: the base's parameters (no adapter) all in one unit, the root, and its buffers (whole on every rank)
    base = [dataclasses.replace(d, unit=S.ROOT) for d in descriptors if not d.trainable]
    reference = S.fsdp2(base, 2, "adamw_torch")
    calculated = shard(load(path), nproc=2).plan
    assert calculated.gathered_units == [S.REFERENCE]  # its forward gathers the whole reference at once
    slack = gloo_slack({**policy.unit_unsharded, "reference": reference.unit_unsharded[S.ROOT]})
    for real in doc.plain["x-measure-per-rank"]["ranks"]:
        rank = real["rank"]
        calc = dataclasses.replace(
            policy.ranks[rank], frozen_base=policy.ranks[rank].frozen_base + reference.ranks[rank].frozen_base
        )
        assert_rank_agrees(real, estimated.ranks[rank], calc, slack)
        # shard's calculated row (no simulation) holds the reference's shards too
        assert calculated.ranks[rank].frozen_base == calc.frozen_base


@pytest.mark.slow
def test_a_reference_model_on_two_fsdp1_ranks_is_the_simulated_step(tmp_path: Path) -> None:
    """FSDP1: TRL's ``prepare_fsdp`` wraps the reference with the plugin's transformer-based policy (a unit per decoder
    layer and the root). Each rank holds the policy's flat shards and the reference's (counted from the model's
    descriptors); the reference's forward runs without grad, so no backward reshards its root: from its first forward
    on the rank holds the reference's root unit gathered, at least its unsharded bytes above the model state."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.sharder import shard

    path = _ledger(tmp_path, strategy="fsdp1")
    doc = measured(path, 2)
    estimated = shard(load(path), nproc=2, estimate=True, target="cpu").estimate
    assert estimated is not None
    descriptors = document_descriptors(doc)
    policy = S.fsdp1(S.peft_fsdp1_units(descriptors), 2)
    reference = S.fsdp1([d for d in descriptors if not d.trainable], 2)  # the decoder layers and the root: units
    assert set(reference.unit_unsharded) == {S.ROOT, *(u for u in policy.unit_unsharded if u.endswith(LAYERS))}
    calculated = shard(load(path), nproc=2).plan
    slack = gloo_slack({**policy.unit_unsharded, **{f"reference {u}": b for u, b in reference.unit_unsharded.items()}})
    for real in doc.plain["x-measure-per-rank"]["ranks"]:
        rank = real["rank"]
        frozen = policy.ranks[rank].frozen_base + reference.ranks[rank].frozen_base
        assert_rank_agrees(
            real, estimated.ranks[rank], dataclasses.replace(policy.ranks[rank], frozen_base=frozen), slack
        )
        assert calculated.ranks[rank].frozen_base == frozen
        phases = real["phases"]
        assert phases["optimizer_step_peak"] - phases["after_optimizer_init"] >= reference.unit_unsharded[S.ROOT]


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


@pytest.mark.parametrize("reshard", [True, False])
def test_the_calculated_fsdp2_reference_is_gathered_once(tmp_path: Path, reshard: bool) -> None:
    """``shard``'s calculated FSDP2 row with a separate reference model: resharded after its forward, the gathered
    parameters are the larger of the policy's peak set and the whole reference (one unit); kept gathered
    (``reshard_after_forward: false``), the whole reference beside every policy unit, counted once."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors

    descriptors = document_descriptors(load(_ledger(tmp_path)))
    policy = S.fsdp2(descriptors, 2, reshard_after_forward=reshard)
    base = [dataclasses.replace(d, unit=S.ROOT) for d in descriptors if d.kind == "param" and not d.trainable]
    whole = S.unit_unsharded_bytes(base, 2)[S.ROOT]
    plan = S.with_reference(policy, descriptors, 2, reshard)
    for rank, before in zip(plan.ranks, policy.ranks, strict=True):
        if reshard:
            assert rank.gathered == max(before.gathered, whole)
        else:
            assert rank.gathered == sum(policy.unit_unsharded.values()) + whole
