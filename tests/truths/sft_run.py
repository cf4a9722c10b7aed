"""Ground truth: what a real TRL ``SFTTrainer`` run (its default loss: TRL's fused LM head) holds, phase by phase, on
the CPU.

The counterpart of ``tests/truths/dpo_run.py`` for TRL 1.16's ``SFTTrainer``, with the same model building and the same
outside instrumentation (:func:`tests.truths.dpo_run.run_trainer`): the model is handed to the trainer unwrapped with
the case's LoRA as its ``peft_config``; its collator, its fused LM head (``add_fused_lm_head``: TRL's torch path on
the CPU), its ``compute_loss`` and accelerate run the step. The rows arrive tokenized (``input_ids``;
``_prepare_dataset`` is skipped), the first step's at the worst length, the others at the typical one, the last row of
each micro-batch a token shorter (the collator pads it), and the sampler is sequential.

    python tests/truths/sft_run.py CASE.json OUT.json [--memtracker]
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.truths.dpo_run import run_trainer
from tests.truths.trainer_run import main


def _rows(case: dict[str, Any], vocab: int) -> Any:
    import datasets
    import torch

    mb, ga, steps = case["microbatch"], case["accumulation"], case["steps"]
    g = torch.Generator().manual_seed(0)
    rows: list[list[int]] = []
    for i in range(mb * ga * (1 + steps)):
        seq = case["seq_worst"] if i < mb * ga else case["seq_typical"]
        shorter = 1 if mb > 1 and i % mb == mb - 1 else 0
        rows.append(torch.randint(3, vocab, (seq - shorter,), generator=g).tolist())
    return datasets.Dataset.from_dict({"input_ids": rows})


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl import SFTConfig, SFTTrainer

    return run_trainer(case, SFTTrainer, SFTConfig, _rows, {"packing": False})


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
