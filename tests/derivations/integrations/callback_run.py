"""A real ``transformers.Trainer`` run on the CPU with ``LedgerCallback`` (one run per process: accelerate keeps
global state). The model, adapters and data are the ground truth's (``tests/truths/trainer_run.py``: transformers
builds the model, PEFT the adapters, the first step at the worst length, the others at the typical one).

    python -m tests.derivations.integrations.callback_run CASE.json LEDGER OUT.json

``CASE.json`` is a truth case plus ``callback`` (the callback's keyword arguments), ``break`` (``"optimizer"``: the
optimizer's step number ``break_at`` raises a RuntimeError, a crashed run), ``full`` (no adapters: a full
fine-tune), ``training_args`` (more TrainingArguments), ``no_callback`` (the same run without it) and ``device``
(``cuda``: the run on the GPU). ``OUT.json`` gets what ``train()`` raised (or null), the callback's ``failure`` and
each step's wall time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any


def main(argv: list[str]) -> int:
    import torch
    from transformers import TrainerCallback, default_data_collator

    from ledgerspec.integrations.transformers import LedgerCallback
    from tests.truths.trainer_run import _dataset, _model, ordered_trainer, training_args

    torch.set_num_threads(1)
    case = json.loads(open(argv[1], encoding="utf-8").read())
    work = tempfile.mkdtemp(prefix="ledgerspec-callback-")
    if case.get("full"):  # a full fine-tune: no adapters, every parameter trained
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(case["config"])
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, case["loaded_dtype"]))
        vocab = int(config.vocab_size)
    else:
        model = _model(case, os.path.join(work, "base"))
        vocab = int(model.get_base_model().config.get_text_config().vocab_size)
    args = training_args(case, work, use_cpu=case.get("device", "cpu") == "cpu", **case.get("training_args", {}))

    class Ordered(ordered_trainer()):  # type: ignore[misc]
        def create_optimizer(self, *a: Any, **kw: Any) -> Any:
            optimizer = super().create_optimizer(*a, **kw)
            if case.get("break") == "optimizer":  # at optimizer step ``break_at`` (default: the first)
                original, calls = optimizer.step, [0]

                def broken(*a: Any, **kw: Any) -> Any:
                    calls[0] += 1
                    if calls[0] >= case.get("break_at", 1):
                        raise RuntimeError("a bug in the user's optimizer")
                    return original(*a, **kw)

                optimizer.step = broken
            return optimizer

    class Timer(TrainerCallback):
        """Wall time of each optimizer step (on_step_begin to on_step_end; CUDA synchronised)."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self.t0)

    timer = Timer()
    callback = None if case.get("no_callback") else LedgerCallback(argv[2], **case.get("callback", {}))
    trainer = Ordered(
        model=model,
        args=args,
        train_dataset=_dataset(case, vocab),
        data_collator=default_data_collator,
        callbacks=[timer] + ([callback] if callback is not None else []),
    )
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.train()
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
    out = {
        "raised": raised,
        "failure": callback.failure if callback is not None else None,
        "steps": trainer.state.global_step,
        "step_seconds": timer.seconds,
    }
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: one OUT file per rank
    with open(argv[3] + (f".rank{rank}" if rank else ""), "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
