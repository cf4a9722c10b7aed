"""One typed reading of a document's training configuration: method, quantization, optimizer, workload, precision.

Every derivation and every rule reads the configuration through :func:`read` (memoised on the document until it
is edited), so that two parts of ledgerspec can never disagree on what a ledger says. The reading is lenient: an
absent, UNKNOWN or unreadable value is None, and the places that need a value ask for it with a ``require_*``
method, which raises one :class:`~ledgerspec.errors.LedgerspecError` at the field's line. Disagreements between
fields are collected in :attr:`Config.conflicts` (rule LS032 reports them). No torch: this is the contract.

The one answer to "is the base quantized?" is :attr:`Quantization.quantized`: ``base_model.quantized`` when it is
given, else ``method.kind == QLoRA``. ``method.kind: QLoRA`` with ``base_model.quantized: false`` is a conflict, and
so is ``method.kind: full`` (every weight trained) on a quantized base.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import dtypes
from ledgerspec.contract.document import Document, error_at
from ledgerspec.contract.optimizers import OptimizerSpec, optimizer_spec
from ledgerspec.contract.values import Value
from ledgerspec.errors import LedgerspecError

Path = tuple[str, ...]
QUANT: Path = ("base_model", "quantization")
#: ``method.kind`` of full fine-tuning: every parameter trainable, gradients and optimizer state for all of them
FULL = "full"
#: the bitsandbytes 4-bit block size when none is declared (``Params4bit``'s default)
BNB4_BLOCKSIZE = 64
#: bitsandbytes' default ``bnb_4bit_quant_storage``
DEFAULT_STORAGE = "uint8"
#: quantization types of bases quantized by other libraries than bitsandbytes (``quantization.type`` values)
OTHER_SCHEMES = ("gptq", "awq", "mxfp4", "hqq", "torchao_nf4")


@dataclass(frozen=True)
class Conflict:
    """Two fields that say different things; ``path`` is where the finding points."""

    path: Path
    message: str


@dataclass(frozen=True)
class Quantization:
    """The frozen base's quantization as declared (``base_model.quantized``/``quantization``, ``method.kind``)."""

    quantized: bool
    #: ``bnb4`` (nf4/fp4), ``int8`` (LLM.int8), another library's format (:data:`OTHER_SCHEMES`: ``gptq``, ``awq``,
    #: ``mxfp4``, ``hqq``, ``torchao_nf4``), or None: not quantized, or the type is not (validly) declared
    scheme: str | None = None
    #: ``quantization.type`` as written, lower-case (``nf4``, ``fp4``, ``int8``, or anything else a user wrote)
    type: str | None = None
    bits: int | None = None
    double_quant: bool | None = None
    compute_dtype: str | None = None  # as written
    storage_dtype: str | None = None  # as written; None: bitsandbytes' default uint8
    blocksize: int | None = None
    skip_modules: tuple[str, ...] | None = None
    desc_act: bool | None = None  # gptq act-order, as written
    dequantized: bool | None = None  # mxfp4 experts dequantized at load, as written
    kernel: str | None = None  # gptq: the QuantLinear kernel (triton_v2 | torch), as written

    @property
    def four_bit(self) -> bool:
        return self.scheme == "bnb4"

    @property
    def bitsandbytes(self) -> bool:
        """Whether bitsandbytes holds the base (4-bit nf4/fp4 or LLM.int8): what the training step can build."""
        return self.scheme in ("bnb4", "int8")


@dataclass(frozen=True)
class Optimizer:
    """``optimizer.*``: the name, what the catalogue says of it, and what follows for bits and paging."""

    name: str | None  # stripped, case kept
    spec: OptimizerSpec | None  # None: not in the catalogue (or no name)
    declared_bits: int | None
    min_8bit_size: int | None
    bits_declared: bool = False  # optimizer.bits holds a known value (an integer or not)

    @property
    def key(self) -> str:
        """The name as the catalogue and the training step spell it: stripped, lower-case (``""`` when absent)."""
        return (self.name or "").strip().lower()

    @property
    def bits_in_name(self) -> int | None:
        """``8`` or ``32`` when the name spells its bits (``..._8bit``, ``..._32bit``)."""
        m = re.search(r"(8|32)bit", self.key)
        return int(m.group(1)) if m else None

    @property
    def bitsandbytes(self) -> bool:
        """A bitsandbytes optimizer (8-bit, paged or 32-bit bnb state), by the catalogue or by its name."""
        if self.spec is not None and self.spec.library == "bitsandbytes":
            return True
        n = self.key
        return "8bit" in n or "paged" in n or "bnb" in n or "32bit" in n

    @property
    def bits_known(self) -> bool:
        """Whether the state's bits follow from the name (catalogue or spelling) or are declared."""
        return self.spec is not None or self.bits_in_name is not None or self.bits_declared


