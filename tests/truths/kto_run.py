"""Ground truth: what a real TRL ``KTOTrainer`` run holds, phase by phase, on the CPU.

The KTO counterpart of ``tests/truths/dpo_run.py`` (same model building, same instrumentation:
:func:`tests.truths.dpo_run.run_trainer`): the step is TRL 1.16's ``KTOTrainer`` itself (its collator, its fused LM
head, its ``_compute_loss``, accelerate underneath), on real CPU tensors. The rows arrive already tokenized
(``prompt_ids``, ``completion_ids``, ``KL_completion_ids``, ``label``: ``_prepare_dataset`` is skipped, so the KL
completions are rotated here as it rotates them, within each group of ``per_device_train_batch_size`` rows,
kto_trainer.py:1140-1157): in each micro-batch every completion fills the length but the last, a token shorter when
there are several; the first half of the rows (rounded up) desirable. The first step's rows at the worst length.

Run as a script (one run per process)::

    python tests/truths/kto_run.py CASE.json OUT.json [--memtracker]

``CASE.json`` is a DPO truth case (``reference``, ``prompt``, ``beta``, ``dropout``, ``wrapped``).
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

    mb, ga, steps, prompt = case["microbatch"], case["accumulation"], case["steps"], case["prompt"]
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "KL_completion_ids": [], "label": []}
    for group in range(ga * (1 + steps)):
        seq = case["seq_worst"] if group < ga else case["seq_typical"]
        completions = []
        for j in range(mb):
            n = seq - prompt - (1 if mb > 1 and j == mb - 1 else 0)
            ids = torch.randint(3, vocab, (prompt + n,), generator=g).tolist()
            rows["prompt_ids"].append(ids[:prompt])
            completions.append(ids[prompt:])
            rows["label"].append(j < (mb + 1) // 2)
        rows["completion_ids"].extend(completions)
        rows["KL_completion_ids"].extend([completions[-1], *completions[:-1]])
    return datasets.Dataset.from_dict(rows)


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl import KTOConfig, KTOTrainer

    settings = {"precompute_ref_log_probs": case["reference"] == "precomputed", "beta": case["beta"]}
    return run_trainer(case, KTOTrainer, KTOConfig, _rows, settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
