"""Ground truth: what a real TRL ``RewardTrainer`` run holds, phase by phase, on the CPU.

The reward-model counterpart of ``tests/truths/dpo_run.py`` (same instrumentation, same run:
:func:`tests.truths.dpo_run.run_trainer`): transformers builds the base as a sequence classifier
(``AutoModelForSequenceClassification`` with ``num_labels=1``, as ``RewardTrainer`` loads a model name,
reward_trainer.py:396-398; QLoRA: saved, then loaded with a ``BitsAndBytesConfig``), the trainer wraps it with the
case's LoRA of task type ``SEQ_CLS`` (PEFT then trains a copy of the ``score`` head), and the step is TRL 1.16's
``RewardTrainer`` itself (its collator, its ``compute_loss``, accelerate underneath), on real CPU tensors. The rows
arrive already tokenized (``chosen_ids``, ``rejected_ids``: ``_prepare_dataset`` is skipped), the chosen row filling
the length and the rejected one a token shorter (the collator pads it); the first step's rows at the worst length.

Run as a script (one run per process)::

    python tests/truths/reward_run.py CASE.json OUT.json [--memtracker]

``CASE.json`` is a ``trainer_run`` case plus ``center_rewards_coefficient`` (None: TRL's default, off) and
``dropout`` (LoRA's, which TRL's ``disable_dropout`` sets to 0).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.truths.dpo_run import _base, run_trainer
from tests.truths.trainer_run import main


def _rows(case: dict[str, Any], vocab: int) -> Any:
    """Pre-tokenized pairs: a chosen row that fills the length, a rejected one a token shorter."""
    import datasets
    import torch

    mb, ga, steps = case["microbatch"], case["accumulation"], case["steps"]
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[list[int]]] = {"chosen_ids": [], "rejected_ids": []}
    for i in range(mb * ga * (1 + steps)):
        seq = case["seq_worst"] if i < mb * ga else case["seq_typical"]
        ids = torch.randint(3, vocab, (2 * seq,), generator=g).tolist()
        rows["chosen_ids"].append(ids[:seq])
        rows["rejected_ids"].append(ids[seq : 2 * seq - 1])
    return datasets.Dataset.from_dict(rows)


def _classifier(case: dict[str, Any], folder: str) -> Any:
    return _base(case, folder, "AutoModelForSequenceClassification", num_labels=1)


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl import RewardConfig, RewardTrainer

    settings = {"center_rewards_coefficient": case.get("center_rewards_coefficient")}
    return run_trainer({**case, "task_type": "SEQ_CLS"}, RewardTrainer, RewardConfig, _rows, settings, _classifier)


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
