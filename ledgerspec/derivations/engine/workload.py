"""The training workload a ledger declares, as real (CPU/CUDA) or fake tensors.

Shared by ``measure`` (real tensors, one child process per measurement) and ``estimate`` (fake
tensors under ``FakeTensorMode``). Memory does not depend on weight values, so the model is the
exact architecture from its config with random weights: no download.

Order of work (the protocol in :mod:`ledgerspec.derivations.engine.protocol` measures between the steps):

1. :meth:`Workload.prepare` (no memory): the base model on the meta device in ``loaded_dtype``
   with the declared attention implementation; for QLoRA the ``nn.Linear`` layers replaced by
   bitsandbytes ``Linear4bit`` exactly as transformers' bnb quantizer does (same skip modules);
   PEFT's ``prepare_model_for_kbit_training`` when declared (the fp32 upcast of non-quantized
   parameters); the exact adapters injected with :func:`ledgerspec.derivations.stack.build.inject_adapters`.
2. :meth:`Workload.materialise_base`: base parameters and buffers created on the device with
   random values (QLoRA weights quantized with bitsandbytes from a dense ``loaded_dtype`` tensor,
   one weight at a time like transformers' loader); rotary buffers computed by transformers.
3. :meth:`Workload.materialise_adapters`: the adapter weights, in the declared ``adapter.dtype``;
   gradient checkpointing enabled as declared (``gradient_checkpointing_enable`` with
   ``use_reentrant`` from ``checkpointing_kind``; transformers also calls
   ``enable_input_require_grads``, as the Trainer path does).
4. :meth:`Workload.make_optimizer`: the declared optimizer over the trainable parameters, as the
   transformers Trainer builds it for that name (its weight-decay groups under the Trainer loop; on CUDA
   torch's AdamW defaults to the ``foreach`` implementation, which the estimate for the cuda target asks for).
5. :attr:`Workload.step` (:mod:`ledgerspec.derivations.engine.step`): one optimizer step of the declared
   loop, micro-step by micro-step; gradient accumulation is sequential micro-steps (accumulation is not a
   bigger activation batch).

For fake tensors enter ``FakeTensorMode(allow_non_fake_inputs=True)`` (and any tracker) after
:meth:`prepare` and materialise with ``device="cpu"``; :meth:`prepare` pre-builds bitsandbytes'
quantization maps so that 4-bit quantization runs under the fake mode.

Modelling choices (also in :func:`method_notes`): the declared loop and mixed precision
(``training.*``, :class:`~ledgerspec.contract.config.Training`), the model config's ``use_cache`` unless
declared, loss = transformers' own causal-LM loss function (fp32 upcast of logits included), dropout active
(``model.train()``). Padded batches (microbatch > 1 without packing or padding-free batching,
:func:`rows_are_padded`) carry an attention mask with one padding position, as a padding collator's batch
does (:meth:`Workload.batch`); the Trainer loop's batches carry the collator's attention mask (all ones when
nothing is padded) and ``labels``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.stack.build import ModelSource, build_base, cast_module_dtypes, inject_adapters, load_config
from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

#: optimizer names this workload can build (the transformers Trainer's names, plus plain ``adam``)
OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adam",
    "sgd",
    "adamw_8bit",
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adafactor",
)
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
LOOPS = ("trainer", "custom")
#: the objectives whose batches are chosen/rejected pairs in one batch (TRL's preference collators)
PAIRED = ("dpo", "reward", "orpo", "cpo")
#: the objectives whose step is a TRL trainer's own (no packing, a Trainer loop, the trainer's own loss)
TRL_STEPS = ("dpo", "reward", "kto", "orpo", "cpo", "grpo", "rloo")
#: the online-RL objectives: a generation phase before the training forward (TRL's GRPOTrainer, RLOOTrainer)
GENERATING = config.GENERATING
#: the objectives that score through TRL's fused LM head and have a reference (DPO, KTO)
REFERENCED = ("dpo", "kto")
MIXED_PRECISION = ("no", "bf16", "fp16")
LEARNING_RATE = 2e-4  # any value: memory does not depend on it


_err = ErrorAt("workload")  # estimate and measure both build it


@dataclass(frozen=True)
class QuantSpec:
    """bitsandbytes 4-bit quantization as declared in ``base_model.quantization``."""

    quant_type: str  # nf4 | fp4
    double_quant: bool
    compute_dtype: str
    storage_dtype: str
    blocksize: int | None = None
    skip_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class GenerationSpec:
    """GRPO's generation as declared in ``training.objective_settings`` (TRL 1.16's GRPOConfig defaults)."""

    num_generations: int = 8
    #: micro-steps per generation (None: the accumulation steps, TRL's default)
    steps_per_generation: int | None = None
    #: 0.0: no reference (TRL's default); > 0: the reference log-probs of the policy with its adapters off
    beta: float = 0.0
    #: None: transformers' ``generate``; ``server`` or ``colocate``: vLLM's (``objective_settings.vllm_mode``)
    vllm: str | None = None


@dataclass(frozen=True)
class GptqSpec:
    """A GPTQ base as declared (``quantization.type: gptq``): bits, group size, act-order and the kernel the run
    trains through (:mod:`ledgerspec.derivations.engine.gptq`)."""

    bits: int | None  # None: the model config's quantization_config (else 4)
    group_size: int | None  # None: the model config's quantization_config (else 128)
    desc_act: bool | None
    kernel: str
    skip_modules: tuple[str, ...] = ()
    #: PEFT's GPTQLoraLinear forward as before 0.16.0 (declared ``software.peft``; known difference
    #: ``peft-gptq-lora-input-cast``)
    older_lora: bool = False
    #: ``gptq`` (GPTQ QuantLinear, :mod:`ledgerspec.derivations.engine.gptq`) or ``awq`` (AWQ GEMM,
    #: :mod:`ledgerspec.derivations.engine.awq`; ``kernel`` is then ``gemm``)
    scheme: str = "gptq"

    def settled(self, model_config: Any) -> GptqSpec:
        """Bits and group size the ledger left out, from the model config's ``quantization_config``."""
        qc = getattr(model_config, "quantization_config", None)
        published: dict[str, Any] = {}
        if isinstance(qc, dict):
            published = qc
        elif qc is not None and hasattr(qc, "to_dict"):
            published = qc.to_dict()
        return dataclasses.replace(
            self,
            bits=self.bits if self.bits is not None else int(published.get("bits", 4)),
            group_size=self.group_size if self.group_size is not None else int(published.get("group_size", 128)),
            desc_act=self.desc_act if self.desc_act is not None else bool(published.get("desc_act", False)),
        )


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of the workload, read from a document; triage changes one at a time with :meth:`changed`."""

    loaded_dtype: str
    quant: QuantSpec | None
    prepare_kbit: bool
    adapter_dtype: str | None
    optimizer: str
    min_8bit_size: int | None
    gradient_checkpointing: bool
    reentrant: bool
    attention: str
    microbatch: int
    accumulation: int
    seq_worst: int
    seq_typical: int
    #: the document pads rows to the longest one (packing off, padding_free not true); batches are padded only
    #: when a micro-step has more than one row: see :attr:`padded` (so ``changed(microbatch=1)`` stays exact)
    pads_rows: bool = False
    #: ``training.loop``: trainer | custom
    loop: str = "trainer"
    #: ``training.mixed_precision`` as a dtype name (bfloat16 / float16), None without autocast
    autocast_dtype: str | None = None
    #: ``training.use_cache``; None: the model config's value
    use_cache: bool | None = None
    #: ``training.max_grad_norm`` (0: no clipping; the custom loop never clips)
    max_grad_norm: float = 1.0
    #: ``base_model.module_dtypes``: (module-name substring, dtype) pairs, first match wins
    module_dtypes: tuple[tuple[str, str], ...] = ()
    #: micro-batches the Trainer loop fetches per optimizer step when fewer micro-steps are run (the estimate runs
    #: two of them: every further one allocates the same); None: ``accumulation``
    prefetch: int | None = None
    #: ``software.kernels``: the kernels that replace transformers' modules (the estimate models some of them)
    kernels: config.Kernels = dataclasses.field(default_factory=config.Kernels)
    #: ``memory_options.activation_offload``: saved activations moved to the host (TRL's OffloadActivations)
    offload: bool = False
    #: ``memory_options.offload_mode`` as written (whose offloading: TRL's, axolotl's)
    offload_mode: str | None = None
    #: ``training.objective``: sft | dpo | reward (the objectives the step simulates, ``config.SIMULATED_OBJECTIVES``)
    objective: str = "sft"
    #: DPO, KTO: where the reference log-probs come from (adapter_disabled | adapter_copy | model | precomputed)
    reference: str | None = None
    #: DPO: completion tokens per chosen row (``objective_settings.max_completion_length``, at most length - 1);
    #: None: every position after the first (one prompt token)
    completion: int | None = None
    #: DPO, reward: TRL sets every dropout's probability to 0 before training (``disable_dropout``, default true)
    disable_dropout: bool = False
    #: ``method.kind: full``: no adapters; every floating parameter of the model is trained
    full: bool = False
    #: reward: ``objective_settings.center_rewards_coefficient`` (None: off, TRL's default)
    center_rewards: float | None = None
    #: GRPO: the generation (None for the other objectives)
    generation: GenerationSpec | None = None
    #: a GPTQ base (``quantization.type: gptq``): its QuantLinear layers and kernel; None: not GPTQ
    gptq: GptqSpec | None = None
    #: ORPO, CPO on a bitsandbytes 4-bit base with bf16 and TRL's casts declared: TRL's ``compute_loss`` runs the
    #: forward and the loss in an autocast region of its own, ``autocast(device.type)`` at the device's default dtype
    #: (orpo_trainer.py:886-891, cpo_trainer.py:926-931, TRL 1.16; when ``peft_module_casting_to_bf16`` ran,
    #: :262-265 / :252-255, which the ledger's ``module_dtypes`` say: :func:`config.trl_casts_declared`)
    loss_autocast: bool = False

    @property
    def padded(self) -> bool:
        """Whether a micro-step's batch carries padding and an attention mask (see :func:`rows_are_padded`); DPO's
        always does: its collator pads the rejected rows to the chosen ones (the synthetic rejected row is a token
        shorter, :meth:`Workload.preference_batch`), and so does the reward model's (the same pairs)."""
        if self.objective in GENERATING:  # the prompts of a step are one length and every completion is full
            return False
        return (
            (self.pads_rows and self.microbatch > 1)
            or self.objective in PAIRED
            or (self.objective == "kto" and self.microbatch > 1)
        )

    @classmethod
    def from_document(cls, doc: Document) -> WorkloadSpec:
        """The workload of ``doc`` (:func:`ledgerspec.contract.config.read`); a knob the step cannot run is a
        one-line error at its field."""
        cfg = config.read(doc)

        def dtype(path: tuple[str, ...], default: str | None = None) -> str:
            return config.require_dtype(doc, path, default, rule="measure")

        loaded = dtype(("base_model", "loaded_dtype"), "float32")
        quant = None
        q = cfg.quantization
        if cfg.full and q.quantized:
            raise _err(
                doc,
                ("method", "kind"),
                "method.kind full trains every weight, but the base is quantized: quantized weights cannot be trained",
                "load the base unquantized (base_model.quantized: false) for full fine-tuning, or choose QLoRA",
            )
        if cfg.full and cfg.training.objective in REFERENCED:
            name = cfg.training.objective.upper()
            raise _err(
                doc,
                ("method", "kind"),
                f"{name} with method.kind full needs a separate reference model, which the step does not simulate",
                f"estimate the SFT step (training.objective: sft) or {name} with LoRA",
            )
        if cfg.full and cfg.training.objective in TRL_STEPS:
            raise _err(
                doc,
                ("method", "kind"),
                f"training.objective {cfg.training.objective} with method.kind full: the step simulates TRL's trainer "
                "for this objective with LoRA/QLoRA only (its truths are adapter runs)",
                "estimate it with LoRA, or the SFT step (training.objective: sft) for full fine-tuning",
            )
        gptq = None
        if q.quantized and q.scheme in ("gptq", "awq"):
            gptq = _gptq_spec(doc, q)
        elif q.quantized:
            path = config.QUANT
            if not q.four_bit:
                raise _err(
                    doc,
                    (*path, "type"),
                    "the training step (estimate, measure, shard) simulates bitsandbytes 4-bit nf4/fp4, GPTQ and "
                    "AWQ bases only, "
                    f"not {q.type or 'nothing'!r}",
                    "`ledgerspec resolve` sizes this base's storage exactly; its step is not simulated "
                    "(see the Models page of the docs)",
                )
            if q.double_quant is None:
                raise _err(doc, (*path, "double_quant"), "base_model.quantization.double_quant must be true or false")
            quant = QuantSpec(
                q.type or "",
                q.double_quant,
                dtype((*path, "compute_dtype")),
                dtype((*path, "storage_dtype"), config.DEFAULT_STORAGE),
                q.blocksize,
                q.skip_modules,
            )
        # None: PEFT's float32 (full fine-tuning has no adapters: the weights keep their loaded dtypes)
        adapter = dtype(("adapter", "dtype")) if cfg.adapter_dtype and not cfg.full else None
        opt = cfg.optimizer.key
        if opt not in OPTIMIZERS:
            raise _err(
                doc,
                ("optimizer", "name"),
                f"the training step cannot build optimizer {opt or 'nothing'!r} (estimate, measure)",
                f"use one of {', '.join(OPTIMIZERS)}",
            )
        if cfg.gradient_checkpointing is None:
            raise _err(
                doc,
                ("memory_options", "gradient_checkpointing"),
                "memory_options.gradient_checkpointing must be true or false",
            )
        attention = cfg.attention or "sdpa"
        if attention not in ATTENTION:
            raise _err(
                doc,
                ("software", "attention_implementation"),
                f"unknown attention implementation {attention!r}",
                f"use one of {', '.join(ATTENTION)}",
            )
        w = cfg.workload
        if w.microbatch is None or w.microbatch < 1:
            raise _err(doc, ("workload", "microbatch"), "workload.microbatch must be an integer >= 1")
        worst, typical = sequence_shapes(doc)
        t = cfg.training
        if t.objective in TRL_STEPS and w.packing and w.worst is not None:
            # TRL 1.16's DPO neither packs nor runs padding-free (dpo_config.py:210-218: it warns and pads), and its
            # RewardConfig has neither setting (its collator pads, reward_trainer.py:203-229): the rows are pairs at
            # their own lengths
            typical = dataclasses.replace(w, packing=False).typical or worst
        if t.loop not in LOOPS:
            raise _err(doc, ("training", "loop"), f"unknown training loop {t.loop!r}", f"use one of {', '.join(LOOPS)}")
        what = t.not_simulated
        if what is not None:
            where: tuple[str, ...] = ("training", "objective")
            if " on TRL " in what:
                where = ("software", "trl")
            elif "vllm_mode" in what:
                where = ("training", "objective_settings", "vllm_mode")
            elif t.objective in REFERENCED:
                where = ("training", "objective_settings", "reference")
            raise _err(
                doc,
                where,
                f"{what}: the training step (estimate, measure, shard) simulates supervised fine-tuning and TRL "
                f"1.16's DPO and KTO (reference {', '.join(config.DPO_REFERENCES)}), ORPO, CPO, GRPO and RLOO "
                f"(reference {', '.join(config.GRPO_REFERENCES)}) and reward models; this one runs other forwards "
                "or tensors (other batches, generation, full logits) it does not model yet",
                "declare one of those settings if it is what the run does, else size the run with a measurement of "
                "the real trainer (LedgerCallback), or estimate its SFT step as a lower bound with "
                "training.objective: sft",
            )
        kernels = cfg.kernels
        if t.objective in REFERENCED and t.dpo_reference == "model" and gptq is not None:
            raise _err(
                doc,
                ("training", "objective_settings", "reference"),
                f"a separate reference model beside a {(q.scheme or '').upper()} base: the step builds the reference "
                "model for bitsandbytes 4-bit and unquantized bases only",
                "size the run with a measurement of the real trainer (LedgerCallback)",
            )
        if t.objective == "kto" and w.microbatch < 2:
            raise _err(
                doc,
                ("workload", "microbatch"),
                "training.objective kto with one row per micro-step: TRL 1.16's KTOTrainer refuses it (its KL term "
                "pairs each prompt with another row's completion, kto_trainer.py:844-847)",
                "set workload.microbatch to 2 or more",
            )
        if t.objective in ("orpo", "cpo") and gptq is not None:
            raise _err(
                doc,
                config.QUANT,
                f"training.objective {t.objective} on a {(q.scheme or '').upper()} base: the step simulates TRL 1.16's "
                f"{t.objective.upper()}Trainer on bitsandbytes 4-bit and unquantized bases only (its truths)",
                "size the run with a measurement of the real trainer (LedgerCallback)",
            )
        generation = _generation(doc, t, w.microbatch, max(w.gradient_accumulation or 1, 1), worst)
        share = t.vllm_gpu_memory_utilization
        if generation is not None and generation.vllm == "colocate" and share is not None and not 0 < share <= 1:
            raise _err(
                doc,
                ("training", "objective_settings", "vllm_gpu_memory_utilization"),
                f"vllm_gpu_memory_utilization must be above 0 and at most 1, got {share:g}",
                "it is the fraction of the card's total memory colocated vLLM takes (TRL's default 0.3)",
            )
        if generation is not None and generation.vllm is not None and (quant is not None or gptq is not None):
            raise _err(
                doc,
                ("training", "objective_settings", "use_vllm"),
                f"training.objective {t.objective} with use_vllm on a quantized base is not simulated yet: TRL syncs "
                "the weights through PEFT's merge_adapter, which dequantizes, adds and quantizes every 4-bit layer "
                "again (peft/tuners/lora/bnb.py:355-411), and that is not modelled",
                "size the run with a measurement of the real trainer (LedgerCallback)",
            )
        if t.objective in TRL_STEPS:
            if t.loop != "trainer":
                trainer = {
                    "dpo": "DPOTrainer",
                    "kto": "KTOTrainer",
                    "orpo": "ORPOTrainer",
                    "cpo": "CPOTrainer",
                    "grpo": "GRPOTrainer",
                    "rloo": "RLOOTrainer",
                }.get(t.objective, "RewardTrainer")
                raise _err(
                    doc,
                    ("training", "loop"),
                    f"training.objective {t.objective} runs TRL's {trainer}, a transformers.Trainer: not a custom loop",
                    "set training.loop: trainer",
                )
            # DPOTrainer scores through its own fused head (``preference.DPOLoop``): a fused cross-entropy patched into
            # the model's forward (Liger's, Cut Cross-Entropy's) is reached only with fused_lm_head=False
            # (trainer/utils.py:1602-1610), so no declared cross_entropy kernel plays a part; a reward model has no LM
            # head and no token loss at all (a score per row); ORPO calls the model without labels and computes its
            # cross-entropy itself on the full logits (orpo_trainer.py:779-800)
            kernels = dataclasses.replace(kernels, cross_entropy="eager")
        if t.mixed_precision not in MIXED_PRECISION:
            raise _err(
                doc,
                ("training", "mixed_precision"),
                f"unknown mixed precision {t.mixed_precision!r}",
                f"use one of {', '.join(MIXED_PRECISION)}",
            )
        module_dtypes = tuple(
            (pattern, dtype(("base_model", "module_dtypes", pattern))) for pattern, _ in cfg.module_dtypes
        )
        return cls(
            loaded,
            quant,
            cfg.prepare_kbit,
            adapter,
            opt,
            cfg.optimizer.min_8bit_size,
            cfg.gradient_checkpointing,
            cfg.reentrant,
            attention,
            w.microbatch,
            max(w.gradient_accumulation or 1, 1),
            worst,
            typical,
            rows_are_padded(doc),
            t.loop,
            t.autocast_dtype,
            t.use_cache,
            t.max_grad_norm,
            module_dtypes,
            kernels=kernels,
            offload=bool(cfg.activation_offload),
            offload_mode=doc.get("memory_options", "offload_mode").text(),
            objective=t.objective,
            reference=t.dpo_reference if t.objective in REFERENCED else None,
            completion=(
                (t.max_completion_length or GRPO_COMPLETION)
                if t.objective in GENERATING
                else t.max_completion_length
                if t.objective in REFERENCED
                else None
            ),
            disable_dropout=(
                t.grpo_dropout if t.objective in GENERATING else t.objective in TRL_STEPS and t.disable_dropout
            ),
            full=cfg.full,
            center_rewards=t.center_rewards_coefficient if t.objective == "reward" else None,
            generation=generation,
            gptq=gptq,
            # ORPOTrainer/CPOTrainer handed a peft_config: `if args.bf16 and getattr(model, "is_loaded_in_4bit",
            # False)`: TRL's casts, then the autocast of compute_loss (orpo_trainer.py:262-265, 886-891;
            # cpo_trainer.py:252-255, 926-931); a tool that hands TRL a PEFT model (axolotl's rl: orpo) gets neither,
            # and declares its own casts
            loss_autocast=t.objective in ("orpo", "cpo")
            and quant is not None
            and t.mixed_precision == "bf16"
            and config.trl_casts_declared(cfg.module_dtypes),
        )

    def changed(self, **changes: Any) -> WorkloadSpec:
        """A copy with some knobs changed (``microbatch=1``, ``seq_worst=512``, ``optimizer="adamw_8bit"``...)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadSpec:
        data = dict(data)
        q = data.get("quant")
        if q is not None:
            q = dict(q)
            if q.get("skip_modules") is not None:
                q["skip_modules"] = tuple(q["skip_modules"])
            data["quant"] = QuantSpec(**q)
        g = data.get("gptq")
        if g is not None:
            data["gptq"] = GptqSpec(**{**g, "skip_modules": tuple(g.get("skip_modules") or ())})
        data["module_dtypes"] = tuple(tuple(pair) for pair in data.get("module_dtypes") or ())
        if isinstance(data.get("generation"), dict):
            data["generation"] = GenerationSpec(**data["generation"])
        if isinstance(data.get("kernels"), dict):
            k = dict(data["kernels"])
            for key in ("lora_projections", "other"):
                k[key] = tuple(k.get(key) or ())
            k["packages"] = tuple(tuple(pair) for pair in k.get("packages") or ())
            data["kernels"] = config.Kernels(**k)
        return cls(**data)


#: GRPO/RLOO with vLLM under FSDP1: TRL's weight sync merges the adapters into FSDP1's sharded views first, which fails
GENERATION_SHARDED = (
    "training.objective grpo/rloo with use_vllm under FSDP1 is not simulated or measured: TRL's weight sync first runs "
    "PEFT's merge_adapter on FSDP1's sharded parameter views (VLLMGeneration._iter_named_params), which fails in a "
    "real two-rank run here (RuntimeError: inconsistent tensor size); on FSDP2 ranks and under DeepSpeed ZeRO it "
    "runs, and without vLLM under FSDP1"
)
#: GRPOConfig's default ``max_completion_length`` (grpo_config.py:494, TRL 1.16)
GRPO_COMPLETION = 512


def _generation(
    doc: Document, t: config.Training, microbatch: int, accumulation: int, worst: int
) -> GenerationSpec | None:
    """GRPO's and RLOO's generation settings (None for the other objectives); the combinations their configs refuse
    are one-line errors at their field (grpo_config.py:1095-1141, TRL 1.16; RLOOConfig the same)."""
    if t.objective not in GENERATING:
        return None
    settings = ("training", "objective_settings")
    name = t.objective.upper()
    g = t.num_generations or (2 if t.objective == "rloo" else 8)  # rloo_config.py:301, grpo_config.py:480
    if g < 2:
        raise _err(doc, (*settings, "num_generations"), f"{name} needs at least 2 generations per prompt")
    spg = t.steps_per_generation
    if t.generation_batch_size is not None:
        if spg is not None:
            raise _err(
                doc,
                (*settings, "generation_batch_size"),
                f"generation_batch_size and steps_per_generation cannot both be set ({name}Config)",
            )
        if t.generation_batch_size % microbatch:
            raise _err(
                doc,
                (*settings, "generation_batch_size"),
                f"generation_batch_size {t.generation_batch_size} is not a multiple of workload.microbatch "
                f"{microbatch}",
            )
        spg = t.generation_batch_size // microbatch
    if (microbatch * (spg or accumulation)) % g:
        raise _err(
            doc,
            (*settings, "num_generations"),
            f"the generation batch ({microbatch * (spg or accumulation)} completions: microbatch x steps per "
            f"generation) is not a multiple of num_generations {g} ({name}Config refuses it)",
            "make workload.microbatch (x the steps per generation) a multiple of num_generations",
        )
    completion = t.max_completion_length or GRPO_COMPLETION
    if completion >= worst:
        raise _err(
            doc,
            (*settings, "max_completion_length"),
            f"max_completion_length {completion} leaves no prompt in workload.max_length {worst} (for {name} the "
            "sequence is prompt + completion)",
            "set workload.max_length to the longest prompt plus max_completion_length",
        )
    # the steps per generation as a number (the estimate runs fewer micro-steps than the accumulation: the generation
    # batch is still the declared one)
    return GenerationSpec(g, spg or accumulation, 0.0 if t.grpo_reference == "none" else 0.05, t.vllm_mode)


def sequence_shapes(doc: Document) -> tuple[int, int]:
    """(worst, typical) sequence lengths of the declared profile (:class:`ledgerspec.contract.config.Workload`)."""
    w = config.read(doc).workload
    if w.worst is None or w.typical is None:
        raise _err(doc, ("workload",), "workload.max_length or workload.sequence_p95 is needed for a batch shape")
    return w.worst, w.typical


def method_notes(spec: WorkloadSpec, device: str = "cpu") -> str:
    """The modelling choices of the step, in words (part of every estimate's and measurement's ``method``)."""
    if spec.objective in GENERATING:
        g = spec.generation or GenerationSpec()
        reference = (
            "the reference log-probs of the same model with its adapters off (beta > 0), without grad and "
            "checkpointing, in the generation phase"
            if g.beta
            else "no reference (beta 0)"
        )
        rloo = spec.objective == "rloo"
        if g.vllm:
            generation = (
                f"TRL 1.16's {'RLOO' if rloo else 'GRPO'}Trainer step with vLLM ({g.vllm} mode): a generation phase "
                f"of its own (microbatch x steps per generation completions, {g.num_generations} per prompt, each "
                f"{spec.completion} tokens, generated by vLLM"
                + (", whose share of the card is outside this step" if g.vllm == "colocate" else " on its server")
                + "; the weights synced to vLLM first: PEFT's merge_adapter, every base parameter "
                + ("packed into vLLM's 1 GiB broadcast chunks" if g.vllm == "server" else "loaded into vLLM")
                + ", unmerge_adapter), "
                + (
                    "the old policy's log-probs, "
                    if rloo
                    else "the old policy's log-probs and the importance-sampling ratio, "
                )
            )
        else:
            generation = (
                f"TRL 1.16's {'RLOO' if rloo else 'GRPO'}Trainer step with transformers' generate (no vLLM): a "
                f"generation phase of its own (microbatch x steps per generation completions, {g.num_generations} per "
                f"prompt, each {spec.completion} tokens: the KV cache and sampling buffers under no_grad, "
                "checkpointing off), " + ("the old policy's log-probs, " if rloo else "")
            )
        loop = (
            generation
            + f"{reference}, the generation batch buffered for the micro-steps; the training forward of prompt + "
            "completion through TRL's fused LM head (no logits held), "
            + (
                "the leave-one-out advantages' clipped sequence loss and TRL's metrics, the loss divided by the "
                "accumulation steps"
                if rloo
                else "the dapo loss and TRL's metrics"
            )
        )
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.objective == "cpo":
        loop = (
            "TRL 1.16's CPOTrainer step (trl.experimental, CPOConfig's defaults: sigmoid loss, cpo_alpha 1.0): chosen "
            "and rejected rows concatenated (twice the rows of the microbatch), one forward to the full logits "
            "(held, fp32 under mixed precision), the chosen rows' NLL, the rows' log-probs and the CPO loss (TRL's "
            "own functions), TRL's metrics, no reference, the loss divided by the accumulation steps"
        )
        if spec.loss_autocast:
            loop += ", the forward and the loss in TRL's own autocast region (a 4-bit base with bf16)"
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.objective == "orpo":
        loop = (
            "TRL 1.16's ORPOTrainer step (trl.experimental): chosen and rejected rows concatenated (twice the rows "
            "of the microbatch), one forward to the full logits (held, fp32 under mixed precision), the chosen rows' "
            "cross-entropy, the rows' average log-probs and the odds-ratio loss (TRL's own functions), TRL's "
            "metrics, no reference, the loss divided by the accumulation steps"
        )
        if spec.loss_autocast:
            loop += ", the forward and the loss in TRL's own autocast region (a 4-bit base with bf16)"
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.objective == "reward":
        loop = (
            "TRL 1.16's RewardTrainer step: a sequence classifier (AutoModelForSequenceClassification, one score, "
            "PEFT's SEQ_CLS model with a trainable copy of the score head), chosen and rejected rows in one batch "
            "(twice the rows of the microbatch), one forward to a score per row, the pairwise logsigmoid loss"
            + (" with the centring term" if spec.center_rewards is not None else "")
            + " and TRL's metrics, the loss divided by the accumulation steps"
        )
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.objective == "kto":
        reference = {
            "precomputed": "the reference log-probs precomputed (read from the batch)",
            "adapter_copy": "the reference forwards through TRL's frozen copy of the adapter (`ref`)",
            "model": "the reference forwards of a separate reference model (a second copy of the base, frozen, "
            "held for the whole run)",
        }.get(spec.reference or "adapter_disabled", "the reference forwards of the same model with its adapters off")
        loop = (
            "TRL 1.16's KTOTrainer step: unpaired rows with their labels and the KL batch of mismatched completions, "
            "the policy's forward of the KL batch without grad, its forward of the batch through TRL's fused LM head "
            f"(no logits held), {reference} (KL batch and batch, without grad and checkpointing), the KTO loss and "
            "TRL's metrics, the loss divided by the accumulation steps"
        )
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.objective == "dpo":
        reference = {
            "precomputed": "the reference log-probs precomputed (read from the batch)",
            "adapter_copy": "the reference forward through TRL's frozen copy of the adapter (`ref`), without grad "
            "and checkpointing",
            "model": "the reference forward of a separate reference model (a second copy of the base, frozen, held "
            "for the whole run), without grad",
        }.get(
            spec.reference or "adapter_disabled",
            "the reference forward of the same model with its adapters off, without grad and checkpointing",
        )
        loop = (
            "TRL 1.16's DPOTrainer step: chosen and rejected rows in one batch (twice the rows of the microbatch), the "
            f"policy's forward through TRL's fused LM head (no logits held), {reference}, the sigmoid loss and "
            "TRL's metrics, the loss divided by the accumulation steps"
        )
        if spec.disable_dropout:
            loop += ", dropout off (TRL's disable_dropout)"
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.loop == "trainer" and spec.kernels.cross_entropy == "trl_chunked_nll":
        loop = (
            "TRL 1.16's SFTTrainer step (a transformers.Trainer step): the micro-batches of a step fetched together, "
            "the loss from TRL's fused LM head's per-token log-probs (its own code on the CPU, its Triton path "
            "modelled for a GPU; no logits held), normalised by the step's label tokens, TRL's metrics"
        )
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    elif spec.loop == "trainer":
        loop = (
            "the transformers.Trainer step: the micro-batches of a step fetched together, the loss computed inside "
            "the model's forward from labels (normalised by the step's label tokens) and the outputs released "
            "before backward"
        )
        if spec.max_grad_norm > 0:
            loop += f", gradients clipped to norm {spec.max_grad_norm:g}"
    else:
        loop = (
            "a custom loop that keeps the logits through backward (transformers' causal-LM loss on them, divided by "
            "the accumulation steps)"
        )
    if spec.autocast_dtype is None:
        precision = "no autocast (the parameters' own dtypes)"
    else:
        precision = f"{spec.autocast_dtype} autocast (torch.autocast, {device}'s op lists) around the forward"
        if spec.loop == "trainer":
            precision += ", outputs converted to fp32 after it (accelerate)"
        if spec.autocast_dtype == "float16":
            precision += ", loss scaled by a GradScaler"
    if spec.use_cache is not None:
        cache = f"use_cache={spec.use_cache}"
    else:
        cache = "use_cache=False (TrainingArguments.use_cache)" if spec.loop == "trainer" else "the config's use_cache"
    casts = (
        "; module dtypes after preparation: " + ", ".join(f"{k} -> {v}" for k, v in spec.module_dtypes)
        if spec.module_dtypes
        else ""
    )
    return (
        f"random weights from the exact config; synthetic token batches; {loop}; {precision}; {cache}; "
        f"sequential accumulation micro-steps; gradients set to None after each optimizer step{casts}"
    )


def rows_are_padded(doc: Document) -> bool:
    """Whether the declared batches pad every row to the batch's longest one
    (:attr:`ledgerspec.contract.config.Workload.pads_rows`); a batch of one row never is (:attr:`WorkloadSpec.padded`).
    """
    return config.read(doc).workload.pads_rows


def _is_4bit(p: Any) -> bool:
    return type(p).__name__ == "Params4bit"


def _empty_as(t: Any, device: Any) -> Any:
    """``torch.empty_like(t, device=device)`` for a plain tensor or parameter with the default (row-major) strides
    (every meta parameter and buffer a model is built with), made by a factory: under a fake-tensor mode
    ``empty_like`` would first convert the meta tensor into a fake one (PyTorch's meta converter, outside its dispatch
    cache, per parameter of every probe). Anything else (other strides, which ``empty_like`` keeps even where
    ``is_contiguous()`` holds, such as a channels-last tensor with a dimension of size 1; a tensor subclass, whose
    type it keeps) is made by ``empty_like`` itself."""
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.stride() != _row_major_strides(t.shape):
        return torch.empty_like(t, device=device)
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def _row_major_strides(shape: Any) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` gives (a dimension of size 0 counts as 1, as PyTorch counts it)."""
    strides: list[int] = []
    step = 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _converted_quantization_maps(opt: Any) -> list[Any]:
    """Fake copies of a bitsandbytes optimizer's quantization maps (built from real numbers), for its workload to
    keep alive beside them: PyTorch's fake mode converts every real input of an operator into a fake tensor and
    remembers the conversion only while that fake tensor is alive, so each 8-bit update converted both maps again.
    The maps themselves are unchanged (real, in the optimizer's state, counted by the tracker when they were made),
    and the optimizer gains no attribute (whatever walks its attributes sees what it saw). Empty for real
    parameters."""
    from torch._subclasses.fake_tensor import FakeTensor

    maps = getattr(opt, "name2qmap", None)
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    if not maps or not isinstance(first, FakeTensor):
        return []
    return [first.fake_mode.from_tensor(v) for v in maps.values()]