@dataclass(frozen=True)
class Workload:
    """``workload.*`` as declared (None: absent or UNKNOWN)."""

    max_length: int | None
    sequence_p50: int | None
    sequence_p95: int | None
    packing: bool | None
    padding_free: bool | None
    microbatch: int | None
    gradient_accumulation: int | None
    dp_world_size: int | None
    global_batch: int | None

    @property
    def worst(self) -> int | None:
        """The worst sequence length: ``max_length`` (rows are truncated to it; one long sample pads a batch to
        it), else ``sequence_p95``."""
        return self.max_length or self.sequence_p95

    @property
    def typical(self) -> int | None:
        """The typical length: ``sequence_p50`` capped at the worst, else the worst; with packing every row is
        ``max_length`` long, so the worst."""
        worst = self.worst
        if worst is None or self.packing:
            return worst
        return min(self.sequence_p50, worst) if self.sequence_p50 else worst

    @property
    def pads_rows(self) -> bool:
        """Whether batches pad every row to the batch's longest one (the Trainer's and TRL's collators do):
        true unless ``packing`` or ``padding_free`` is true (an UNKNOWN switch counts as off, the collators'
        default). A batch of one row is never padded."""
        return not (self.packing or self.padding_free)


@dataclass(frozen=True)
class Training:
    """``training.*``: the step as it runs, with ``transformers.Trainer``'s defaults for absent keys."""

    loop: str = "trainer"  # trainer | custom
    mixed_precision: str = "no"  # no | bf16 | fp16
    use_cache: bool | None = None  # None: the model config's value
    max_grad_norm: float = 1.0  # 0: no clipping
    #: ``training.loss_item_each_step``: a custom loop reads its loss on the host after each backward
    loss_item_each_step: bool = False
    objective: str = "sft"  # sft | dpo | kto | orpo | cpo | grpo | rloo | ppo | reward
    #: ``training.objective_settings.reference`` as written (None: TRL's default for the objective)
    reference: str | None = None
    #: ``training.objective_settings.max_completion_length`` (None: not declared)
    max_completion_length: int | None = None
    #: ``training.objective_settings.disable_dropout`` (TRL's default: true)
    disable_dropout: bool = True
    #: ``training.objective_settings.center_rewards_coefficient`` (None: TRL's default, off)
    center_rewards_coefficient: float | None = None
    #: ``software.trl`` as written (None: not declared)
    trl: str | None = None
    #: GRPO/RLOO: ``objective_settings.num_generations`` (None: TRL's default 8)
    num_generations: int | None = None
    #: GRPO/RLOO: ``objective_settings.steps_per_generation`` (None: TRL's default, the accumulation steps)
    steps_per_generation: int | None = None
    #: GRPO/RLOO: ``objective_settings.generation_batch_size`` (None: TRL's default)
    generation_batch_size: int | None = None
    #: GRPO/RLOO: ``objective_settings.use_vllm`` (None: TRL's default, false)
    use_vllm: bool | None = None
    #: GRPO/RLOO with vLLM: ``objective_settings.vllm_mode`` as written (None: TRL's default, :data:`VLLM_MODE`)
    vllm_mode_declared: str | None = None
    #: GRPO/RLOO with vLLM colocated: ``objective_settings.vllm_gpu_memory_utilization`` (None: TRL's default 0.3)
    vllm_gpu_memory_utilization: float | None = None
    #: GRPO/RLOO with vLLM colocated: ``objective_settings.vllm_enable_sleep_mode`` (None: TRL's default, false)
    vllm_enable_sleep_mode: bool | None = None
    #: whether ``objective_settings.disable_dropout`` is written (GRPO's default is false, the others' true)
    disable_dropout_declared: bool = False

    @property
    def simulated(self) -> bool:
        """Whether ``estimate`` and ``measure`` simulate this objective's step (:data:`SIMULATED_OBJECTIVES`; DPO
        as TRL 1.16's ``DPOTrainer`` runs it, with its reference from the policy itself or precomputed)."""
        return self.not_simulated is None

    @property
    def not_simulated(self) -> str | None:
        """Why the step of this objective is not simulated (the one line LS014 and the step say), None when it is."""
        if self.objective not in SIMULATED_OBJECTIVES:
            return f"training.objective {self.objective}"
        if self.objective == "sft":
            return None
        if self.objective in ("dpo", "kto") and self.dpo_reference not in DPO_REFERENCES:
            return f"training.objective {self.objective} with reference {self.dpo_reference}"
        if self.objective in GENERATING:
            if self.use_vllm and self.vllm_mode not in VLLM_MODES:
                return f"training.objective {self.objective} with vllm_mode {self.vllm_mode}"
            if self.grpo_reference not in GRPO_REFERENCES:
                return f"training.objective {self.objective} with reference {self.grpo_reference}"
        from ledgerspec.contract.differences import version_tuple

        release = version_tuple(self.trl) if self.trl else None
        if release is not None and release < OBJECTIVE_TRL[self.objective]:
            # TRL's DPOTrainer before its fused LM head computed the full logits of the policy and the reference;
            # its RewardTrainer in TRL 0.x ran the chosen and the rejected rows in two forwards
            return f"training.objective {self.objective} on TRL {self.trl} (the step simulated is TRL 1.16's)"
        return None

    @property
    def vllm_mode(self) -> str | None:
        """How the completions are generated: None (transformers' ``generate``), else vLLM's mode as declared or TRL's
        default (``colocate``: ``vllm_mode``, grpo_config.py:594-595, rloo_config.py the same, TRL 1.16)."""
        if not self.use_vllm:
            return None
        return (self.vllm_mode_declared or VLLM_MODE).strip().lower()

    @property
    def vllm_share(self) -> float:
        """Colocated vLLM's share of the card: as declared, else TRL's default (``vllm_gpu_memory_utilization`` 0.3,
        grpo_config.py:656-657, TRL 1.16)."""
        share = self.vllm_gpu_memory_utilization
        return VLLM_SHARE if share is None else share

    @property
    def dpo_reference(self) -> str:
        """Where DPO's reference log-probs come from: as declared, else TRL's default for a PEFT policy
        (``adapter_disabled``: dpo_trainer.py:908-914, 1328-1336, TRL 1.16)."""
        return self.reference or "adapter_disabled"

    @property
    def grpo_reference(self) -> str:
        """GRPO's and RLOO's reference: as declared, else TRL's default: GRPO's ``beta: 0.0`` (grpo_config.py:681,
        TRL 1.16), ``none``; RLOO's ``beta: 0.05`` (rloo_config.py:502), ``adapter_disabled`` (the policy with its
        adapters off, with a ``peft_config``: grpo_trainer.py:2688-2716, rloo_trainer.py:1589-1609)."""
        return self.reference or ("adapter_disabled" if self.objective == "rloo" else "none")

    @property
    def grpo_dropout(self) -> bool:
        """GRPO's and RLOO's ``disable_dropout``: as declared, else TRL's default, false (grpo_config.py:453,
        rloo_config.py:283)."""
        return self.disable_dropout and self.disable_dropout_declared

    @property
    def autocast_dtype(self) -> str | None:
        """``bfloat16``/``float16`` under mixed precision, else None."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.mixed_precision)

    @property
    def clips(self) -> bool:
        return self.max_grad_norm > 0


#: the objectives whose step ``estimate`` and ``measure`` simulate (the others are declared for the record, LS014)
SIMULATED_OBJECTIVES = ("sft", "dpo", "reward", "kto", "orpo", "cpo", "grpo", "rloo")
#: TRL 1.16's ``peft_module_casting_to_bf16`` (trl/experimental/utils.py:950-957) as ``base_model.module_dtypes``:
#: what ``ORPOTrainer``/``CPOTrainer`` handed a 4-bit base and a ``peft_config`` cast with bf16 (and then open their
#: ``compute_loss``'s autocast region, orpo_trainer.py:262-265, 886-891)
TRL_BF16_CASTS = {"norm": "float32", "lm_head": "bfloat16", "embed_tokens": "bfloat16"}


def trl_casts_declared(module_dtypes: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``base_model.module_dtypes`` declares TRL's casts (:data:`TRL_BF16_CASTS`; other keys may be added)."""
    declared = {k: dtypes.canonical(v) for k, v in module_dtypes}
    return all(declared.get(k) == v for k, v in TRL_BF16_CASTS.items())


