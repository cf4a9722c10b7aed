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
(``adapter_disabled``: the PEFT model with its adapters off, TRL's reference for a ``peft_config``; ``model``: a
separate reference model handed to the trainer as ``ref_model``, :func:`_reference_model`; ``precomputed``: log-probs
computed before training), ``prompt`` (prompt tokens of every row) and ``beta``; ``wrapped`` hands the
trainer the PEFT model instead (TRL then adds a frozen copy of the adapter as the reference); ``ledger`` adds
``LedgerCallback`` writing that ledger.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.truths.trainer_run import PhaseReader, _FrozenSafeMemTracker, main


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


def _base(case: dict[str, Any], folder: str, auto_class: str = "AutoModelForCausalLM", **config_kwargs: Any) -> Any:
    """The base model of the case as a user loads it (QLoRA: saved, then loaded with a ``BitsAndBytesConfig``), no
    adapters: ``DPOTrainer`` wraps it with the case's ``LoraConfig`` (its ``peft_config``). ``auto_class`` and
    ``config_kwargs``: another head (a reward model's ``AutoModelForSequenceClassification``, ``num_labels=1``)."""
    import torch
    import transformers
    from transformers import AutoConfig, BitsAndBytesConfig

    auto = getattr(transformers, auto_class)
    config = AutoConfig.from_pretrained(case["config"], **config_kwargs)
    dtype = getattr(torch, case["loaded_dtype"])
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=dtype, attn_implementation=case["attention"])
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
    return auto.from_pretrained(folder, dtype=dtype, attn_implementation=case["attention"], quantization_config=quant)


def _lora(case: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=case["rank"],
        lora_alpha=2 * case["rank"],
        lora_dropout=case.get("dropout", 0.0),
        target_modules=case["targets"],
        task_type=case.get("task_type", "CAUSAL_LM"),
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


def _reference_model(case: dict[str, Any], folder: str) -> Any:
    """``reference: model``: the trainer's ``ref_model``, a second copy of the base loaded as the policy is (QLoRA:
    4-bit too), in eval mode as ``from_pretrained`` leaves it. One departure, for the CPU only: bitsandbytes'
    ``Linear4bit`` repacks its weight for good at the first forward in eval mode without grad on a CPU with AVX512-BF16
    (nn/modules.py:613-620, bitsandbytes 0.50), a layout a GPU never makes; switched off here (and in the simulated
    step), so the run keeps the GPU's layout."""
    ref = _base(case, folder)
    ref.eval()
    for module in ref.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return ref


def trl_args(config_class: Any, case: dict[str, Any], work: str, **extra: Any) -> Any:
    """``config_class`` (a TRL trainer's config) for ``case`` on the CPU: the case's batch, accumulation, steps,
    clipping, optimizer and checkpointing (under the name the installed TRL uses), nothing logged or saved, and the
    trainer's own settings in ``extra``."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return config_class(
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
        **extra,
        **{ckpt: case["gradient_checkpointing"], f"{ckpt}_kwargs": {"use_reentrant": False}},
    )


def run(case: dict[str, Any]) -> dict[str, Any]:
    from trl import DPOConfig, DPOTrainer

    dpo = {
        "precompute_ref_log_probs": case["reference"] == "precomputed",
        "beta": case["beta"],
    }
    return run_trainer(case, DPOTrainer, DPOConfig, _rows, dpo)


def run_trainer(
    case: dict[str, Any],
    trainer_class: Any,
    config_class: Any,
    rows: Any,
    settings: dict[str, Any],
    make_base: Any = None,
) -> Any:
    """A TRL trainer of ``trainer_class`` (its config ``config_class`` with the case's settings and ``settings``) over
    ``rows(case, vocab)``, instrumented as the module docstring says; its phases (and the MemTracker peak).
    ``make_base``: what builds the unwrapped base model (default :func:`_base`, a causal LM)."""

    import torch

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="ledgerspec-trl-truth-")
    base_folder = os.path.join(work, "base")
    if case.get("wrapped"):  # a PEFT model handed to the trainer (TRL then trains against a copy of its adapter)
        from tests.truths.trainer_run import _model

        base, peft_config = _model(case, base_folder), None
    else:
        base, peft_config = (make_base or _base)(case, base_folder), _lora(case)
    ref_model = _reference_model(case, os.path.join(work, "ref")) if case.get("reference") == "model" else None
    vocab = int(base.config.get_text_config().vocab_size)
    args = trl_args(config_class, case, work, max_length=case["seq_worst"], **settings)
    reader = PhaseReader(case, _memtracker)

    class Ordered(trainer_class):
        def _prepare_dataset(self, dataset: Any, *a: Any, **kw: Any) -> Any:
            return dataset  # already tokenized (see the module docstring)

        def _get_train_sampler(self, *a: Any, **kw: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Ordered(
            model=base,
            **({"ref_model": ref_model} if ref_model is not None else {}),  # RewardTrainer takes none
            peft_config=peft_config,
            args=args,
            train_dataset=rows(case, vocab),
            processing_class=_tokenizer(vocab),
            callbacks=[reader.callback(), *_ledger_callback(case)],
        )
    reader.install(trainer)
    return reader.train()


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