def _full_model(base: Any) -> Any:
    """The model of full fine-tuning: transformers' model itself, no PEFT wrapper. Its parameters are made frozen
    here and loaded as the base (the protocol's "load", as ``from_pretrained`` loads them), then all made trainable
    in the adapter phase, where nothing is injected (:meth:`Workload.materialise_adapters`). ``get_base_model`` is
    the model itself, as the step asks a PEFT model for its base."""
    base.requires_grad_(False)
    base.__dict__["get_base_model"] = lambda: base
    return base


def _gptq_spec(doc: Document, q: config.Quantization) -> GptqSpec:
    """The GPTQ base of ``doc``: bits, group size and act-order as declared (None: the model config's
    ``quantization_config``, read with the model, as resolve reads them), and the kernel, which only the ledger says."""
    from ledgerspec.derivations.engine.gptq import KERNELS

    path = config.QUANT
    if q.scheme == "awq":
        if q.bits is not None and q.bits != 4:
            raise _err(doc, (*path, "bits"), f"the AWQ GEMM kernel packs 4 bits, not {q.bits}")
    elif q.kernel not in KERNELS:
        raise _err(
            doc,
            (*path, "kernel") if q.kernel else path,
            f"a gptq base trains through a QuantLinear kernel the step must know: got {q.kernel or 'none'!r}",
            "declare base_model.quantization.kernel: triton_v2 (AutoGPTQ, fms-acceleration) or torch (GPTQModel 7's "
            "TorchLinear, through which transformers' GPTQ layers train)",
        )
    targets = doc.get("method", "target_modules").text()
    if targets is not None and targets.strip().lower() == "all-linear":
        raise _err(
            doc,
            ("method", "target_modules"),
            f"PEFT's all-linear matches nn.Linear and Conv1D layers only, so it finds no layer to adapt in "
            f"{'an AWQ' if q.scheme == 'awq' else 'a GPTQ'} model (its QuantLinear layers are neither; "
            "peft/tuners/tuners_utils.py, _maybe_include_all_linear_layers)",
            "list the projections, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
        )
    if q.scheme == "gptq" and q.bits is not None and q.bits not in (2, 4, 8):
        raise _err(doc, (*path, "bits"), f"the GPTQ kernels pack 2, 4 or 8 bits, not {q.bits}")
    from ledgerspec.contract.differences import OLDER
    from ledgerspec.derivations.stack.versions import declared_side, installed_side

    key = "peft-gptq-lora-input-cast"
    if q.scheme == "awq":  # one training kernel (GEMM); PEFT's AwqLoraLinear forward did not change
        return GptqSpec(q.bits, q.blocksize, False, "gemm", q.skip_modules or (), False, "awq")
    older = (declared_side(doc, key) or installed_side(key)) == OLDER
    return GptqSpec(q.bits, q.blocksize, q.desc_act, q.kernel or "", q.skip_modules or (), older)