#: the online-RL objectives: a generation phase before the training forward
GENERATING = ("grpo", "rloo")
#: GRPO's reference kinds the simulation runs: none (``beta: 0``) or the PEFT policy with its adapters off
GRPO_REFERENCES = ("none", "adapter_disabled")
#: the vLLM modes the GRPO/RLOO step models (TRL 1.16's ``VLLMGeneration``, generation/vllm_generation.py:283-366)
VLLM_MODES = ("server", "colocate")
#: GRPOConfig's/RLOOConfig's default ``vllm_mode`` (grpo_config.py:594-595) and ``vllm_gpu_memory_utilization``
#: (grpo_config.py:656-657), TRL 1.16
VLLM_MODE, VLLM_SHARE = "colocate", 0.3
#: DPO's and KTO's reference kinds the simulation runs: the PEFT policy with its adapters off, a frozen copy of its
#: adapter (a PEFT model handed to the trainer), a separate reference model (``ref_model``: a second copy of the base,
#: loaded as the policy's) or log-probs precomputed
DPO_REFERENCES = ("adapter_disabled", "adapter_copy", "model", "precomputed")
#: the TRL release whose DPOTrainer the DPO step follows (its fused LM head); a declared older one is not simulated
DPO_TRL = (1, 16, 0)
#: the TRL release whose trainer each simulated objective's step follows; a declared older one is not simulated
OBJECTIVE_TRL = {
    "dpo": DPO_TRL,
    "reward": (1, 16, 0),
    "kto": (1, 16, 0),
    "orpo": (1, 16, 0),
    "cpo": (1, 16, 0),
    "grpo": (1, 16, 0),
    "rloo": (1, 16, 0),
}

