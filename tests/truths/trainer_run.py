"""Ground truth: what a real ``transformers.Trainer`` run holds, phase by phase, on the CPU.

Nothing here uses ledgerspec's workload or step: the model is built by transformers (QLoRA through
``from_pretrained`` with a ``BitsAndBytesConfig``, as a user loads it), the adapters by PEFT, the training loop
is ``transformers.Trainer`` itself (with accelerate underneath), on real CPU tensors. It is instrumented only
from the outside, with counters that do not allocate:

- ``tracker``: ledgerspec's tensor tracker (a ``TorchDispatchMode`` counting live storages), with its peak reset
  at the phase boundaries of the measurement protocol: forward (a forward pre-hook and hook on the model the
  Trainer calls), loss + backward (until ``training_step`` returns), the optimizer step (until ``on_step_end``);
  the first optimizer step runs at the worst sequence length, the following ones at the typical length
  (``steady_state_peak``: the peak over them);
- ``memtracker`` (``--memtracker``): PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` over the
  whole run (its peak), beside the tracker, with two workarounds: no gradient hooks on frozen parameters
  (``register_hook`` refuses a tensor that does not require grad) and ``reset_mod_stats()`` at every step end. Under
  activation checkpointing it perturbs what it measures, and the tests run it apart there
  (``tests.support.step_truth.truth_runs``): its module hooks keep the autograd graph of the step alive after
  ``backward``, and with it the embedding output that ``enable_input_require_grads`` made a leaf, and that leaf's
  gradient, until the next step (+2 x microbatch x length x hidden x 2 bytes at the optimizer step on tiny-llama in
  bf16). Its peak (the backward's) is unaffected. Without checkpointing the tracker's phases are the same with it
  and without it, to the byte.

Run as a script (one run per process: accelerate keeps global state)::

    python tests/truths/trainer_run.py CASE.json OUT.json [--memtracker]

:func:`trainer_for` builds that Trainer (:func:`default_case` is the tests' usual case); the other tests that run or
read a Trainer of the tiny models build theirs with it too (the callback runs, ``intake_from_trainer``'s tests), and
:func:`component_counter` counts the ledger's components in a run's live tensors.

``CASE.json`` names the config folder, dtypes, LoRA recipe, quantization (and ``bitsandbytes_keeps_input``: the
installed bitsandbytes patched to keep ``MatMul4Bit``'s input as versions before 0.43.2 did), k-bit preparation,
TRL-style casts, mixed precision, checkpointing, microbatch/accumulation/lengths, padding, optimizer and clipping;
``OUT.json`` gets the phase peaks and the MemTracker peak in bytes. ``fp16`` on the CPU: accelerate refuses native fp16
there (``Accelerator.__init__`` sets ``native_amp`` only for non-CPU devices); the run then turns it on by hand exactly
as accelerate would on a GPU (``native_amp``, a ``GradScaler`` for the device) before the model is prepared, so the
same accelerate code paths run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any


def _dataset(case: dict[str, Any], vocab: int) -> Any:
    import torch

    mb, ga = case["microbatch"], case["accumulation"]
    worst, typical, steps = case["seq_worst"], case["seq_typical"], case["steps"]
    padded = case["padded"] and mb > 1
    mask = case["mask"]
    g = torch.Generator().manual_seed(0)

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return mb * ga * (1 + steps)

        def __getitem__(self, i: int) -> dict[str, Any]:
            seq = worst if i < mb * ga or case.get("packing") else typical
            ids = torch.randint(0, vocab, (seq,), generator=g)
            row: dict[str, Any] = {"input_ids": ids}
            labels = ids.clone()
            if mask:
                m = torch.ones_like(ids)
                if padded and i % mb == mb - 1:  # the last row of each batch: one padding position at its end
                    m[-1] = 0
                    labels[-1] = -100
                row["attention_mask"] = m
            row["labels"] = labels
            return row

    return Rows()


def _casting(model: Any, dtype: Any) -> None:
    """TRL's ``peft_module_casting_to_bf16`` (trl/experimental/utils.py, TRL 1.16; trl/trainer/utils.py in 0.x)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
            module = module.to(torch.float32)
        elif any(x in name for x in ["lm_head", "embed_tokens", "wte", "wpe"]):
            if hasattr(module, "weight") and module.weight.dtype == torch.float32:
                module = module.to(dtype)


