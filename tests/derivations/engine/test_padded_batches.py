"""Padded batches: microbatch > 1 without packing or padding-free batching carries a padding mask.

Expected bytes are derived here from the tiny config (heads, kv heads, head dim, layers) and PyTorch's
memory-efficient SDPA path, not read from the code under test. The ledgers declare the custom loop: it builds each
micro-batch inside the forward and keeps nothing else of it, so the activation figures isolate what the mask costs
(the Trainer loop's batches, which carry an all-ones mask even unpadded, are tested against the real Trainer in
tests/derivations/engine/test_trainer_truth.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")

from ledgerspec.contract.document import Document, from_text
from ledgerspec.derivations.engine.workload import Workload, WorkloadSpec
from ledgerspec.derivations.estimate.estimator import CUDA_ALLOCATION_GRANULARITY, estimate
from tests.support.estimate_docs import DATA, ledger_text

SEQ = 80
ARCH = "tiny-llama-gqa"


def doc_with(
    microbatch: int = 2, packing: str = "false", padding_free: str | None = None, attention: str = "sdpa", **kwargs: Any
) -> Document:
    kwargs.setdefault("loop", "custom")
    text = ledger_text(arch=ARCH, attention=attention, microbatch=microbatch, seq=SEQ, **kwargs)
    text = text.replace("  packing: false\n", f"  packing: {packing}\n")
    if padding_free is not None:
        text = text.replace("  packing:", f"  padding_free: {padding_free}\n  packing:")
    return from_text(text, str(DATA / "test.ledger.yaml"))


def _round(n: int) -> int:
    g = CUDA_ALLOCATION_GRANULARITY
    return -(-n // g) * g


# -- when a batch is padded -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("microbatch", "packing", "padding_free", "padded"),
    [
        (2, "false", None, True),
        (4, "false", "false", True),
        (2, "UNKNOWN", None, True),  # the collators' default: pad to the longest row
        (2, "true", None, False),  # packed rows are all max_length
        (2, "false", "true", False),  # padding-free batching concatenates the rows
        (1, "false", None, False),  # one row: nothing to pad
    ],
)
def test_padding_follows_the_document(microbatch: int, packing: str, padding_free: str | None, padded: bool) -> None:
    spec = WorkloadSpec.from_document(doc_with(microbatch, packing, padding_free))
    assert spec.padded is padded


def test_changing_the_microbatch_recomputes_padding_and_json_carries_it() -> None:
    spec = WorkloadSpec.from_document(doc_with(2))
    assert (
        spec.padded
        and not spec.changed(microbatch=1).padded
        and spec.changed(microbatch=1).changed(microbatch=4).padded
    )
    assert not WorkloadSpec.from_document(doc_with(2, "true")).changed(microbatch=4).padded
    assert WorkloadSpec.from_json(spec.to_json()) == spec and WorkloadSpec.from_json(spec.to_json()).padded


def test_the_padded_batch_is_full_rows_but_the_last_one_token_shorter() -> None:
    import torch

    w = Workload(doc_with(3))
    w.prepare()
    w.materialise_base("cpu")
    inputs, labels = w.batch(SEQ)
    assert set(inputs) == {"input_ids", "attention_mask"} and inputs["input_ids"].shape == (3, SEQ)
    mask = inputs["attention_mask"]
    assert mask.dtype == torch.long and int(mask.sum()) == 3 * SEQ - 1 and int(mask[-1, -1]) == 0
    assert int((labels == -100).sum()) == 1 and int(labels[-1, -1]) == -100
    assert torch.equal(labels[mask.bool()], inputs["input_ids"][mask.bool()])
    unpadded = Workload(doc_with(3, "true"))
    unpadded.prepare()
    unpadded.materialise_base("cpu")
    ids, _ = unpadded.batch(SEQ)
    assert isinstance(ids, torch.Tensor) and ids.shape == (3, SEQ)


# -- the estimate (CUDA target) --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unpadded() -> Any:
    return estimate(doc_with(2, "true"))


@pytest.mark.slow
def test_a_padded_gqa_batch_costs_the_repeated_kv_and_the_mask_bias(unpadded: Any) -> None:
    cfg = json.loads((DATA / ARCH / "config.json").read_text())
    heads, kv, head_dim, layers = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_hidden_layers"],
    )
    b, dtype = 2, 2  # bfloat16
    padded = estimate(doc_with(2))
    # transformers repeats k and v to all heads (native GQA only without a mask); the memory-efficient kernel
    # saves them, and the bf16 additive bias made from the boolean mask (b, 1, s, s; s = 80 is 8-aligned)
    repeated = layers * 2 * _round(b * (heads - kv) * SEQ * head_dim * dtype)
    bias = layers * _round(b * SEQ * SEQ * dtype)
    # the kernel's own difference: its fp32 log-sum-exp padded to a multiple of 32 (80 -> 96) instead of s
    lse = layers * (_round(b * heads * 96 * 4) - _round(b * heads * SEQ * 4))
    mask_2d = _round(b * SEQ * 8)  # the collator's int64 attention mask, an input held like the ids
    assert padded.activations - unpadded.activations == repeated + bias + lse + mask_2d
    assert padded.phases["backward_peak"] - unpadded.phases["backward_peak"] >= repeated + bias
    assert "padded batches" in padded.method and "padded batches" not in unpadded.method


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(padding_free="true"), dict(microbatch=1)], ids=["padding_free", "mb1"])
def test_unpadded_configurations_give_the_old_figures(
    changes: dict[str, Any], unpadded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.derivations.engine import workload

    got = estimate(doc_with(**changes))
    monkeypatch.setattr(workload, "rows_are_padded", lambda _doc: False)  # the estimate before padded batches
    old = estimate(doc_with(**{**changes, "padding_free": None}))
    assert got.phases == old.phases and got.activations == old.activations
    if changes.get("microbatch") != 1:
        assert got.phases == unpadded.phases and got.activations == unpadded.activations  # packing: true too


@pytest.mark.slow
def test_flash_attention_models_padded_rows_as_full_rows() -> None:
    flash = estimate(doc_with(2, attention="flash_attention_2"))
    flash_unpadded = estimate(doc_with(2, "true", attention="flash_attention_2"))
    assert flash.activations - flash_unpadded.activations == _round(2 * SEQ * 8)  # only the 2-D mask itself
    assert "padded rows are modelled as full rows" in flash.method


@pytest.mark.slow
def test_eager_padded_mask_is_traced_and_costs_more() -> None:
    padded = estimate(doc_with(2, attention="eager"))
    plain = estimate(doc_with(2, "true", attention="eager"))
    assert padded.activations > plain.activations


# -- the measurement (real tensors, CPU) -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_padded_cpu_measurement_runs_and_accumulation_keeps_the_activation_peak() -> None:
    from ledgerspec.derivations.engine.backends import TrackerBackend
    from ledgerspec.derivations.engine.protocol import run_protocol

    def run(accumulation: int) -> Any:
        doc = doc_with(2, accumulation=accumulation, dtype="float32")
        w = Workload(doc)
        assert w.spec.padded
        return run_protocol(w, TrackerBackend(), device="cpu", steps=2)

    one, four = run(1), run(4)
    assert one.complete and four.complete
    assert four.activations_saved == one.activations_saved
    a1, a4 = one.phases["forward_peak"].categories_at_peak, four.phases["forward_peak"].categories_at_peak
    assert a1 is not None and a4 is not None and a4["activations"] == a1["activations"]