#: ``transformers.Trainer``'s defaults, for a document without a ``training`` section
TRAINER_DEFAULTS = Training()


@dataclass(frozen=True)
class Nccl:
    """``software.nccl`` (the version) and ``parallelism.nccl.*`` as written; None: NCCL's default (the docs'
    outside-allocator catalogue, :mod:`ledgerspec.derivations.devices.outside`, says which)."""

    version: str | None = None
    buffsize: int | None = None  # NCCL_BUFFSIZE, bytes
    channels: int | None = None
    nvls_enable: bool | None = None
    runtime_connect: bool | None = None
    communicators: int | None = None


@dataclass(frozen=True)
class Runtime:
    """What the process holds on the device besides its tensors depends on: the GPU, the CUDA/ROCm and torch
    versions, the module loading mode, the ranks and NCCL's settings, the caching allocator's settings."""

    gpu_name: str | None = None
    cuda: str | None = None
    rocm: str | None = None
    torch: str | None = None
    module_loading: str = "LAZY"  # LAZY | EAGER (CUDA's default on Linux since 12.2, PyTorch's since 1.13)
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF as written; None: unset
    world_size: int = 1  # parallelism.gpu_count, else workload.dp_world_size, else 1
    nccl: Nccl = field(default_factory=Nccl)


@dataclass(frozen=True)
class Kernels:
    """``software.kernels`` as declared: one kernel id per op (lower-case; ``eager`` when absent), the fused LoRA
    kernels, the replacements named as their tools name them (``other``) and the packages' versions."""

    cross_entropy: str = "eager"
    norm: str = "eager"
    mlp_activation: str = "eager"
    rope: str = "eager"
    lora_projections: tuple[str, ...] = ()
    other: tuple[str, ...] = ()
    packages: tuple[tuple[str, str], ...] = ()

    def declared(self) -> tuple[tuple[str, str], ...]:
        """(op, kernel id) of every op whose kernel is not transformers' or PEFT's own, in the catalogue's order."""
        pairs = [(op, getattr(self, op)) for op in ("cross_entropy", "norm", "mlp_activation", "rope")]
        pairs += [("lora_projections", k) for k in self.lora_projections]
        return tuple((op, k) for op, k in pairs if k != "eager")

    @property
    def fused_loss(self) -> bool:
        """The loss never holds the logits (a fused linear cross-entropy)."""
        return self.cross_entropy in ("liger_fused_linear_cross_entropy", "cut_cross_entropy", "trl_chunked_nll")


