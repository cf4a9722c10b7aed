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
(``max_completion_length``), ``num_generations`` and ``beta``; ``ledger`` adds ``LedgerCallback`` writing that ledger;
``vllm: "server"`` runs the trainer with ``use_vllm=True, vllm_mode="server"`` against :class:`_StubServer`.

With ``vllm: "server"`` only the network client is replaced (TRL's ``VLLMClient`` in
``trl/generation/vllm_generation.py``, and its ``is_vllm_available`` check, :37 and :294): the trainer's
``VLLMGeneration`` (``sync_weights``: PEFT's ``merge_adapter``, the walk over the parameters, ``unmerge_adapter``;
``generate``: the completions and their log-probs as lists) and everything after it is TRL's own. The stub's
``update_named_params`` consumes the parameter walk as vLLM's trainer side does (``packed_nccl_broadcast_producer``,
vllm/distributed/weight_transfer/packed_tensor.py at vllm-project/vllm@00a9ccfb: each parameter's bytes as a flat
uint8 view, concatenated into chunks of just over 1 GiB, two chunk slots in flight; the broadcast itself is left out).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Any, ClassVar

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


#: vLLM's packed transfer: chunk size and slots (packed_tensor.py, DEFAULT_PACKED_BUFFER_SIZE_BYTES / _NUM_BUFFERS)
PACKED_BUFFER, PACKED_SLOTS = 1024 * 1024 * 1024, 2


class _StubServer:
    """TRL's ``VLLMClient`` with the server and the NCCL group gone: fixed completions of in-vocabulary tokens (every
    one ``max_tokens`` long), each token's log-prob -1.0, and the weight updates received as vLLM's trainer side
    packs them."""

    vocab = 0
    #: per weight update: the bytes of each packed chunk (what the trainer handed over)
    updates: ClassVar[list[list[int]]] = []

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def init_communicator(self, *_: Any, **__: Any) -> None:
        pass

    def get_server_info(self) -> dict[str, Any]:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 16, **_: Any) -> dict[str, Any]:
        rows = len(prompts) * n
        completion = [3 + (i % (self.vocab - 3)) for i in range(max_tokens)]
        return {
            "prompt_ids": prompts,
            "completion_ids": [list(completion) for _ in range(rows)],
            "logprobs": [[[-1.0] for _ in range(max_tokens)] for _ in range(rows)],
        }

    def update_named_params(self, metadata: Any, named_params: Any) -> None:
        """The trainer side of vLLM's packed broadcast: chunks concatenated, a slot freed before it is refilled."""
        import torch

        in_flight: list[Any] = [None] * PACKED_SLOTS
        slot = 0
        chunks: list[int] = []
        self.updates.append(chunks)
        while True:
            in_flight[slot] = None
            flats, size = [], 0
            for _name, tensor in named_params:
                flat = tensor.contiguous().view(torch.uint8).view(-1)
                flats.append(flat)
                size += flat.numel()
                if size > PACKED_BUFFER:
                    break
            if not flats:
                break
            packed = torch.cat(flats, dim=0)
            del flats
            chunks.append(packed.numel())
            in_flight[slot] = packed
            del packed
            slot = (slot + 1) % PACKED_SLOTS

    def reset_prefix_cache(self) -> None:
        pass


def _stub_vllm(vocab: int) -> None:
    from trl.generation import vllm_generation

    _StubServer.vocab = vocab
    vllm_generation.VLLMClient = _StubServer
    vllm_generation.is_vllm_available = lambda *_a, **_k: True


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
    vllm = {}
    if case.get("vllm"):
        _stub_vllm(vocab)
        vllm = {"use_vllm": True, "vllm_mode": case["vllm"]}
    args = trl_args(
        Config,
        case,
        work,
        **vllm,
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
    out = reader.train()
    if case.get("vllm"):
        out["vllm_updates"] = _StubServer.updates
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv, run))