class Workload:
    """The model, optimizer and batches of one spec; see the module docstring for the order of calls."""

    #: build a declared transformers 4's MoE layout (``stack.legacy_moe``): the estimate's simulations do; the
    #: measurement runs the installed stack
    declared_moe_layout = False

    def __init__(self, doc: Document, spec: WorkloadSpec | None = None, source: ModelSource | None = None) -> None:
        self.doc = doc
        self.spec = spec or WorkloadSpec.from_document(doc)
        self.source = source
        self.model: Any = None  # the PeftModel
        #: DPO/KTO with ``reference: model``: the trainer's ``ref_model``, a second copy of the base (else None)
        self.reference: Any = None
        self.optimizer: Any = None
        #: fake copies of a bitsandbytes optimizer's quantization maps, kept converted (_converted_quantization_maps)
        self._converted_qmaps: list[Any] = []
        #: id of a meta parameter or buffer -> what it was made as (tied weights stay tied while the first one made
        #: is alive: FSDP1 puts tied weights in one unit, flattened together). Weak values: a made
        #: tensor that nothing else holds any more is no tie to keep, and the memo must not keep it alive (FSDP1 with
        #: ``use_orig_params=False`` drops each unit's original parameters once it has flattened them: held here, a
        #: load unit by unit would keep the whole unsharded model on the device until the wrapping ends)
        self._memo: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        #: frozen parameters made in the adapter phase (DPO's reference copy of the adapter)
        self._late: set[int] = set()
        self.device: Any = None
        #: the device whose optimizer defaults to model ("cuda": torch's AdamW picks ``foreach`` there)
        self.optimizer_device: str | None = None
        self._step: Any = None

    #: DPO/KTO's separate reference model runs in accelerate's autocast region (``prepare_model``); the sharded
    #: workloads say no (TRL's ``prepare_fsdp`` wraps none)
    reference_autocast = True

    @property
    def census_model(self) -> Any:
        """What the census of held tensors walks: the model, and beside it a separate reference model (DPO/KTO's
        ``ref_model``: its frozen weights are part of the frozen base the run holds)."""
        if self.reference is None:
            return self.model
        import torch

        return torch.nn.ModuleList([self.model, self.reference])

    # -- 1. on the meta device ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build base + quantization layout + adapters on the meta device (no memory is used).

        Idempotent: a caller may prepare first, adjust the meta model (e.g. patch attention), then run the protocol.
        """
        if self.model is not None:
            return
        import torch

        spec = self.spec
        if self.source is None:
            self.source = load_config(self.doc, offline=True)
        with torch.device("meta"):  # the auto class the config calls for (stack.build.model_class)
            base = build_base(
                self.doc,
                self.source.config,
                getattr(torch, spec.loaded_dtype),
                attention=spec.attention,
                declared_moe_layout=self.declared_moe_layout,
            )
        if spec.quant is not None:
            self._replace_with_4bit(base)
        if spec.gptq is not None:
            g = spec.gptq.settled(self.source.config)
            assert g.bits is not None and g.group_size is not None
            if g.scheme == "awq":
                from ledgerspec.derivations.engine.awq import replace_with_awq_linear

                replace_with_awq_linear(base, g.bits, g.group_size, g.skip_modules)
            else:
                from ledgerspec.derivations.engine.gptq import replace_with_gptq_linear

                replace_with_gptq_linear(base, g.bits, g.group_size, g.kernel, g.skip_modules)
        if spec.prepare_kbit:
            quiet_bitsandbytes()
            import warnings

            from peft import prepare_model_for_kbit_training

            with warnings.catch_warnings():  # transformers 5 deprecates the name PEFT still calls
                warnings.simplefilter("ignore", FutureWarning)
                base = prepare_model_for_kbit_training(
                    base,
                    use_gradient_checkpointing=spec.gradient_checkpointing,
                    gradient_checkpointing_kwargs={"use_reentrant": spec.reentrant},
                )
        if spec.full:
            self.model = _full_model(base)
        elif spec.gptq is not None:
            from ledgerspec.derivations.engine import awq, gptq

            room = awq if spec.gptq.scheme == "awq" else gptq
            self.model = inject_adapters(self.doc, base, custom_modules=room.lora_custom_modules())
            if spec.gptq.older_lora:
                from ledgerspec.derivations.engine.gptq import use_older_lora_forward

                use_older_lora_forward(self.model)
        else:
            self.model = inject_adapters(self.doc, base)
        if spec.reference == "adapter_copy":
            self._reference_adapter()
        if spec.reference == "model":
            self.reference = self._reference_model()
        cast_module_dtypes(self.model, spec.module_dtypes)
        if spec.quant is not None:
            self._prewarm_bnb()

    def _reference_model(self) -> Any:
        """DPO/KTO with ``reference: model``: the ``ref_model`` TRL 1.16's ``DPOTrainer``/``KTOTrainer`` is handed (or
        builds, ``create_model_from_path`` with the policy's dtype and quantization config: dpo_trainer.py:908-929,
        kto_trainer.py:919-940): a second copy of the base as declared (the same dtype, the same 4-bit layout), no
        adapters, never prepared for k-bit training, frozen (no optimizer sees it; its forward runs without grad,
        dpo_trainer.py:1327-1338), in eval mode (``from_pretrained`` leaves it so; ``prepare_model(...,
        evaluation_mode=True)``, dpo_trainer.py:990, neither changes the mode nor wraps it). Built on the meta device,
        created with the base (:meth:`materialise_base`): it is on the device for the whole run."""
        import torch

        assert self.source is not None
        with torch.device("meta"):
            ref = build_base(
                self.doc,
                self.source.config,
                getattr(torch, self.spec.loaded_dtype),
                attention=self.spec.attention,
                declared_moe_layout=self.declared_moe_layout,
            )
        if self.spec.quant is not None:
            self._replace_with_4bit(ref)
            # transformers' bitsandbytes replacement makes the 4-bit layers' biases in the default dtype (float32);
            # ``from_pretrained`` loads them in the model's dtype (the policy's are cast so at its first forward,
            # Linear4bit.forward, nn/modules.py:630-634, after the reference model is held): loaded as the user's
            # reference model is, before the first step
            dtype = getattr(torch, self.spec.loaded_dtype)
            for module in ref.modules():
                bias = getattr(module, "bias", None)
                if _is_4bit(getattr(module, "weight", None)) and bias is not None and bias.dtype != dtype:
                    module.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        ref.requires_grad_(False)
        ref.eval()
        return ref

    def _replace_with_4bit(self, base: Any) -> None:
        quiet_bitsandbytes()
        import torch
        from transformers import BitsAndBytesConfig
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.base import HfQuantizer

        q = self.spec.quant
        assert q is not None
        bnb_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q.quant_type,
            bnb_4bit_use_double_quant=q.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, q.compute_dtype),
            bnb_4bit_quant_storage=getattr(torch, q.storage_dtype),
            llm_int8_skip_modules=list(q.skip_modules) if q.skip_modules is not None else None,
        )
        skip = HfQuantizer.get_modules_to_not_convert(
            base, bnb_config.llm_int8_skip_modules, getattr(base, "_keep_in_fp32_modules", None)
        )
        replace_with_bnb_linear(base, modules_to_not_convert=skip, quantization_config=bnb_config)
        for module in base.modules():
            w = getattr(module, "weight", None)
            if w is not None and _is_4bit(w) and q.blocksize:
                w.blocksize = q.blocksize
        base.is_loaded_in_4bit = True  # what transformers' quantizer sets; PEFT's kbit preparation reads it
        base.config.quantization_config = bnb_config

    def _prewarm_bnb(self) -> None:
        """Build bitsandbytes' cached quantization maps with real tensors (fake tensors cannot build them)."""
        quiet_bitsandbytes()
        import bitsandbytes.functional as bnbf
        import torch

        q = self.spec.quant
        assert q is not None
        w = torch.zeros(128, 64, dtype=getattr(torch, self.spec.loaded_dtype))
        bnbf.quantize_4bit(
            w,
            blocksize=q.blocksize or 64,
            compress_statistics=q.double_quant,
            quant_type=q.quant_type,
            quant_storage=getattr(torch, q.storage_dtype),
        )

    # -- 2./3. materialisation -------------------------------------------------------------------------------------
    def materialise_base(self, device: Any) -> None:
        """Create the base model's parameters and buffers on ``device`` (the protocol's "load")."""
        self.device = device
        self._materialise(device, adapters=False)
        self._init_base(self.model.get_base_model())
        if self.reference is not None:
            for module in self.reference.modules():
                self._materialise_module(module, device, adapters=False)
            self._init_base(self.reference)
            for module in self.reference.modules():
                if hasattr(module, "support_avx512bf16_for_cpu"):
                    # bitsandbytes' Linear4bit repacks its weight for good at the first forward in eval mode without
                    # grad on a CPU with AVX512-BF16 (nn/modules.py:613-620, bitsandbytes 0.50): a CPU-only layout a
                    # GPU never makes; the reference model keeps the layout of the GPU run
                    module.support_avx512bf16_for_cpu = False

    def materialise_adapters(self, device: Any) -> None:
        """Create the adapter weights on ``device``; enable gradient checkpointing (the protocol's "inject")."""
        import torch

        self._materialise(device, adapters=True)
        target = getattr(torch, self.spec.adapter_dtype) if self.spec.adapter_dtype else None
        if self.spec.full:  # the loaded weights become the trained ones: nothing is created
            for p in self.model.parameters():
                p.requires_grad_(p.is_floating_point())
        # a reward model's trainable copy of its score head keeps the base's dtype (PEFT upcasts adapter layers only,
        # tuners_utils.cast_adapter_dtype), unless TRL casts every trainable parameter of a quantized base to
        # bfloat16 (reward_trainer.py:549-554), which adapter.dtype then says
        keep = (
            {id(p) for n, p in self.model.named_parameters() if ".modules_to_save." in n}
            if self.spec.objective == "reward" and self.spec.quant is None
            else set()
        )
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad and not self.spec.full:
                    if target is not None and p.dtype != target and id(p) not in keep:
                        p.data = p.data.to(target)
                    p.normal_(0.0, 0.02)
        if self.spec.gradient_checkpointing:
            base = self.model.get_base_model()
            enable = getattr(base, "activation_checkpointing_enable", None)
            kwargs = {"use_reentrant": self.spec.reentrant}
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:  # older transformers
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.train()

    def _reference_adapter(self) -> None:
        """DPO with ``reference: adapter_copy``: TRL 1.16's ``DPOTrainer`` handed a PEFT model adds a copy of its
        adapter named ``ref`` (``model.add_adapter("ref", default_config)``, then the values copied in place:
        dpo_trainer.py:666-691); PEFT makes it frozen (the active adapter stays ``default``) in its own dtype. Added
        on the meta device with the other adapters, created with them (:meth:`materialise_adapters`)."""
        import warnings

        import torch

        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            self.model.add_adapter("ref", self.model.peft_config["default"])
        self._late = {id(p) for n, p in self.model.named_parameters() if ".ref." in n}

    def _materialise(self, device: Any, adapters: bool) -> None:
        for module in self.model.modules():
            self._materialise_module(module, device, adapters)

    def _materialise_module(self, module: Any, device: Any, adapters: bool) -> None:
        """One module's own meta parameters (the adapter's, or the others) and, with the others, its own buffers."""
        for pname, p in list(module._parameters.items()):
            # after injection the trainable parameters are exactly the adapter's (PEFT froze the rest); a frozen
            # reference adapter is made with them
            if p is None or not p.is_meta or (p.requires_grad or id(p) in self._late) != adapters:
                continue
            module._parameters[pname] = self._new_param(p, device, module)
        if adapters:
            return
        for bname, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                new = self._memo.get(id(b))
                if new is None:
                    new = _empty_as(b, device)
                    if new.is_floating_point():
                        new.zero_()
                    self._memo[id(b)] = new
                module._buffers[bname] = new

    def _new_param(self, p: Any, device: Any, module: Any) -> Any:
        import torch

        hit = self._memo.get(id(p))
        if hit is not None:  # tied weights stay tied
            return hit
        if _is_4bit(p):
            quiet_bitsandbytes()
            import bitsandbytes as bnb

            dense = torch.empty(p.shape, dtype=getattr(torch, self.spec.loaded_dtype), device=device)
            with torch.no_grad():
                dense.normal_(0.0, 0.02)
            from torch._subclasses.fake_tensor import is_fake

            if not is_fake(dense):
                new = bnb.nn.Params4bit(
                    dense,
                    requires_grad=False,
                    blocksize=p.blocksize,
                    compress_statistics=p.compress_statistics,
                    quant_type=p.quant_type,
                    quant_storage=p.quant_storage,
                    module=module,
                )._quantize(device)
            else:  # a FakeTensor cannot become a Params4bit: quantize it and carry the same attributes
                w4, state = bnb.functional.quantize_4bit(
                    dense,
                    blocksize=p.blocksize,
                    compress_statistics=p.compress_statistics,
                    quant_type=p.quant_type,
                    quant_storage=p.quant_storage,
                )
                new = torch.nn.Parameter(w4, requires_grad=False)
                for attr, value in (
                    ("quant_state", state),
                    ("blocksize", p.blocksize),
                    ("quant_type", p.quant_type),
                    ("compress_statistics", p.compress_statistics),
                    ("bnb_quantized", True),
                    ("quant_storage", p.quant_storage),
                    ("module", module),
                ):
                    setattr(new, attr, value)
                module.quant_state = state
            del dense
        else:
            data = _empty_as(p, device)
            with torch.no_grad():
                if data.is_floating_point():
                    data.normal_(0.0, 0.02)
                else:
                    data.zero_()
            new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
        self._memo[id(p)] = new
        return new

    def _init_base(self, base: Any) -> None:
        """Recompute computed buffers (rotary frequencies) of ``base`` with transformers' own initialiser."""
        import torch

        init = getattr(base, "_init_weights", None)
        if init is None:
            return
        with torch.no_grad():
            for module in base.modules():
                if "RotaryEmbedding" in type(module).__name__ and not any(b.is_meta for b in module.buffers()):
                    init(module)

    # -- 4. optimizer --------------------------------------------------------------------------------------------
    def make_optimizer(self) -> Any:
        """The declared optimizer over the trainable parameters, built as the transformers Trainer builds it."""
        import torch

        params: Any = self._param_groups()
        name = self.spec.optimizer
        bnb_kwargs: dict[str, Any] = {}
        if self.spec.min_8bit_size is not None:
            bnb_kwargs["min_8bit_size"] = self.spec.min_8bit_size
        # torch picks foreach (multi-tensor) kernels by default only for CUDA tensors: ask for them when CUDA is the
        # device being modelled on CPU tensors (their temporaries are those of the CUDA run)
        foreach = True if self.optimizer_device == "cuda" and self.device_type == "cpu" else None
        if name == "adamw_torch":
            opt: Any = torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=foreach)
        elif name == "adamw_torch_fused":
            opt = torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
        elif name == "adam":
            opt = torch.optim.Adam(params, lr=LEARNING_RATE, foreach=foreach)
        elif name == "sgd":
            opt = torch.optim.SGD(params, lr=LEARNING_RATE, foreach=foreach)
        elif name == "adafactor":
            from transformers.optimization import Adafactor

            opt = Adafactor(params, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
        else:
            quiet_bitsandbytes()
            import bitsandbytes as bnb
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            bits = 32 if name.endswith("32bit") else 8
            with unset_fake_temporarily():  # its quantization maps are built from real numbers (no-op when not fake)
                opt = bnb.optim.AdamW(
                    params, lr=LEARNING_RATE, optim_bits=bits, is_paged=name.startswith("paged"), **bnb_kwargs
                )
            self._converted_qmaps = _converted_quantization_maps(opt)
        self.optimizer = opt
        return opt

    def _param_groups(self) -> Any:
        """The trainable parameters as the optimizer gets them: under the Trainer loop in its two groups
        (``Trainer.create_optimizer``: weight decay for all but biases and norm weights, as
        ``get_decay_parameter_names`` names them; an empty group is left out), else one list."""
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.spec.loop != "trainer":
            return [p for _, p in params]
        import re

        no_decay = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
        decay = [p for n, p in params if not no_decay.search(n.lower())]
        other = [p for n, p in params if no_decay.search(n.lower())]
        return [
            g for g in ({"params": decay, "weight_decay": 0.0}, {"params": other, "weight_decay": 0.0}) if g["params"]
        ]

    # -- 5. micro-steps ------------------------------------------------------------------------------------------
    def batch(self, seq_len: int) -> tuple[Any, Any]:
        """A synthetic batch ``microbatch x seq_len``: (inputs, labels).

        Unpadded (:attr:`WorkloadSpec.padded` false): inputs are the token ids, labels a copy of them. Padded:
        inputs are ``{"input_ids", "attention_mask"}`` as a padding collator makes them (int64 mask, right
        padding); every row is ``seq_len`` tokens except the last, one token shorter: its last position is
        padding (mask 0, label -100). The worst representative padded batch: the longest row sets the shape and
        one shorter row makes the mask non-trivial, which changes the attention path (explicit 4-D mask; SDPA
        repeats k/v to all heads and CUDA runs the memory-efficient kernel instead of flash).
        """
        import torch

        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (self.spec.microbatch, seq_len), device=self.device)
        if not self.spec.padded or seq_len < 2:
            return ids, ids.clone()
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0
        labels = ids.clone()
        labels[-1, -1] = -100
        return {"input_ids": ids, "attention_mask": mask}, labels

    def trainer_batch(self, seq_len: int) -> dict[str, Any]:
        """A micro-batch as the Trainer's collators hand it over (transformers' and TRL's
        ``DataCollatorForLanguageModeling``): ``input_ids``, ``attention_mask`` (all ones unless padded; none with
        packing or padding-free batching) and ``labels`` (-100 on padding)."""
        import torch

        inputs, labels = self.batch(seq_len)
        if isinstance(inputs, dict):
            return {**inputs, "labels": labels}
        out = {"input_ids": inputs}
        if self.spec.pads_rows:
            out["attention_mask"] = torch.ones_like(inputs)
        out["labels"] = labels
        return out

    def prompt_length(self, seq_len: int) -> int:
        """DPO: the synthetic rows' prompt tokens (at least one): ``seq_len`` minus the declared completion length."""
        completion = min(self.spec.completion or seq_len - 1, seq_len - 1)
        return max(seq_len - completion, 1)

    def completion_counts(self, seq_len: int) -> tuple[int, int]:
        """DPO: the completion positions (the shifted labels that are not -100) of the chosen rows and of the
        rejected rows of one synthetic batch (:meth:`preference_batch`)."""
        chosen = seq_len - self.prompt_length(seq_len)
        return self.spec.microbatch * chosen, self.spec.microbatch * max(chosen - 1, 0)

    def kto_rows(self, seq_len: int) -> tuple[list[int], list[int], int]:
        """KTO: the synthetic micro-batch's completion lengths, its KL batch's (each row's completion is the previous
        row's, rotated within the batch as TRL's dataset preparation pairs them, kto_trainer.py:1140-1157) and the
        prompt length: every row ``seq_len`` tokens but the last, a token shorter when there are several (a padded
        batch, as a real one is)."""
        b, prompt = self.spec.microbatch, self.prompt_length(seq_len)
        full = seq_len - prompt
        completions = [full] * b
        if b > 1:
            completions[-1] = full - 1
        return completions, [completions[-1], *completions[:-1]], prompt

    def head_positions(self, seq_len: int, rows: int | None = None) -> int:
        """The completion positions TRL's fused head scores in one forward of a synthetic batch ``seq_len`` wide
        (its GPU path gathers these only): DPO's chosen and rejected rows, KTO's rows (its KL rows hold the same
        completions, rotated)."""
        if self.spec.objective in GENERATING:  # `labels[:, :-logits_to_keep] = -100` (grpo_trainer.py:1493)
            return (rows or self.spec.microbatch) * min(int(self.spec.completion or seq_len - 1), seq_len - 1)
        if self.spec.objective == "kto":
            return sum(self.kto_rows(seq_len)[0])
        return sum(self.completion_counts(seq_len))

    def kto_chosen(self) -> int:
        """KTO: the desirable rows of a synthetic micro-batch (the first half, rounded up; ``label`` true)."""
        return (self.spec.microbatch + 1) // 2

    def kto_batch(self, seq_len: int) -> dict[str, Any]:
        """A KTO micro-batch as TRL's ``DataCollatorForUnpairedPreference`` hands it over (kto_trainer.py:161-207,
        TRL 1.16): ``input_ids``, ``attention_mask`` and ``completion_mask`` of the rows (prompt + completion, padded on
        the right), the same three of the KL rows (``KL_`` prefix), int64; with precomputed reference log-probs
        ``ref_logps`` and ``ref_KL_logps`` (float32); ``label`` (bool, the desirable rows first, :meth:`kto_chosen`)."""
        import torch

        b = self.spec.microbatch
        completions, kl, prompt = self.kto_rows(seq_len)
        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        out: dict[str, Any] = {}
        for prefix, lengths in (("", completions), ("KL_", kl)):
            width = prompt + max(lengths)
            ids = torch.randint(0, vocab, (b, width), device=self.device)
            attention = torch.ones((b, width), dtype=torch.long, device=self.device)
            completion = torch.zeros((b, width), dtype=torch.long, device=self.device)
            for row, n in enumerate(lengths):
                attention[row, prompt + n :] = 0
                completion[row, prompt : prompt + n] = 1
            out.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": attention})
            out[f"{prefix}completion_mask"] = completion
        if self.spec.reference == "precomputed":
            out["ref_logps"] = torch.zeros((b,), dtype=torch.float32, device=self.device)
            out["ref_KL_logps"] = torch.zeros((b,), dtype=torch.float32, device=self.device)
        label = torch.zeros((b,), dtype=torch.bool, device=self.device)
        label[: self.kto_chosen()] = True
        out["label"] = label
        return out

    def orpo_batch(self, seq_len: int) -> dict[str, Any]:
        """An ORPO micro-batch as TRL's ``DPODataCollatorWithPadding`` hands over ``ORPOTrainer.tokenize_row``'s rows
        (trl/experimental/utils.py, orpo_trainer.py:458-603, TRL 1.16): ``chosen_input_ids``, ``chosen_attention_mask``,
        ``chosen_labels`` (-100 on the prompt) of the ``microbatch`` chosen rows (``seq_len`` tokens), the same three of
        the rejected rows (a token shorter), ``prompt_input_ids`` and ``prompt_attention_mask``, int64."""
        import torch

        b, prompt = self.spec.microbatch, self.prompt_length(seq_len)
        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        out: dict[str, Any] = {}
        for kind, length in (("chosen", seq_len), ("rejected", seq_len - 1)):
            ids = torch.randint(0, vocab, (b, length), device=self.device)
            out[f"{kind}_input_ids"] = ids
            out[f"{kind}_attention_mask"] = torch.ones((b, length), dtype=torch.long, device=self.device)
            labels = ids.clone()
            labels[:, :prompt] = -100
            out[f"{kind}_labels"] = labels
        out["prompt_input_ids"] = torch.randint(0, vocab, (b, prompt), device=self.device)
        out["prompt_attention_mask"] = torch.ones((b, prompt), dtype=torch.long, device=self.device)
        return out

    def reward_batch(self, seq_len: int) -> dict[str, Any]:
        """A reward model's micro-batch as TRL's ``reward_trainer.DataCollatorForPreference`` hands it over
        (reward_trainer.py:203-229, TRL 1.16): the ``microbatch`` chosen rows (``seq_len`` tokens), then the rejected
        ones (a token shorter, padded on the right), ``input_ids`` and ``attention_mask``, int64; no labels."""
        import torch

        b = self.spec.microbatch
        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (2 * b, seq_len), device=self.device)
        attention = torch.ones((2 * b, seq_len), dtype=torch.long, device=self.device)
        attention[b:, -1] = 0
        return {"input_ids": ids, "attention_mask": attention}

    def preference_batch(self, seq_len: int) -> dict[str, Any]:
        """A DPO micro-batch as TRL's ``DataCollatorForPreference`` hands it over (dpo_trainer.py:146-200, TRL 1.16):
        the ``microbatch`` chosen rows (prompt + completion, ``seq_len`` tokens), then the rejected ones (a token
        shorter, padded: a real pair's completions differ in length), ``input_ids``, ``attention_mask``,
        ``completion_mask`` (int64); with precomputed reference log-probs the two float32 columns the dataset
        carries (``torch.tensor`` of the rows' floats)."""
        import torch

        b, prompt = self.spec.microbatch, self.prompt_length(seq_len)
        vocab = int(self.model.get_base_model().config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (2 * b, seq_len), device=self.device)
        attention = torch.ones((2 * b, seq_len), dtype=torch.long, device=self.device)
        attention[b:, -1] = 0
        completion = torch.ones((2 * b, seq_len), dtype=torch.long, device=self.device)
        completion[:, :prompt] = 0
        completion[b:, -1] = 0
        out = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
        if self.spec.reference == "precomputed":
            out["ref_chosen_logps"] = torch.zeros((b,), dtype=torch.float32, device=self.device)
            out["ref_rejected_logps"] = torch.zeros((b,), dtype=torch.float32, device=self.device)
        return out

    @property
    def trl_head_runs_here(self) -> bool:
        """SFT with TRL's fused LM head declared (``software.kernels.cross_entropy: trl_chunked_nll``) under the Trainer
        loop: the step runs TRL's own head (:mod:`ledgerspec.derivations.engine.trl_sft`)."""
        s = self.spec
        return s.objective == "sft" and s.loop == "trainer" and s.kernels.cross_entropy == "trl_chunked_nll"

    def fused_lm_head(self, outputs: tuple[str, ...] | None = None, model: Any = None) -> None:
        """TRL's fused LM head on the base model (``add_fused_lm_head``, as ``DPOTrainer.__init__`` and
        ``SFTTrainer.__init__`` patch it, dpo_trainer.py:955-960, sft_trainer.py:1142-1147): TRL's own code, its torch
        path on the CPU; ``outputs``: the per-token fields (None: DPO's); ``model``: another model to patch (the
        reference model, with TRL's default fields, dpo_trainer.py:961-962)."""
        try:
            from trl.trainer.utils import add_fused_lm_head
        except ImportError:
            raise _err(
                self.doc,
                ("training", "objective")
                if self.spec.objective in REFERENCED
                else ("software", "kernels", "cross_entropy"),
                "the step runs TRL's own fused LM head on the CPU (DPO, or SFT with trl_chunked_nll), and TRL is "
                "not installed",
                "pip install 'trl>=1.16' (or estimate for the GPU: the default target models TRL's Triton path)",
            ) from None
        from ledgerspec.derivations.kernels.trl import DPO_OUTPUTS

        add_fused_lm_head(model if model is not None else self.model.get_base_model(), outputs=outputs or DPO_OUTPUTS)

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the model's forward receives of a batch (the estimate drops the mask for FlashAttention)."""
        return batch

    def cache_kwargs(self) -> dict[str, Any]:
        """``use_cache`` as declared; undeclared, what the loop leaves: the Trainer sets the model config's
        ``use_cache`` to ``TrainingArguments.use_cache`` (default False; trainer.py, "Finalize"), a custom loop
        keeps the config's value (nothing passed)."""
        if self.spec.use_cache is not None:
            return {"use_cache": self.spec.use_cache}
        return {"use_cache": False} if self.spec.loop == "trainer" else {}

    def saved_tensors(self) -> Any:
        """The context one micro-step (forward to backward) runs in: what happens to the tensors it saves for
        backward (nothing here; the estimate models activation offloading)."""
        import contextlib

        return contextlib.nullcontext()

    @property
    def step(self) -> Any:
        """The declared loop (:mod:`ledgerspec.derivations.engine.step`), one object for the whole run."""
        if self._step is None:
            self._step = self.step_class()(self)
        return self._step

    @contextlib.contextmanager
    def generating(self) -> Iterator[Any]:
        """The model GRPO's and RLOO's ``generate`` runs on, as TRL's ``unwrap_model_for_generation`` hands it over
        (trl/models/utils.py 134-154): on one device (and under FSDP2, ZeRO-1/2) the model itself; the sharded
        workloads that gather for it override this (ZeRO-3: every parameter, FSDP1: the root unit's)."""
        yield self.model

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """What TRL gathers around vLLM's weight sync (``VLLMGeneration._iter_named_params``: ``gather_params`` of
        every parameter, generation/vllm_generation.py 441-470): nothing on one device (and under ZeRO-1/2); ZeRO-3
        overrides it."""
        yield

    def synced(self, param: Any) -> Any:
        """What vLLM's weight sync hands over of ``param`` (``VLLMGeneration._iter_named_params``): its data on one
        device and under DeepSpeed; FSDP2 overrides it."""
        return param.data

    def step_class(self) -> type:
        """The class of the declared loop: the objective's TRL trainer step, TRL's SFT step where its own head runs
        here, else the Trainer's loop or a custom one (``training.loop``)."""
        if self.spec.objective == "dpo":
            from ledgerspec.derivations.engine.preference import DPOLoop

            return DPOLoop
        if self.spec.objective == "reward":
            from ledgerspec.derivations.engine.reward import RewardLoop

            return RewardLoop
        if self.spec.objective == "kto":
            from ledgerspec.derivations.engine.kto import KTOLoop

            return KTOLoop
        if self.spec.objective == "orpo":
            from ledgerspec.derivations.engine.orpo import ORPOLoop

            return ORPOLoop
        if self.spec.objective == "cpo":
            from ledgerspec.derivations.engine.cpo import CPOLoop

            return CPOLoop
        if self.spec.objective == "grpo":
            from ledgerspec.derivations.engine.grpo import GRPOLoop

            return GRPOLoop
        if self.spec.objective == "rloo":
            from ledgerspec.derivations.engine.rloo import RLOOLoop

            return RLOOLoop
        if self.trl_head_runs_here:
            from ledgerspec.derivations.engine.trl_sft import TRLSFTLoop

            return TRLSFTLoop
        from ledgerspec.derivations.engine.step import CustomLoop, TrainerLoop

        return TrainerLoop if self.spec.loop == "trainer" else CustomLoop

    @property
    def device_type(self) -> str:
        import torch

        return torch.device(self.device).type if self.device is not None else "cpu"

    def grad_scaler_class(self) -> Any:
        """The fp16 loss scaler class accelerate creates for this workload: ``torch.amp.GradScaler`` (one device, and
        FSDP2: accelerate 1.15 ``get_fsdp2_grad_scaler``); FSDP1 overrides it."""
        import torch

        return torch.amp.GradScaler

    def grad_scaler(self) -> Any:
        """The fp16 loss scaler accelerate creates (:meth:`grad_scaler_class`), on this workload's device; under
        fake tensors one that skips the host read of ``found_inf`` (the step is taken: nothing is inf)."""
        from torch._subclasses.fake_tensor import is_fake

        scaler = self.grad_scaler_class()
        if not is_fake(next(p for p in self.model.parameters() if p.requires_grad)):
            return scaler(self.device_type)

        class FakeGradScaler(scaler):  # type: ignore[misc,valid-type]
            def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
                return optimizer.step(*args, **kwargs)

            def _amp_update_scale_cpu_(self, found_inf: Any) -> None:
                # ShardedGradScaler's update on the CPU (torch 2.13 sharded_grad_scaler.py L288-307) without its
                # host reads: nothing is inf and the growth interval (2,000 steps) is not reached; the same tensors
                tracker: Any = self._growth_tracker  # type: ignore[has-type]
                successful = tracker + 1
                _ = successful == self._growth_interval
                self._growth_tracker = successful

        return FakeGradScaler(self.device_type)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


__all__ = [
    "ATTENTION",
    "LOOPS",
    "MIXED_PRECISION",
    "OPTIMIZERS",
    "GenerationSpec",
    "QuantSpec",
    "Workload",
    "WorkloadSpec",
    "method_notes",
    "rows_are_padded",
    "sequence_shapes",
]