@dataclass(frozen=True)
class Config:
    """The training configuration of one document."""

    kind: str | None  # method.kind as written: LoRA | QLoRA | full | other
    quantization: Quantization
    loaded_dtype: str | None  # as written
    adapter_dtype: str | None  # as written (``mixed`` when resolve found several)
    prepare_kbit: bool
    optimizer: Optimizer
    workload: Workload
    gradient_checkpointing: bool | None
    checkpointing_kind: str | None
    attention: str | None
    #: ``memory_options.activation_offload``: saved activations moved to host memory
    activation_offload: bool | None = None
    training: Training = TRAINER_DEFAULTS
    #: ``base_model.module_dtypes``: module-name substring -> dtype (as written), in the order written
    module_dtypes: tuple[tuple[str, str], ...] = ()
    #: ``software.accepted_differences``: ids of known stack differences the user accepts
    accepted_differences: tuple[str, ...] = ()
    conflicts: tuple[Conflict, ...] = field(default_factory=tuple)
    #: ``parallelism.deepspeed``: the ZeRO options written (DeepSpeed key -> int or bool); absent keys are
    #: DeepSpeed's defaults (:class:`ledgerspec.derivations.shard.options.ZeroOptions`)
    deepspeed: tuple[tuple[str, int | bool], ...] = ()
    #: the device runtime: what sizes the memory held outside PyTorch's caching allocator (issue 23)
    runtime: Runtime = field(default_factory=Runtime)
    #: ``software.kernels``: the kernels that replace transformers' modules in the step
    kernels: Kernels = field(default_factory=Kernels)

    @property
    def quantized(self) -> bool:
        return self.quantization.quantized

    @property
    def full(self) -> bool:
        """``method.kind: full``: every parameter trainable, no adapters (issue 26)."""
        return self.kind == FULL

    @property
    def reentrant(self) -> bool:
        """``checkpointing_kind`` starts with ``reentrant`` (the default is transformers' non-reentrant)."""
        return (self.checkpointing_kind or "non-reentrant").strip().lower().startswith("reentrant")


def read(doc: Document) -> Config:
    """The configuration of ``doc`` (memoised until the document is edited)."""
    cached = doc.memo.get("config")
    if isinstance(cached, Config):
        return cached
    config = _read(doc)
    doc.memo["config"] = config
    return config


def _read(doc: Document) -> Config:
    kind = doc.get("method", "kind").text()
    kind = kind.strip() if kind else None
    switch = doc.get("base_model", "quantized").switch()
    quantized = switch if switch is not None else kind == "QLoRA"
    conflicts: list[Conflict] = []
    if kind == "QLoRA" and switch is False:
        conflicts.append(
            Conflict(
                ("base_model", "quantized"),
                "method.kind is QLoRA (a quantized base) but base_model.quantized is false: the tools would size "
                "an unquantized base",
            )
        )
    if kind == FULL and quantized:
        conflicts.append(
            Conflict(
                ("method", "kind"),
                "method.kind is full (every weight trained) but the base is quantized: quantized weights cannot be "
                "trained, so full fine-tuning needs a floating-point base",
            )
        )
    return Config(
        kind=kind,
        quantization=_quantization(doc, quantized),
        loaded_dtype=doc.get("base_model", "loaded_dtype").text(),
        adapter_dtype=doc.get("adapter", "dtype").text(),
        prepare_kbit=bool(doc.get("base_model", "prepare_for_kbit_training").switch()),
        optimizer=Optimizer(
            doc.get("optimizer", "name").text(),
            optimizer_spec(doc.get("optimizer", "name").text() or ""),
            doc.get("optimizer", "bits").integer(),
            doc.get("optimizer", "min_8bit_size").integer(),
            doc.get("optimizer", "bits").known,
        ),
        workload=Workload(
            max_length=_int(doc, "workload", "max_length"),
            sequence_p50=_int(doc, "workload", "sequence_p50"),
            sequence_p95=_int(doc, "workload", "sequence_p95"),
            packing=doc.get("workload", "packing").switch(),
            padding_free=doc.get("workload", "padding_free").switch(),
            microbatch=_int(doc, "workload", "microbatch"),
            gradient_accumulation=_int(doc, "workload", "gradient_accumulation"),
            dp_world_size=_int(doc, "workload", "dp_world_size"),
            global_batch=_int(doc, "workload", "global_batch"),
        ),
        gradient_checkpointing=doc.get("memory_options", "gradient_checkpointing").switch(),
        checkpointing_kind=doc.get("memory_options", "checkpointing_kind").text(),
        activation_offload=doc.get("memory_options", "activation_offload").switch(),
        attention=doc.get("software", "attention_implementation").text(),
        training=_training(doc),
        module_dtypes=_strmap(doc.get("base_model", "module_dtypes")),
        accepted_differences=_strings(doc.get("software", "accepted_differences")),
        conflicts=tuple(conflicts),
        deepspeed=_deepspeed(doc),
        runtime=_runtime(doc),
        kernels=_kernels(doc),
    )


