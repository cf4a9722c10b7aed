"""The DPO micro-batch the step simulates is the one TRL's own collator makes (``DataCollatorForPreference``, TRL
1.16): the same keys, shapes, dtypes and masks, and the completion positions the GPU head scores (the shifted labels
that are not -100) counted as TRL's labels count them."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from ledgerspec.contract.document import from_text
from tests.support import DATA

LEDGER = """ledgerspec: ledger/v1
identity: {model_id: tests/tiny-llama, config_sha256: UNKNOWN, config_path: tiny-llama/config.json}
method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj], bias: none}
base_model: {loaded_dtype: bfloat16, quantized: false}
workload: {max_length: 64, sequence_p50: 32, packing: false, microbatch: 2, gradient_accumulation: 1}
training: {loop: trainer, objective: dpo, objective_settings: {reference: precomputed, max_completion_length: 16}}
optimizer: {name: adamw_torch}
memory_options: {gradient_checkpointing: false}
"""


@pytest.mark.parametrize(("completion", "length"), [(16, 64), (None, 64), (200, 32)])
def test_the_synthetic_batch_is_trls_collated_batch(completion: int | None, length: int) -> None:
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from ledgerspec.derivations.engine.workload import Workload

    text = LEDGER.replace("max_completion_length: 16", f"max_completion_length: {completion}" if completion else "")
    text = text.replace(", }", "}")
    doc = from_text(text, str(DATA / "measure" / "x.ledger.yaml"))
    w = Workload(doc)
    w.prepare()
    w.device = "cpu"
    ours = w.preference_batch(length)
    # TRL's collator on pairs shaped as the synthetic rows: `prompt` tokens, a chosen completion that fills the length,
    # a rejected one a token shorter
    prompt = w.prompt_length(length)
    rows = [
        {
            "prompt_ids": [5] * prompt,
            "chosen_ids": [6] * (length - prompt),
            "rejected_ids": [7] * (length - prompt - 1),
            "ref_chosen_logps": 0.0,
            "ref_rejected_logps": 0.0,
        }
        for _ in range(2)
    ]
    theirs = DataCollatorForPreference(pad_token_id=0)(rows)
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        assert (tuple(ours[key].shape), ours[key].dtype) == (tuple(tensor.shape), tensor.dtype), key
    for key in ("attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key
    labels = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, -100)[:, 1:]  # dpo_trainer.py:1296
    valid = (labels != -100).sum(dim=1)
    assert w.completion_counts(length) == (int(valid[:2].sum()), int(valid[2:].sum()))
