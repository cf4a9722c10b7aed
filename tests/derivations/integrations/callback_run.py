"""A real ``transformers.Trainer`` run on the CPU with ``LedgerCallback`` (one run per process: accelerate keeps
global state). The model, adapters and data are the ground truth's (``tests/truths/trainer_run.py``: transformers
builds the model, PEFT the adapters, the first step at the worst length, the others at the typical one).

    python -m tests.derivations.integrations.callback_run CASE.json LEDGER OUT.json

``CASE.json`` is a truth case plus ``callback`` (the callback's keyword arguments), ``break`` (``"optimizer"``: the
optimizer's step number ``break_at`` raises a RuntimeError, a crashed run), ``full`` (no adapters: a full
fine-tune), ``training_args`` (more TrainingArguments), ``no_callback`` (the same run without it) and ``device``
(``cuda``: the run on the GPU), ``hub`` (the model loaded from a Hugging Face cache snapshot, see the truth's
``_model``) and ``count`` (the truth's ``component_counter`` runs too). ``OUT.json`` gets what ``train()`` raised (or
null), the callback's ``failure``, each step's wall time and, with ``count``, the components counted.
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
    from transformers import TrainerCallback

    from ledgerspec.integrations.transformers import LedgerCallback
    from tests.truths.trainer_run import _model, component_counter, trainer_for

    torch.set_num_threads(1)
    case = json.loads(open(argv[1], encoding="utf-8").read())
    work = tempfile.mkdtemp(prefix="ledgerspec-callback-")
    if case.get("full"):  # a full fine-tune: no adapters, every parameter trained
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(case["config"])
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, case["loaded_dtype"]))
    else:
        model = _model(case, os.path.join(work, "base"))

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
    counter = component_counter() if case.get("count") else None
    callbacks = [c for c in (timer, callback, counter) if c is not None]
    trainer = trainer_for(model, work, case, callbacks, **case.get("training_args", {}))
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
        **({"components": counter.counts} if counter is not None else {}),
    }
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: one OUT file per rank
    with open(argv[3] + (f".rank{rank}" if rank else ""), "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
