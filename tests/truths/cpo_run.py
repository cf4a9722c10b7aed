"""Ground truth: what a real TRL ``CPOTrainer`` (``trl.experimental.cpo``) run holds, phase by phase, on the CPU.

The CPO counterpart of ``tests/truths/dpo_run.py`` (same model building, same instrumentation:
:func:`tests.truths.dpo_run.run_trainer`): the step is TRL 1.16's ``CPOTrainer`` itself (its collator,
``concatenated_forward``, ``get_batch_loss_metrics``, accelerate underneath), on real CPU tensors. The rows are text
of the word-level tokenizer's words; ``tokenize_row`` is replaced by one that maps each word to its id and builds
the same fields (``prompt_*``, ``chosen_*``, ``rejected_*``, the labels -100 on the prompt) without the BOS/EOS tokens
the real one adds, so that the rows have the lengths the ledger declares: the chosen row fills the length, the
rejected one is a token shorter; the first step's rows at the worst length.

Run as a script (one run per process)::

    python tests/truths/cpo_run.py CASE.json OUT.json [--memtracker]

``CASE.json`` is a DPO truth case (``prompt``, ``beta``, ``dropout``).
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
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(mb * ga * (1 + steps)):
        seq = case["seq_worst"] if i < mb * ga else case["seq_typical"]
        ids = torch.randint(3, vocab, (2 * seq,), generator=g).tolist()
        words = [f"w{t}" for t in ids]
        rows["prompt"].append(" ".join(words[:prompt]))
        rows["chosen"].append(" ".join(words[prompt:seq]))
        rows["rejected"].append(" ".join(words[seq : 2 * seq - prompt - 1]))
    return datasets.Dataset.from_dict(rows)


def _trainer_class() -> Any:
    from trl.experimental.cpo import CPOTrainer

    class PreTokenized(CPOTrainer):
        def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, Any]:
            def ids(text: str) -> list[int]:
                return [int(w[1:]) for w in text.split()]

            prompt = ids(feature["prompt"])
            batch: dict[str, Any] = {}
            for kind in ("chosen", "rejected"):
                tokens = prompt + ids(feature[kind])
                batch[f"{kind}_input_ids"] = tokens
                batch[f"{kind}_attention_mask"] = [1] * len(tokens)
                batch[f"{kind}_labels"] = [-100] * len(prompt) + tokens[len(prompt) :]
            batch["prompt_input_ids"] = prompt
            batch["prompt_attention_mask"] = [1] * len(prompt)
            return batch

    return PreTokenized


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl.experimental.cpo import CPOConfig

    return run_trainer(case, _trainer_class(), CPOConfig, _rows, {"beta": case["beta"]})


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