def _model(case: dict[str, Any], folder: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    config = AutoConfig.from_pretrained(case["config"])
    dtype = getattr(torch, case["loaded_dtype"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=case["attention"])
    q, hub = case.get("quant"), case.get("hub")
    if q or hub:  # then load it as a user loads a QLoRA base, or a model downloaded from the Hub
        name = _hub_snapshot(model, hub) if hub else folder
        if not hub:
            model.save_pretrained(folder)
        del model
        load: dict[str, Any] = {"local_files_only": True} if hub else {}
        if q:
            load["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=q["type"],
                bnb_4bit_use_double_quant=q["double_quant"],
                bnb_4bit_compute_dtype=getattr(torch, q["compute_dtype"]),
                bnb_4bit_quant_storage=getattr(torch, q["storage_dtype"]),
            )
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=case["attention"], **load)
    if case.get("prepare_kbit"):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=case["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    if case.get("full"):  # full fine-tuning: the Trainer trains the model transformers built, every parameter
        return model
    lora = LoraConfig(
        r=case["rank"],
        lora_alpha=2 * case["rank"],
        lora_dropout=0.0,
        target_modules=case["targets"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if case.get("adapter_dtype"):
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(getattr(torch, case["adapter_dtype"]))
    if case.get("trl_casts"):
        _casting(model, getattr(torch, case["trl_casts"]))
    return model


def _hub_snapshot(model: Any, hub: dict[str, str]) -> str:
    """``model`` saved as a download from the Hub leaves it in the Hugging Face cache (``HF_HUB_CACHE``):
    ``models--ORG--NAME/snapshots/COMMIT/`` with the files, ``refs/main`` naming the commit (huggingface_hub's cache
    layout); returns the repository id to load it by (``from_pretrained(repo, local_files_only=True)`` resolves
    ``main`` through ``refs/main``, as an offline load of a downloaded model does)."""
    from huggingface_hub import constants

    repo = os.path.join(constants.HF_HUB_CACHE, "models--" + hub["repo"].replace("/", "--"))
    model.save_pretrained(os.path.join(repo, "snapshots", hub["commit"]))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w", encoding="utf-8") as fh:
        fh.write(hub["commit"])
    return hub["repo"]


def _quant_state_tensors(model: Any) -> list[Any]:
    """The tensors of bitsandbytes' quantization states (absmax, code, nested state): held by each 4-bit weight's
    ``quant_state``, not registered as parameters or buffers, so neither tracker would see them otherwise."""
    import torch

    out: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif hasattr(obj, "__dict__") and type(obj).__name__ == "QuantState":
            for value in vars(obj).values():
                walk(value)

    for p in model.parameters():
        walk(getattr(p, "quant_state", None))
    return out


def _optimizer_tensors(optimizer: Any) -> list[Any]:
    """Tensors an optimizer made when it was built (bitsandbytes' quantization maps, ``name2qmap``), before the
    trackers start: found by walking the optimizer object (and the one accelerate wraps), parameters excluded."""
    import torch

    out: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int = 0) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Parameter):
            return
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer) or type(obj).__name__ == "AcceleratedOptimizer":
            for k, v in vars(obj).items():
                if k not in ("param_groups", "state"):
                    walk(v, depth + 1)

    walk(optimizer)
    return out


def _bytes(tensors: Any) -> int:
    """numel x element size of each tensor, once (a tensor reachable twice, e.g. bitsandbytes' quantile maps in every
    parameter's state, counts once)."""
    once = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(once.values())


def component_counter() -> Any:
    """A ``TrainerCallback`` that counts the ledger's components in the live tensors, numel x element size:
    ``frozen_base`` (the frozen parameters, the buffers and bitsandbytes' quantization state) and ``adapter`` (the
    trainable parameters) at train begin; ``gradients`` (every parameter's ``.grad``) and ``optimizer`` (the tensors
    of the optimizer's state and those it made when built) at its first step, after the step and before
    ``zero_grad`` (``on_optimizer_step``). Its ``counts`` holds them."""
    import torch
    from transformers import TrainerCallback

    class Components(TrainerCallback):
        def __init__(self) -> None:
            self.counts: dict[str, int] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            params = list(model.parameters())
            frozen = [p for p in params if not p.requires_grad]
            self.counts["frozen_base"] = _bytes([*frozen, *model.buffers(), *_quant_state_tensors(model)])
            self.counts["adapter"] = _bytes(p for p in params if p.requires_grad)

        def on_optimizer_step(
            self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any
        ) -> None:
            if "gradients" in self.counts:
                return
            self.counts["gradients"] = _bytes(p.grad for p in model.parameters() if p.grad is not None)
            held = [v for per_param in optimizer.state.values() for v in per_param.values()]
            held += [
                w
                for v in held
                if isinstance(v, dict | list | tuple)
                for w in (v.values() if isinstance(v, dict) else v)
            ]
            tensors = [v for v in held if isinstance(v, torch.Tensor)] + _optimizer_tensors(optimizer)
            self.counts["optimizer"] = _bytes(tensors)

    return Components()


def _bitsandbytes_0_43_1() -> None:
    """bitsandbytes < 0.43.2's ``MatMul4Bit``: ``ctx.tensors = (A, B)`` when an input needs a gradient (0.43.1's
    bitsandbytes/autograd/_functions.py), on the installed bitsandbytes: its forward, then its input kept."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    def forward(ctx: Any, A: Any, B: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(ctx, A, B, *args, **kwargs)
        if any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, ctx.tensors[1])
        return out

    MatMul4Bit.forward = staticmethod(forward)  # type: ignore[method-assign]


def training_args(case: dict[str, Any] | None, work: str, **extra: Any) -> Any:
    """The ``TrainingArguments`` of a truth case (the callback runs use them too): the case's device (``device``,
    default cpu), batch, accumulation, steps, clipping, optimizer and checkpointing (non-reentrant), nothing saved or
    logged; without a case, transformers' defaults on the CPU (a Trainer to read, not to train). ``extra`` wins."""
    import dataclasses

    from transformers import TrainingArguments

    if case is None:
        return TrainingArguments(**{"output_dir": os.path.join(work, "out"), "use_cpu": True, "report_to": [], **extra})
    # transformers 5 renames gradient_checkpointing* to activation_checkpointing* (the old names still work, with a
    # FutureWarning)
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    settings: dict[str, Any] = {
        "output_dir": os.path.join(work, "out"),
        "use_cpu": case.get("device", "cpu") == "cpu",
        "bf16": case["mixed_precision"] == "bf16",
        "per_device_train_batch_size": case["microbatch"],
        "gradient_accumulation_steps": case["accumulation"],
        "max_steps": 1 + case["steps"],
        "max_grad_norm": case["max_grad_norm"],
        "optim": case["optimizer"],
        "learning_rate": 2e-4,
        ckpt: case["gradient_checkpointing"],
        f"{ckpt}_kwargs": {"use_reentrant": False},
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return TrainingArguments(**{**settings, **extra})


def default_case(config: str, **over: Any) -> dict[str, Any]:
    """A truth case: LoRA r=4 on q/v of the model of ``config`` (a folder) in bfloat16, fp32 adapters, AdamW, no
    mixed precision or checkpointing, microbatch 2, one step at 64 tokens then two at 32 (padded rows); ``over``
    changes any of it."""
    return {
        "config": config,
        "loaded_dtype": "bfloat16",
        "attention": "sdpa",
        "rank": 4,
        "targets": ["q_proj", "v_proj"],
        "mixed_precision": "no",
        "gradient_checkpointing": False,
        "microbatch": 2,
        "accumulation": 1,
        "seq_worst": 64,
        "seq_typical": 32,
        "steps": 2,
        "padded": True,
        "packing": False,
        "mask": True,
        "max_grad_norm": 1.0,
        "optimizer": "adamw_torch",
        "quant": None,
        "prepare_kbit": False,
        "adapter_dtype": None,
        "trl_casts": None,
        **over,
    }


def trainer_for(
    model: Any, work: str, case: dict[str, Any] | None = None, callbacks: Sequence[Any] = (), **settings: Any
) -> Any:
    """The ``transformers.Trainer`` the tests build for the tiny models, with :func:`training_args` (``settings``
    change them). With a truth case: its data in order (a sequential sampler: the first step sees the worst length),
    fp16 on the CPU turned on as accelerate would on a GPU (see the module docstring), and ``break``:
    ``"optimizer"`` makes optimizer step ``break_at`` (default: the first) raise a RuntimeError (a crashed run).
    Without a case: no data (a Trainer to read, e.g. by ``intake_from_trainer``, not to train)."""
    import torch
    from transformers import Trainer, default_data_collator

    args = training_args(case, work, **settings)
    if case is None:
        return Trainer(model=model, args=args, callbacks=list(callbacks))
    spec: dict[str, Any] = case  # a case, for the methods below

    class Ordered(Trainer):
        def _get_train_sampler(self, *a: Any, **kw: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if spec["mixed_precision"] == "fp16" and self.args.use_cpu:
                from accelerate.state import AcceleratorState

                AcceleratorState()._mixed_precision = "fp16"
                self.accelerator.native_amp = True
                self.accelerator.scaler = torch.amp.GradScaler("cpu")

        def create_optimizer(self, *a: Any, **kw: Any) -> Any:
            optimizer = super().create_optimizer(*a, **kw)
            if spec.get("break") == "optimizer":
                original, calls = optimizer.step, [0]

                def broken(*a: Any, **kw: Any) -> Any:
                    calls[0] += 1
                    if calls[0] >= spec.get("break_at", 1):
                        raise RuntimeError("a bug in the user's optimizer")
                    return original(*a, **kw)

                optimizer.step = broken
            return optimizer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return Ordered(
        model=model,
        args=args,
        train_dataset=_dataset(case, int(base.config.get_text_config().vocab_size)),
        data_collator=default_data_collator,
        callbacks=list(callbacks),
    )


class PhaseReader:
    """The outside instrumentation of a truth run (the module docstring): the tensor tracker's peak kept per phase
    (:meth:`callback` before the trainer is built, :meth:`install` after), and with ``case["memtracker"]`` a MemTracker
    of ``memtracker`` (a factory) over the whole run. Shared by this run and the TRL trainers' (``dpo_run.py``)."""

    def __init__(self, case: dict[str, Any], memtracker: Any = None) -> None:
        from ledgerspec.derivations.engine.tracker import MemoryTracker

        self.case = case
        self.tracker = MemoryTracker()
        self.phases: dict[str, int] = {}
        self.step = 0
        self.mem: Any = None
        self.memtracker = memtracker or _FrozenSafeMemTracker
        self.trainer: Any = None

    def keep(self, name: str) -> None:
        self.phases[name] = max(self.phases.get(name, 0), self.tracker.peak)
        self.tracker.reset_peak()

    def phase_of(self, kind: str) -> str:
        return f"{kind}_peak" if self.step == 0 else "steady_state_peak"

    def callback(self) -> Any:
        """The ``TrainerCallback`` that starts the trackers at train begin and keeps the optimizer-step phases."""
        from torch.distributed._tools.mem_tracker import _MemRefType
        from transformers import TrainerCallback

        reader = self

        class Phases(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                trainer, tracker = reader.trainer, reader.tracker
                model: Any = trainer.model
                tracker.__enter__()
                tracker.track_existing(list(model.parameters()) + list(model.buffers()), "frozen_params")
                tracker.track_existing(_quant_state_tensors(model), "quant_state")
                ref = getattr(trainer, "ref_model", None)  # a TRL trainer's separate reference model
                if ref is not None:
                    tracker.track_existing(list(ref.parameters()) + list(ref.buffers()), "frozen_params")
                    tracker.track_existing(_quant_state_tensors(ref), "quant_state")
                tracker.track_existing(_optimizer_tensors(trainer.optimizer), "optimizer")
                tracker.track_existing([trainer._tr_loss], "temporary")
                tracker.reset_peak()
                if not reader.case.get("memtracker"):
                    return
                memtracker = reader.memtracker()
                memtracker.track_external(
                    *([ref] if ref is not None else []),
                    *(_quant_state_tensors(ref) if ref is not None else []),
                    model,
                    trainer.optimizer,
                    trainer._tr_loss,
                    *_quant_state_tensors(model),
                    *_optimizer_tensors(trainer.optimizer),
                )
                memtracker.__enter__()
                reader.mem = memtracker

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                reader.keep("optimizer_step_peak" if reader.step == 0 else "steady_state_peak")
                reader.step += 1
                if reader.mem is not None:
                    reader.mem.reset_mod_stats()

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                mem = reader.mem
                if mem is not None:
                    mem.__exit__(None, None, None)
                    peak = mem.get_tracker_snapshot("peak")
                    reader.phases["memtracker_peak"] = int(sum(s.get("Total", 0) for s in peak.values()))
                    reader.phases["memtracker_param"] = int(sum(s.get(_MemRefType.PARAM, 0) for s in peak.values()))
                reader.tracker.__exit__(None, None, None)

        return Phases()

    def install(self, trainer: Any) -> None:
        """The forward hooks on the trainer's model (a pre-hook resets the peak, a hook keeps the forward phase: a
        step's several forwards make one phase) and ``training_step`` wrapped (the loss + backward phase)."""
        self.trainer = trainer
        model: Any = trainer.model
        ref = getattr(trainer, "ref_model", None)  # a TRL trainer's separate reference model: its forward too
        for m in (model, *([ref] if ref is not None else [])):
            m.register_forward_pre_hook(lambda *_a, **_k: self.tracker.reset_peak())
            m.register_forward_hook(lambda *_a: self.keep(self.phase_of("forward")))
        original_step = trainer.training_step

        def training_step(*a: Any, **kw: Any) -> Any:
            out = original_step(*a, **kw)
            self.keep(self.phase_of("backward"))
            if self.mem is not None:  # MemTracker tracks one call of each module between resets
                self.mem.reset_mod_stats()
            return out

        trainer.training_step = training_step

    def train(self) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer.train()
        return {"phases": self.phases}


def run(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if case.get("bitsandbytes_keeps_input"):
        _bitsandbytes_0_43_1()
    work = tempfile.mkdtemp(prefix="ledgerspec-truth-")
    model = _model(case, os.path.join(work, "base"))
    reader = PhaseReader(case)
    counter = component_counter() if case.get("count") else None  # arithmetic on live tensors: allocates nothing
    reader.install(trainer_for(model, work, case, [reader.callback(), *([counter] if counter else [])]))
    out = reader.train()
    if counter is not None:
        out["components"] = counter.counts
    return out


class _FrozenSafeMemTracker:
    """PyTorch's ``MemTracker``, without gradient hooks on frozen parameters (it registers a ``register_hook`` on
    every parameter of every module it enters, which raises for a tensor that does not require grad)."""

    def __new__(cls) -> Any:
        from torch.distributed._tools.mem_tracker import MemTracker

        class FrozenSafe(MemTracker):
            def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
                frozen = [p for p in module.parameters() if not p.requires_grad]
                for p in frozen:  # no-op hook registrations, for frozen parameters only
                    p.register_hook = _NoHook
                    p.register_post_accumulate_grad_hook = _NoHook
                try:
                    return super()._track_module_params_and_buffers(module, install_grad_hooks)
                finally:
                    for p in frozen:
                        del p.register_hook, p.register_post_accumulate_grad_hook

        return FrozenSafe()


class _NoHook:
    def __init__(self, *_: Any) -> None:
        pass

    def remove(self) -> None:
        pass


def main(argv: list[str], run_case: Any = None) -> int:
    """``SCRIPT CASE.json OUT.json [--memtracker]``: ``run_case`` (this module's :func:`run` by default) of the case,
    its result written to OUT.json."""
    case = json.loads(open(argv[1], encoding="utf-8").read())
    case["memtracker"] = "--memtracker" in argv[3:]
    out = (run_case or run)(case)
    with open(argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