def _kernels(doc: Document) -> Kernels:
    def op(name: str) -> str:
        value = doc.get("software", "kernels", name).text()
        return value.strip().lower() if value and value.strip() else "eager"

    lora = tuple(k.strip().lower() for k in _strings(doc.get("software", "kernels", "lora_projections")) if k.strip())
    return Kernels(
        cross_entropy=op("cross_entropy"),
        norm=op("norm"),
        mlp_activation=op("mlp_activation"),
        rope=op("rope"),
        lora_projections=tuple(k for k in lora if k != "eager"),
        other=tuple(k.strip() for k in _strings(doc.get("software", "kernels", "other")) if k.strip()),
        packages=_strmap(doc.get("software", "kernels", "packages")),
    )


def _runtime(doc: Document) -> Runtime:
    def text(*path: str) -> str | None:
        value = doc.get(*path).text()
        return value.strip() if value and value.strip() else None

    loading = (text("software", "cuda_module_loading") or "LAZY").upper()
    p = ("parallelism", "nccl")
    return Runtime(
        gpu_name=text("software", "gpu_name"),
        cuda=text("software", "cuda"),
        rocm=text("software", "rocm"),
        torch=text("software", "torch"),
        module_loading=loading if loading in ("LAZY", "EAGER") else "LAZY",
        alloc_conf=doc.get("software", "pytorch_cuda_alloc_conf").text(),
        world_size=_int(doc, "parallelism", "gpu_count") or _int(doc, "workload", "dp_world_size") or 1,
        nccl=Nccl(
            version=text("software", "nccl"),
            buffsize=doc.get(*p, "buffsize").size(),
            channels=_int(doc, *p, "channels"),
            nvls_enable=doc.get(*p, "nvls_enable").switch(),
            runtime_connect=doc.get(*p, "runtime_connect").switch(),
            communicators=_int(doc, *p, "communicators"),
        ),
    )


#: ``parallelism.deepspeed`` keys: True for switches, False for element counts
DEEPSPEED_KEYS = {
    "stage3_prefetch_bucket_size": False,
    "stage3_max_live_parameters": False,
    "stage3_max_reuse_distance": False,
    "stage3_param_persistence_threshold": False,
    "reduce_bucket_size": False,
    "allgather_bucket_size": False,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "zero_force_ds_cpu_optimizer": True,  # top-level in a DeepSpeed config, not in zero_optimization
}


def _deepspeed(doc: Document) -> tuple[tuple[str, int | bool], ...]:
    out: list[tuple[str, int | bool]] = []
    for key, switch in DEEPSPEED_KEYS.items():
        v = doc.get("parallelism", "deepspeed", key)
        value = v.switch() if switch else v.integer()
        if value is not None:
            out.append((key, value))
    return tuple(out)


def _training(doc: Document) -> Training:
    def text(key: str, default: str) -> str:
        value = doc.get("training", key).text()
        return value.strip().lower() if value and value.strip() else default

    norm = doc.get("training", "max_grad_norm").number()
    return Training(
        loop=text("loop", TRAINER_DEFAULTS.loop),
        mixed_precision=text("mixed_precision", TRAINER_DEFAULTS.mixed_precision),
        use_cache=doc.get("training", "use_cache").switch(),
        max_grad_norm=float(norm) if norm is not None and norm >= 0 else TRAINER_DEFAULTS.max_grad_norm,
        loss_item_each_step=doc.get("training", "loss_item_each_step").switch() is True,
        objective=text("objective", TRAINER_DEFAULTS.objective),
        reference=(doc.get("training", "objective_settings", "reference").text() or "").strip().lower() or None,
        max_completion_length=_positive(doc.get("training", "objective_settings", "max_completion_length").number()),
        disable_dropout=doc.get("training", "objective_settings", "disable_dropout").switch() is not False,
        center_rewards_coefficient=_nonnegative(
            doc.get("training", "objective_settings", "center_rewards_coefficient").number()
        ),
        trl=doc.get("software", "trl").text(),
        num_generations=_positive(doc.get("training", "objective_settings", "num_generations").number()),
        steps_per_generation=_positive(doc.get("training", "objective_settings", "steps_per_generation").number()),
        generation_batch_size=_positive(doc.get("training", "objective_settings", "generation_batch_size").number()),
        use_vllm=doc.get("training", "objective_settings", "use_vllm").switch(),
        vllm_mode_declared=doc.get("training", "objective_settings", "vllm_mode").text(),
        vllm_gpu_memory_utilization=_nonnegative(
            doc.get("training", "objective_settings", "vllm_gpu_memory_utilization").number()
        ),
        vllm_enable_sleep_mode=doc.get("training", "objective_settings", "vllm_enable_sleep_mode").switch(),
        disable_dropout_declared=doc.get("training", "objective_settings", "disable_dropout").switch() is not None,
    )


