"""Ground truth: what a real TRL ``GRPOTrainer`` (or ``RLOOTrainer``) run holds, phase by phase, on the CPU.

The online-RL counterpart of ``tests/truths/dpo_run.py`` (same model building: :func:`tests.truths.dpo_run._base`,
the case's LoRA as the trainer's ``peft_config``): the step is TRL 1.16's trainer itself, its sampler, its
``_prepare_inputs`` (generation with transformers' ``generate`` under ``no_grad``, the scoring, the old-policy and
reference log-probs, the buffered generation batch), its fused LM head and ``_compute_loss``, accelerate underneath,
on real CPU tensors. Three departures from a user's run, none touching the step:

- the prompts are text of ``prompt`` words that a word-level tokenizer made here maps one word to one token, all of a
  step the same length (the first step's ``seq_worst - completion`` tokens, the others' ``seq_typical - completion``);
- that tokenizer's end-of-sequence token lies outside the model's vocabulary (id ``vocab``), so that no completion
  ends early: every completion is ``max_completion_length`` tokens, the shape the ledger declares;
- the reward is a cheap deterministic Python function (the completion's length in characters); the sampler keeps the
  dataset's order (``shuffle_dataset=False``).

Phases, read by ledgerspec's tensor tracker from the outside: ``generation_peak`` (the first step's
``_generate_and_score_completions``: generation, the reward, the old-policy and reference log-probs), forward (the
model calls of ``_compute_loss``: a forward pre-hook resets the peak and a forward hook keeps it, while
``_compute_loss`` runs), loss + backward (until ``training_step`` returns), the optimizer step (until
``on_step_end``); ``steady_state_peak`` is the maximum over all of the later steps, their generation included.

Run as a script (one run per process: accelerate keeps global state)::

    python tests/truths/grpo_run.py CASE.json OUT.json [--memtracker]

``CASE.json`` is a ``trainer_run`` case plus ``trainer`` (``grpo`` or ``rloo``), ``completion``
(``max_completion_length``), ``num_generations`` and ``beta``; ``ledger`` adds ``LedgerCallback`` writing that ledger.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.truths.dpo_run import _base, _ledger_callback, _lora, _memtracker, trl_args
from tests.truths.trainer_run import PhaseReader, main


def _tokenizer(vocab: int) -> Any:
    """A word-level tokenizer: ``w{i}`` is token ``i``; its end-of-sequence token is id ``vocab`` (outside the
    model's vocabulary: generation never samples it)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(3, vocab)}, "</s>": vocab}
    tok = Tokenizer(WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _prompts(case: dict[str, Any], vocab: int) -> Any:
    """One prompt per group of ``num_generations`` completions: the first step's at the worst length, then typical."""
    import datasets
    import torch

    per_step = case["microbatch"] * case["accumulation"] // case["num_generations"]
    g = torch.Generator().manual_seed(0)
    rows: list[str] = []
    for step in range(1 + case["steps"]):
        seq = case["seq_worst"] if step == 0 else case["seq_typical"]
        for _ in range(per_step):
            ids = torch.randint(3, vocab, (seq - case["completion"],), generator=g).tolist()
            rows.append(" ".join(f"w{i}" for i in ids))
    return datasets.Dataset.from_dict({"prompt": rows})


def reward_length(completions: list[str], **_: Any) -> list[float]:
    """The reward: the completion's length in characters (deterministic, no tensors)."""
    return [float(len(c)) for c in completions]


class _Reader(PhaseReader):
    """:class:`PhaseReader` with the generation phase; the forward hooks count only inside ``_compute_loss``."""

    def install(self, trainer: Any) -> None:
        self.trainer = trainer
        model: Any = trainer.model
        inside = [False]

        def pre_hook(*_a: Any, **_k: Any) -> None:
            if inside[0]:
                self.tracker.reset_peak()

        def hook(*_a: Any) -> None:
            if inside[0]:
                self.keep(self.phase_of("forward"))

        model.register_forward_pre_hook(pre_hook)
        model.register_forward_hook(hook)
        original_generate = trainer._generate_and_score_completions
        original_loss = trainer._compute_loss
        original_step = trainer.training_step

        def generate(*a: Any, **kw: Any) -> Any:
            self.tracker.reset_peak()
            out = original_generate(*a, **kw)
            self.keep("generation_peak" if self.step == 0 else "steady_state_peak")
            return out

        def compute_loss(*a: Any, **kw: Any) -> Any:
            inside[0] = True
            try:
                return original_loss(*a, **kw)
            finally:
                inside[0] = False

        def training_step(*a: Any, **kw: Any) -> Any:
            out = original_step(*a, **kw)
            self.keep(self.phase_of("backward"))
            if self.mem is not None:
                self.mem.reset_mod_stats()
            return out

        trainer._generate_and_score_completions = generate
        trainer._compute_loss = compute_loss
        trainer.training_step = training_step


def run(case: dict[str, Any]) -> dict[str, Any]:

    import torch

    torch.set_num_threads(1)
    import trl

    name = "RLOO" if case["trainer"] == "rloo" else "GRPO"
    Config: Any = getattr(trl, f"{name}Config")
    Trainer: Any = getattr(trl, f"{name}Trainer")
    work = tempfile.mkdtemp(prefix="ledgerspec-grpo-truth-")
    base = _base(case, os.path.join(work, "base"))
    vocab = int(base.config.get_text_config().vocab_size)
    args = trl_args(
        Config,
        case,
        work,
        num_generations=case["num_generations"],
        max_completion_length=case["completion"],
        beta=case["beta"],
        shuffle_dataset=False,
    )
    reader = _Reader(case, _memtracker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=base,
            reward_funcs=reward_length,
            args=args,
            train_dataset=_prompts(case, vocab),
            processing_class=_tokenizer(vocab),
            peft_config=_lora(case),
            callbacks=[reader.callback(), *_ledger_callback(case)],
        )
    reader.install(trainer)
    return reader.train()


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
