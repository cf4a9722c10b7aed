"""Ground truth: what a real TRL ``DPOTrainer`` run holds, phase by phase, on the CPU.

The DPO counterpart of ``tests/truths/trainer_run.py`` (same model building, same outside instrumentation): the
model is built by transformers and PEFT (:func:`tests.truths.trainer_run._model`), the step is TRL 1.16's
``DPOTrainer`` itself (its collator, its fused LM head, its ``_compute_loss``, accelerate underneath), on real CPU
tensors. Two departures from a user's run, neither touching the step: the rows arrive already tokenized
(``prompt_ids``, ``chosen_ids``, ``rejected_ids``: ``_prepare_dataset`` is skipped; the tokenizer is a word-level
one made here, used for its pad and eos ids only), and the sampler is sequential so that the first step sees the
worst length.

Phases, read by ledgerspec's tensor tracker from the outside: forward (from the first model call of a micro-step
to the end of its last: the policy's forward and the reference's; a forward pre-hook resets the peak and a forward
hook keeps it, on the policy and on a separate reference model), loss + backward (until ``training_step``
returns), the optimizer step (until ``on_step_end``). ``--memtracker``: PyTorch's ``MemTracker`` over the whole run
(its global peak; it refuses a second top-level forward per step, so the reference's forward, without grad, is not
given module statistics: :func:`_memtracker`).

Run as a script (one run per process: accelerate keeps global state)::

    python tests/truths/dpo_run.py CASE.json OUT.json [--memtracker]

``CASE.json`` is a ``trainer_run`` case (the model is handed to ``DPOTrainer`` unwrapped, with the case's LoRA as
its ``peft_config``: the trainer wraps it, and for a 4-bit base casts the adapters to bfloat16) plus ``reference``
(``adapter_disabled``: the PEFT model with its adapters off, TRL's reference for a ``peft_config``; ``precomputed``:
log-probs computed before training), ``prompt`` (prompt tokens of every row) and ``beta``; ``wrapped`` hands the
trainer the PEFT model instead (TRL then adds a frozen copy of the adapter as the reference); ``ledger`` adds
``LedgerCallback`` writing that ledger.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.truths.trainer_run import (
    _FrozenSafeMemTracker,
    _optimizer_tensors,
    _quant_state_tensors,
)


def _rows(case: dict[str, Any], vocab: int) -> Any:
    """Pre-tokenized preference rows: the prompt, a chosen completion that fills the length, a rejected one a token
    shorter (the collator pads it); the first step's rows at the worst length, the others at the typical one."""
    import datasets
    import torch

    mb, ga, steps = case["microbatch"], case["accumulation"], case["steps"]
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[list[int]]] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for i in range(mb * ga * (1 + steps)):
        seq = case["seq_worst"] if i < mb * ga else case["seq_typical"]
        prompt = case["prompt"]
        ids = torch.randint(3, vocab, (2 * seq,), generator=g).tolist()
        rows["prompt_ids"].append(ids[:prompt])
        rows["chosen_ids"].append(ids[prompt:seq])
        rows["rejected_ids"].append(ids[seq : 2 * seq - prompt - 1])
    return datasets.Dataset.from_dict(rows)


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _base(case: dict[str, Any], folder: str) -> Any:
    """The base model of the case as a user loads it (QLoRA: saved, then loaded with a ``BitsAndBytesConfig``), no
    adapters: ``DPOTrainer`` wraps it with the case's ``LoraConfig`` (its ``peft_config``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    config = AutoConfig.from_pretrained(case["config"])
    dtype = getattr(torch, case["loaded_dtype"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=case["attention"])
    q = case.get("quant")
    if not q:
        return model
    model.save_pretrained(folder)
    del model
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q["type"],
        bnb_4bit_use_double_quant=q["double_quant"],
        bnb_4bit_compute_dtype=getattr(torch, q["compute_dtype"]),
        bnb_4bit_quant_storage=getattr(torch, q["storage_dtype"]),
    )
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=case["attention"], quantization_config=quant
    )


def _lora(case: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=case["rank"],
        lora_alpha=2 * case["rank"],
        lora_dropout=case.get("dropout", 0.0),
        target_modules=case["targets"],
        task_type="CAUSAL_LM",
    )


def _ledger_callback(case: dict[str, Any]) -> list[Any]:
    """``ledgerspec.integrations.transformers.LedgerCallback`` writing to ``case["ledger"]``, when the case names one
    (the callback's own test; the tracker's phases are then not a truth: the callback's work counts in them)."""
    if not case.get("ledger"):
        return []
    from ledgerspec.integrations.transformers import LedgerCallback

    return [LedgerCallback(case["ledger"])]


def _memtracker() -> Any:
    """PyTorch's ``MemTracker`` (frozen-safe, as the Trainer truth uses it) without module statistics for the forwards
    that run without grad (the reference's): it refuses a second top-level forward per step, while its global
    peak, counted at the dispatch level, is what is read here."""
    import torch

    frozen_safe = type(_FrozenSafeMemTracker())

    class GradForwardsOnly(frozen_safe):  # type: ignore[misc,valid-type]
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if torch.is_grad_enabled():
                super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if torch.is_grad_enabled():
                super()._post_fw_hook(module, inputs, outputs)

    return GradForwardsOnly()


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl import DPOConfig, DPOTrainer

    dpo = {
        "precompute_ref_log_probs": case["reference"] == "precomputed",
        "beta": case["beta"],
    }
    return run_trainer(case, DPOTrainer, DPOConfig, _rows, dpo)


def run_trainer(
    case: dict[str, Any], trainer_class: Any, config_class: Any, rows: Any, settings: dict[str, Any]
) -> Any:
    """A TRL trainer of ``trainer_class`` (its config ``config_class`` with the case's settings and ``settings``) over
    ``rows(case, vocab)``, instrumented as the module docstring says; its phases (and the MemTracker peak)."""
    import dataclasses

    import torch
    from transformers import TrainerCallback

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="ledgerspec-trl-truth-")
    base_folder = os.path.join(work, "base")
    if case.get("wrapped"):  # a PEFT model handed to the trainer (TRL then trains against a copy of its adapter)
        from tests.truths.trainer_run import _model

        base, peft_config = _model(case, base_folder), None
    else:
        base, peft_config = _base(case, base_folder), _lora(case)
    vocab = int(base.config.get_text_config().vocab_size)
    names = {f.name for f in dataclasses.fields(config_class)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    args = config_class(
        output_dir=os.path.join(work, "out"),
        use_cpu=True,
        bf16=case["mixed_precision"] == "bf16",
        per_device_train_batch_size=case["microbatch"],
        gradient_accumulation_steps=case["accumulation"],
        max_steps=1 + case["steps"],
        max_grad_norm=case["max_grad_norm"],
        optim=case["optimizer"],
        learning_rate=2e-4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=case["seq_worst"],
        **settings,
        **{ckpt: case["gradient_checkpointing"], f"{ckpt}_kwargs": {"use_reentrant": False}},
    )
    tracker = MemoryTracker()
    phases: dict[str, int] = {}
    run_state: dict[str, Any] = {"step": 0, "mem": None}

    def keep(name: str) -> None:
        phases[name] = max(phases.get(name, 0), tracker.peak)
        tracker.reset_peak()

    def phase_of(kind: str) -> str:
        return f"{kind}_peak" if run_state["step"] == 0 else "steady_state_peak"

    class Phases(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tracker.__enter__()
            model: Any = trainer.model
            tracker.track_existing(list(model.parameters()) + list(model.buffers()), "frozen_params")
            tracker.track_existing(_quant_state_tensors(model), "quant_state")
            tracker.track_existing(_optimizer_tensors(trainer.optimizer), "optimizer")
            tracker.track_existing([trainer._tr_loss], "temporary")
            tracker.reset_peak()
            if not case.get("memtracker"):
                return
            memtracker = _memtracker()
            memtracker.track_external(
                model,
                trainer.optimizer,
                trainer._tr_loss,
                *_quant_state_tensors(model),
                *_optimizer_tensors(trainer.optimizer),
            )
            memtracker.__enter__()
            run_state["mem"] = memtracker

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            keep("optimizer_step_peak" if run_state["step"] == 0 else "steady_state_peak")
            run_state["step"] += 1
            if run_state["mem"] is not None:
                run_state["mem"].reset_mod_stats()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            mem = run_state["mem"]
            if mem is not None:
                mem.__exit__(None, None, None)
                peak = mem.get_tracker_snapshot("peak")
                phases["memtracker_peak"] = int(sum(s.get("Total", 0) for s in peak.values()))
            tracker.__exit__(None, None, None)

    class Ordered(trainer_class):
        def _prepare_dataset(self, dataset: Any, *a: Any, **kw: Any) -> Any:
            return dataset  # already tokenized (see the module docstring)

        def _get_train_sampler(self, *a: Any, **kw: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Ordered(
            model=base,
            peft_config=peft_config,
            args=args,
            train_dataset=rows(case, vocab),
            processing_class=_tokenizer(vocab),
            callbacks=[Phases(), *_ledger_callback(case)],
        )

    def pre(*_: Any, **__: Any) -> None:
        tracker.reset_peak()

    def post(_m: Any, _a: Any, out: Any) -> None:
        keep(phase_of("forward"))

    policy: Any = trainer.model
    policy.register_forward_pre_hook(pre)
    policy.register_forward_hook(post)
    original_step = trainer.training_step

    def training_step(*a: Any, **kw: Any) -> Any:
        out = original_step(*a, **kw)
        keep(phase_of("backward"))
        if run_state["mem"] is not None:
            run_state["mem"].reset_mod_stats()
        return out

    trainer.training_step = training_step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return {"phases": phases}


def main(argv: list[str]) -> int:
    case = json.loads(open(argv[1], encoding="utf-8").read())
    case["memtracker"] = "--memtracker" in argv[3:]
    out = run(case)
    with open(argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