def _nonnegative(value: float | None) -> float | None:
    return float(value) if value is not None and value >= 0 else None


def _positive(value: float | None) -> int | None:
    return int(value) if value is not None and value >= 1 else None


def _strmap(value: Value) -> tuple[tuple[str, str], ...]:
    if not value.known or not isinstance(value.value, dict):
        return ()
    return tuple((str(k), str(v)) for k, v in value.value.items() if not str(k).startswith("x-") and v is not None)


def _strings(value: Value) -> tuple[str, ...]:
    if not value.known:
        return ()
    if isinstance(value.value, str):
        return (value.value,)
    if not isinstance(value.value, list | tuple):
        return ()  # not a string or a list (the schema reports it): nothing is read from it
    return tuple(str(v) for v in value.value)


def _int(doc: Document, *path: str) -> int | None:
    return doc.get(*path).integer()


def _quantization(doc: Document, quantized: bool) -> Quantization:
    if not quantized:
        return Quantization(False)

    def get(key: str) -> Value:
        return doc.get(*QUANT, key)

    qtype = (get("type").text() or "").strip().lower() or None
    bits = get("bits").integer()
    scheme = None
    if qtype == "int8" or (qtype is None and bits == 8):
        scheme = "int8"
    elif qtype in ("nf4", "fp4"):
        scheme = "bnb4"
    elif qtype in OTHER_SCHEMES:
        scheme = qtype
    skip = get("skip_modules")
    skip_modules = None
    if skip.known:
        v = skip.value  # a name or a list of names; anything else is the schema check's finding, not a crash here
        skip_modules = (str(v),) if isinstance(v, str) else tuple(str(x) for x in v) if isinstance(v, list) else ()
    return Quantization(
        True,
        scheme,
        qtype,
        bits,
        get("double_quant").switch(),
        get("compute_dtype").text(),
        get("storage_dtype").text(),
        get("blocksize").integer(),
        skip_modules,
        get("desc_act").switch(),
        get("dequantized").switch(),
        (get("kernel").text() or "").strip().lower() or None,
    )


# -- asking for a value ---------------------------------------------------------------------------------------------


def require_dtype(doc: Document, path: Path, default: str | None = None, rule: str = "resolve") -> str:
    """The canonical dtype name at ``path`` (``bf16`` -> ``bfloat16``); one-line error for a name no table knows."""
    name = doc.get(*path).text() or default
    canon = dtypes.canonical(name) if name else None
    if canon is None:
        raise error_at(
            doc, path, f"unknown dtype {name!r}", rule=rule, hint="use float32, bfloat16, float16 (or fp32, bf16, fp16)"
        )
    return canon


#: ``parallelism.strategy`` values that select FSDP1 (``FullyShardedDataParallel``)
FSDP1_NAMES = ("fsdp1", "fsdp_v1", "fsdp-v1", "fullyshardeddataparallel")
#: the strategies under which each rank holds a share of the model state, not the whole model
SHARDED_STRATEGIES = (*FSDP1_NAMES, "fsdp", "fsdp2", "zero1", "zero2", "zero3")
#: the strategy names under which every rank (or the one process) holds the whole model: one GPU, data-parallel
#: replicas, or transformers' device_map across GPUs (one replica split by layers)
UNSHARDED_STRATEGIES = ("none", "ddp", "device_map")
#: every strategy name the commands read (lower case): the sharded ones and the unsharded ones
KNOWN_STRATEGIES = (*UNSHARDED_STRATEGIES, *SHARDED_STRATEGIES)
#: the strategies as a message lists them (FSDP1's other names are accepted too)
SHOWN_STRATEGIES = "none, ddp, device_map, fsdp1 (or FullyShardedDataParallel), fsdp2, zero1, zero2, zero3"
#: what other tools call them, squeezed (letters and digits, lower case) -> the name here
_STRATEGY_ALIASES = {
    "zero0": "ddp",  # DeepSpeed's stage 0: no sharding (the importers write ddp for it)
    "stage0": "ddp",
    "dataparallel": "ddp",
    "distributeddataparallel": "ddp",
    "multigpu": "ddp",
    "single": "none",
    "singlegpu": "none",
    "off": "none",
    "no": "none",
    "devicemap": "device_map",
    "zero1offload": "zero1",
    "zero2offload": "zero2",
    "zero3offload": "zero3",
}


def strategy_guess(name: str) -> str | None:
    """The known strategy a name that is none resembles (``zero-3``, ``ZeRO_3``, ``zero0``, ``single_gpu``), or
    None."""
    import difflib

    def squeezed_of(text: str) -> str:
        return "".join(ch for ch in text.strip().lower() if ch.isalnum())

    squeezed = squeezed_of(name)
    if squeezed in _STRATEGY_ALIASES:
        return _STRATEGY_ALIASES[squeezed]
    for known in KNOWN_STRATEGIES:
        if squeezed == squeezed_of(known):
            return known
    if squeezed.startswith(("zero", "stage")):  # a ZeRO stage other than 1-3: no near miss stands for it
        return None
    close = difflib.get_close_matches(squeezed, KNOWN_STRATEGIES, n=1, cutoff=0.6)
    return close[0] if close else None


def same_strategy(a: str, b: str) -> bool:
    """Whether two known strategy names mean the same sharding (FSDP1's names; ``fsdp`` is FSDP2; none, ddp and
    device_map all shard nothing, as ``memory_options.sharding: none`` beside ``strategy: ddp`` says)."""

    def kind(n: str) -> str:
        return "fsdp1" if n in FSDP1_NAMES else "fsdp2" if n == "fsdp" else "none" if n in UNSHARDED_STRATEGIES else n

    return kind(a) == kind(b)


def declared_strategy(doc: Document) -> str:
    """How the ranks share the model, as declared: ``parallelism.strategy``, else (absent or blank)
    ``memory_options.sharding``, stripped and lower-cased ("" when neither is declared). Every reader of the strategy
    reads it here (FSDP1's names, ZeRO's stages, the sharded strategies)."""
    for path in (("parallelism", "strategy"), ("memory_options", "sharding")):
        text = (doc.get(*path).text() or "").strip().lower()
        if text:
            return text
    return ""


def sharded_ranks(doc: Document) -> int | None:
    """How many ranks share the model state: ``parallelism.gpu_count`` when it is 2 or more and the strategy
    (:func:`declared_strategy`) shards it (:data:`SHARDED_STRATEGIES`); None otherwise (one GPU, data parallel, or
    not declared). Under it, one GPU's estimate of the whole model is not what a rank holds: ``shard --estimate``
    predicts that."""
    gpus = _int(doc, "parallelism", "gpu_count")
    if gpus is None or gpus < 2 or declared_strategy(doc) not in SHARDED_STRATEGIES:
        return None
    return gpus


def problem(doc: Document, path: Path, message: str, rule: str, hint: str | None = None, **kw: Any) -> LedgerspecError:
    """A one-line error at ``path`` (its nearest present ancestor), for a value a command needs."""
    return error_at(doc, path, message, rule=rule, hint=hint, **kw)


__all__ = [
    "BNB4_BLOCKSIZE",
    "DEFAULT_STORAGE",
    "FULL",
    "KNOWN_STRATEGIES",
    "OTHER_SCHEMES",
    "QUANT",
    "SHARDED_STRATEGIES",
    "SHOWN_STRATEGIES",
    "TRAINER_DEFAULTS",
    "UNSHARDED_STRATEGIES",
    "Config",
    "Conflict",
    "Nccl",
    "Optimizer",
    "Quantization",
    "Runtime",
    "Training",
    "Workload",
    "declared_strategy",
    "problem",
    "read",
    "require_dtype",
    "same_strategy",
    "sharded_ranks",
    "strategy_guess",
]
