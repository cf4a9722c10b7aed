"""The field catalogue: every section and key of ``ledger/v1`` and ``intake/v1``.

This table is the single source of truth. ``schema/*.json`` is generated from it
(``python -m ledgerspec.contract.schema_gen``), the docs' field reference is generated from
the schema, and the validator reads kinds (figure, switch, size...) from here.
Descriptions paraphrase the method article ("Сервер для LoRA и QLoRA: Как рассчитать VRAM для дообучения LLM").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

# Kinds of value a field holds.
MEMORY = "memory"  # (F) bytes: integer or a string with a unit; carries a source
COUNT = "count"  # (F) a non-negative integer count (parameters); carries a source
SECONDS = "seconds"  # (F) a duration in seconds; carries a source
SIZE = "size"  # a size that is a declared input (device memory), not a figure
INT = "int"
NUMBER = "number"
STRING = "string"
SWITCH = "switch"  # true/false, ON/OFF, YES/NO (any case)
ENUM = "enum"
STRINGS = "strings"  # a string or a list of strings
INTMAP = "intmap"  # mapping pattern -> integer
NUMMAP = "nummap"  # mapping pattern -> number
STRMAP = "strmap"  # mapping pattern -> string
OBJECT = "object"  # a nested mapping of fields
FIGURES = "figures"  # (F) a list of memory figures
ANY = "any"  # free-form (candidate configuration, known explanation)

FIGURE_KINDS = frozenset({MEMORY, COUNT, SECONDS, FIGURES})

SOURCES = ("MEASURED", "VERIFIED", "CALCULATED", "ASSUMPTION", "CONFIGURATION-SPECIFIC", "UNKNOWN")
STATUSES = ("INSUFFICIENT DATA", "CALCULATED", "CANDIDATE", "VALIDATED")
#: the ledger's memory components (spec, "Why the ledger exists"): the four resident ones come first, exact from the
#: configuration; activations and temporaries depend on the step
RESIDENT = ("frozen_base", "adapter", "gradients", "optimizer")
COMPONENTS = (*RESIDENT, "activations", "temporary")
PHASES_OOM = (
    "load",
    "adapter_injection",
    "optimizer_init",
    "forward",
    "loss",
    "backward",
    "optimizer_step",
    "evaluation",
    "later_iteration",
)


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    description: str
    enum: tuple[str, ...] = ()
    minimum: float | None = None
    children: tuple[Field, ...] = field(default_factory=tuple)

    @property
    def figure(self) -> bool:
        return self.kind in FIGURE_KINDS

    def child(self, name: str) -> Field | None:
        for f in self.children:
            if f.name == name:
                return f
        return None


def F(
    name: str,
    kind: str,
    description: str,
    *,
    enum: tuple[str, ...] = (),
    minimum: float | None = None,
    children: tuple[Field, ...] = (),
) -> Field:
    return Field(name, kind, description, enum, minimum, children)


_SRC = (
    "Accepted sources: MEASURED (a real run), VERIFIED (read off the instantiated stack), "
    "CALCULATED (formula from exact inputs; `method` says how), ASSUMPTION (needs a `note`)."
)
_MEM = "Bytes as an integer, or a string with a unit (B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary). "

IDENTITY = F(
    "identity",
    OBJECT,
    "Which exact model: a marketing label like '14B' does not determine memory; "
    "the exact model id and revision (or config hash) do.",
    children=(
        F(
            "model_id",
            STRING,
            "Exact model repository id, e.g. `meta-llama/Llama-2-7b-hf`. Part of the minimum intake.",
        ),
        F(
            "revision",
            STRING,
            "Exact revision (commit hash or tag) of the model repository. The minimum intake needs "
            "`revision` or `config_sha256`.",
        ),
        F(
            "config_path",
            STRING,
            "Local `config.json` (or a folder holding it), relative to this document; used by "
            "`ledgerspec resolve` instead of the Hub.",
        ),
        F(
            "config_sha256",
            STRING,
            "SHA-256 of the exact `config.json` bytes; pins the architecture when no revision is known.",
        ),
        F(
            "architecture",
            STRING,
            "The transformers architecture class, e.g. `LlamaForCausalLM` (read from the config).",
        ),
        F(
            "total_parameters",
            COUNT,
            "Logical number of model parameters (not the packed 4-bit storage count). "
            "VERIFIED when read off the instantiated model. " + _SRC,
            minimum=0,
        ),
    ),
)

SOFTWARE = F(
    "software",
    OBJECT,
    "The exact software stack: memory behaviour changes between versions of each "
    "of these, so a measured figure is only reproducible with them.",
    children=(
        F("torch", STRING, "PyTorch version."),
        F("transformers", STRING, "transformers version."),
        F("peft", STRING, "PEFT version."),
        F("trl", STRING, "TRL version, if its trainer is used."),
        F("bitsandbytes", STRING, "bitsandbytes version (quantization and 8-bit optimizers)."),
        F("accelerate", STRING, "Accelerate version."),
        F("cuda", STRING, "CUDA runtime version PyTorch was built with."),
        F("rocm", STRING, "ROCm/HIP version PyTorch was built with."),
        F("driver", STRING, "GPU driver version."),
        F(
            "attention_implementation",
            STRING,
            "transformers `attn_implementation` (eager, sdpa, flash_attention_2, "
            "...): eager attention materialises the batch x heads x seq^2 score matrix, fused kernels do not.",
        ),
        F(
            "kernel_backend",
            STRING,
            "Other kernel backend in use (e.g. Liger, Unsloth kernels), if any, in words; `kernels` says which op "
            "each replaces.",
        ),
        F(
            "kernels",
            OBJECT,
            "The kernels that replace transformers' own modules in the step, per op (docs: The kernels users switch "
            "on). Each value is a kernel id from the docs' kernel catalogue (e.g. `liger_fused_linear_cross_entropy`, "
            "`cut_cross_entropy`, `liger_rms_norm`), or `eager` for transformers' module. Absent: `eager` "
            "everywhere. A kernel ledgerspec does not model, or does not know, is a finding (LS013), never silence.",
            children=(
                F(
                    "cross_entropy",
                    STRING,
                    "The loss over the vocabulary: `eager` (transformers' `lm_head` then its causal-LM loss on the "
                    "logits), or a fused linear cross-entropy that never holds the logits "
                    "(`liger_fused_linear_cross_entropy`, `cut_cross_entropy`, `trl_chunked_nll`), or Liger's "
                    "`liger_cross_entropy` on the logits.",
                ),
                F("norm", STRING, "The RMSNorm/LayerNorm modules: `eager`, `liger_rms_norm`, `liger_layer_norm`."),
                F("mlp_activation", STRING, "The gated MLP's activation: `eager`, `liger_swiglu`, `liger_geglu`."),
                F("rope", STRING, "Rotary position embedding: `eager`, `liger_rope`."),
                F(
                    "lora_projections",
                    STRINGS,
                    "Fused LoRA autograd kernels in place of PEFT's layers, e.g. axolotl's `axolotl_lora_mlp`, "
                    "`axolotl_lora_qkv`, `axolotl_lora_o` (`eager`: PEFT's layers).",
                ),
                F(
                    "other",
                    STRINGS,
                    "Other kernel replacements in effect, named as their tool names them (a plugin class, an "
                    "Unsloth patch): each is a finding until ledgerspec models it.",
                ),
                F(
                    "packages",
                    STRMAP,
                    "The kernels' packages and their versions, e.g. `{liger-kernel: 0.8.5}`: a kernel's saved "
                    "tensors change between versions.",
                ),
            ),
        ),
        F("gpu_name", STRING, "The GPU model the stack runs on, e.g. `NVIDIA H100 80GB HBM3`."),
        F(
            "nccl",
            STRING,
            "NCCL version the distributed run uses (`torch.cuda.nccl.version()`), e.g. `2.27.5`: its buffers outside "
            "the caching allocator changed with versions (NVLS buffers shrank sixfold in 2.22). Absent: NCCL 2.22 or "
            "later is assumed.",
        ),
        F(
            "cuda_module_loading",
            ENUM,
            "`CUDA_MODULE_LOADING`: `LAZY` loads each kernel module on its first use, `EAGER` loads every module of "
            "every library at start (hundreds of MiB more device memory outside the caching allocator). Absent: "
            "`LAZY` (CUDA's default on Linux since 12.2; PyTorch sets it when unset since 1.13).",
            enum=("LAZY", "EAGER"),
        ),
        F(
            "pytorch_cuda_alloc_conf",
            STRING,
            "`PYTORCH_CUDA_ALLOC_CONF` as set for the run (e.g. `expandable_segments:True`): the caching allocator's "
            "settings, read as PyTorch parses them. Absent: unset (PyTorch's defaults).",
        ),
        F(
            "accepted_differences",
            STRINGS,
            "Known memory-relevant differences between the declared versions above and the stack ledgerspec "
            "computed the figures with, accepted as they are (ids from the docs' table of stack differences, e.g. "
            "`bitsandbytes-4bit-matmul-input`). Without it, such a difference holds the figure below CANDIDATE.",
        ),
    ),
)

METHOD = F(
    "method",
    OBJECT,
    "The exact adapter recipe. LoRA rank alone does not determine memory: the targets and their shapes do.",
    children=(
        F(
            "kind",
            ENUM,
            "Fine-tuning method: LoRA (adapters on a floating-point base), QLoRA (adapters on a "
            "quantized frozen base) or full (every parameter trainable, with gradients and optimizer state for all "
            "of them; no adapters: rank, targets and adapter.dtype do not apply, and the base must not be "
            "quantized).",
            enum=("LoRA", "QLoRA", "full"),
        ),
        F(
            "rank",
            INT,
            "LoRA rank r: each standard Linear target W (d_out x d_in) gets r(d_in + d_out) trainable values.",
            minimum=1,
        ),
        F("rank_pattern", INTMAP, "Per-module rank overrides (PEFT `rank_pattern`), pattern -> rank."),
        F("alpha", NUMBER, "lora_alpha: a scaling of the update, NOT a memory multiplier (`rank x alpha` is a trap)."),
        F("alpha_pattern", NUMMAP, "Per-module alpha overrides (PEFT `alpha_pattern`)."),
        F(
            "dropout",
            NUMBER,
            "lora_dropout probability; >0 keeps a dropout mask/copy of the adapter input for backward.",
            minimum=0,
        ),
        F(
            "target_modules",
            STRINGS,
            "PEFT target modules: a list of module names, a regex string, or "
            "`all-linear`. Decides where adapters go and so how many parameters they have.",
        ),
        F(
            "target_parameters",
            STRINGS,
            "PEFT target parameters (e.g. fused MoE expert tensors), where the r(d_in + d_out) formula does not apply.",
        ),
        F(
            "exclude_modules",
            STRINGS,
            "PEFT `exclude_modules`: modules that get no adapter even when `target_modules` matches them (a regex "
            "string is matched in full against each module name, a list by name suffix), e.g. the vision tower of a "
            "vision-language model under all-linear. Default: none.",
        ),
        F("bias", ENUM, "PEFT bias mode: which biases become trainable.", enum=("none", "all", "lora_only")),
        F(
            "modules_to_save",
            STRINGS,
            "Modules trained in full (e.g. `lm_head`, `embed_tokens`): a trainable copy "
            "in the module's dtype, with gradients and optimizer state.",
        ),
        F("use_dora", SWITCH, "DoRA: adds a trainable magnitude vector per target and extra activations."),
        F(
            "trainable_parameters",
            COUNT,
            "Actual trainable parameters (requires_grad=True) after injection. "
            "VERIFIED when read off the instantiated model. " + _SRC,
            minimum=0,
        ),
    ),
)

QUANTIZATION = F(
    "quantization",
    OBJECT,
    "The quantization of the frozen base. '4-bit' alone is not enough: "
    "the type, double quantization, compute and storage dtypes all change memory.",
    children=(
        F(
            "type",
            ENUM,
            "Quantization data type: nf4, fp4 (bitsandbytes 4-bit), int8 (LLM.int8); a base quantized by another "
            "library: gptq, awq (packed int4 + scales/zeros per group), mxfp4 (gpt-oss experts), hqq, torchao_nf4 "
            "(torchao's NF4Tensor, torchtune's QLoRA).",
            enum=("nf4", "fp4", "int8", "gptq", "awq", "mxfp4", "hqq", "torchao_nf4"),
        ),
        F(
            "bits",
            INT,
            "Bits per quantized weight (4 or 8). Not a description of the whole method on its own.",
            minimum=1,
        ),
        F(
            "storage_dtype",
            STRING,
            "`bnb_4bit_quant_storage`: the dtype the packed 4-bit data is stored in (uint8 "
            "by default; bf16 to shard with FSDP).",
        ),
        F("double_quant", SWITCH, "`bnb_4bit_use_double_quant`: quantize the per-block absmax constants too."),
        F("compute_dtype", STRING, "`bnb_4bit_compute_dtype`: dtype of the matmuls (weights are dequantized to it)."),
        F(
            "blocksize",
            INT,
            "Quantization block size (64 for bitsandbytes 4-bit); for gptq, awq and hqq the `group_size` (values "
            "per scale; -1 for one group per row); absent: the model config's `quantization_config`.",
            minimum=-1,
        ),
        F(
            "desc_act",
            SWITCH,
            "GPTQ act-order (`desc_act`): the columns' group index `g_idx` is held either way; absent: the model "
            "config's `quantization_config`.",
        ),
        F(
            "dequantized",
            SWITCH,
            "mxfp4: the experts dequantized to the loaded dtype at load (`Mxfp4Config(dequantize=True)`, what "
            "training needs); false: packed FP4 + scales as the triton kernels hold them. Default false.",
        ),
        F("skip_modules", STRINGS, "Modules kept unquantized (`llm_int8_skip_modules`), e.g. `lm_head`."),
        F(
            "kernel",
            ENUM,
            "gptq: the QuantLinear kernel the run trains through (what the training step simulates): triton_v2 "
            "(AutoGPTQ's and fms-acceleration's `qlinear_tritonv2`: the weight dequantized to float16 in forward and "
            "again in backward, nothing kept) or torch (GPTQModel 7's `TorchLinear`, through which the layers "
            "transformers loads with gptqmodel train: the dequantized weight kept by autograd for backward). Needed "
            "by estimate for a gptq base.",
            enum=("triton_v2", "torch"),
        ),
    ),
)

BASE_MODEL = F(
    "base_model",
    OBJECT,
    "How the frozen base is held: it stays resident for computation even though it has no gradients.",
    children=(
        F("loaded_dtype", STRING, "dtype the base is loaded in (`torch_dtype`), e.g. bfloat16, float16, float32."),
        F("quantized", SWITCH, "Whether the base is quantized."),
        F(
            "prepare_for_kbit_training",
            SWITCH,
            "PEFT's `prepare_model_for_kbit_training`: upcasts every fp16/bf16 parameter that is not a 4-bit weight "
            "to fp32 (norms, embeddings, lm_head, biases). It also enables gradient checkpointing unless called with "
            "`use_gradient_checkpointing=False`: declare the result in `memory_options.gradient_checkpointing`. "
            "Absent means not used.",
        ),
        F(
            "module_dtypes",
            STRMAP,
            "dtype of the frozen, non-quantized modules after preparation, by module-name substring (the first key "
            "contained in a module's name wins), e.g. `{norm: float32, lm_head: bfloat16, embed_tokens: bfloat16}` "
            "as TRL's `peft_module_casting_to_bf16` leaves a QLoRA model. Adapters follow `adapter.dtype`.",
        ),
        QUANTIZATION,
    ),
)

ADAPTER = F(
    "adapter",
    OBJECT,
    "The adapter tensors.",
    children=(
        F(
            "dtype",
            STRING,
            "Actual dtype of the adapter values (PEFT upcasts adapters to float32 by default). "
            "Adapter bytes = trainable parameters x bytes of this dtype.",
        ),
    ),
)

WORKLOAD = F(
    "workload",
    OBJECT,
    "The training workload. Activations depend on microbatch and the real sequence "
    "shapes; gradient accumulation runs micro-steps sequentially and does not enlarge the activation "
    "batch.",
    children=(
        F(
            "max_length",
            INT,
            "Maximum sequence length in tokens. Not the workload on its own: give p50/p95 and packing too.",
            minimum=1,
        ),
        F("sequence_p50", INT, "Median tokenized sequence length of the real data.", minimum=1),
        F("sequence_p95", INT, "95th percentile tokenized sequence length of the real data.", minimum=1),
        F("packing", SWITCH, "Whether sequences are packed into max_length rows."),
        F("packing_strategy", STRING, "How packing is done (e.g. bfd, wrapped)."),
        F("padding_free", SWITCH, "Padding-free batching (no pad tokens materialised)."),
        F(
            "microbatch",
            INT,
            "Per-device microbatch: the batch that is resident in one forward/backward. The "
            "first-class input for activation memory.",
            minimum=1,
        ),
        F("gradient_accumulation", INT, "Gradient accumulation steps: micro-steps run one after another.", minimum=1),
        F("dp_world_size", INT, "Number of data-parallel replicas.", minimum=1),
        F(
            "global_batch",
            INT,
            "Effective batch = microbatch x gradient_accumulation x dp_world_size. Not an activation batch.",
            minimum=1,
        ),
    ),
)

TRAINING = F(
    "training",
    OBJECT,
    "The training step as it runs: the same model and batch allocate differently under another loop or "
    "precision. Absent keys take `transformers.Trainer`'s defaults (documented on each key).",
    children=(
        F(
            "loop",
            ENUM,
            "`trainer` (default): transformers' `Trainer` and TRL's trainers: the loss is computed inside the "
            "model's forward from `labels` and the outputs (logits) are released before backward. `custom`: a loop "
            "that keeps the outputs through backward (`logits = model(ids).logits; loss = f(logits); "
            "loss.backward()`).",
            enum=("trainer", "custom"),
        ),
        F(
            "mixed_precision",
            ENUM,
            "`no` (default, as `TrainingArguments(bf16=False, fp16=False)`), `bf16` or `fp16`: accelerate runs "
            "the forward under `torch.autocast` and converts the outputs to fp32; `fp16` also scales the loss with "
            "a `GradScaler`. The parameters keep their dtypes (autocast casts copies for each op).",
            enum=("no", "bf16", "fp16"),
        ),
        F(
            "use_cache",
            SWITCH,
            "The model's `use_cache` in the training forward (a KV cache kept in the outputs). Absent: what the loop "
            "leaves: the Trainer sets the config's `use_cache` to `TrainingArguments.use_cache` (default false); a "
            "custom loop keeps the model config's value (transformers turns it off under gradient checkpointing).",
        ),
        F(
            "max_grad_norm",
            NUMBER,
            "Gradient clipping before the optimizer step (`TrainingArguments.max_grad_norm`, default 1.0; 0 "
            "disables it).",
            minimum=0,
        ),
        F(
            "loss_item_each_step",
            SWITCH,
            "`custom` loop: the loss is read on the host after each micro-step's backward (`loss.item()`, e.g. to "
            "log it, as Answer.AI's `fsdp_qlora` train.py does), so the host waits there for the device; under "
            "FSDP the device-level verdict's replay completes backward's pending frees at that point. Absent: "
            "false (the host may run on: those frees complete at FSDP's next wait, a larger reserve). The Trainer "
            "reads it whatever this says (its nan/inf check of each micro-step's loss).",
        ),
        F(
            "objective",
            ENUM,
            "What the step optimizes, as TRL's trainers run it: `sft` (default: supervised fine-tuning, one forward "
            "of the batch), `dpo`, `kto`, `orpo`, `cpo` (preference pairs: chosen and rejected in one forward, a "
            "reference pass for DPO/KTO), `grpo`, `rloo`, `ppo` (online RL: a generation phase, then training on "
            "prompt + completion), `reward` (a reward model on chosen/rejected pairs). The estimate and `measure` "
            "simulate `sft`, `dpo` and `kto` (their reference from the policy, a separate model or precomputed), "
            "`orpo`, `cpo`, `reward` (TRL 1.16's RewardTrainer: a sequence classifier with a one-score head), `grpo` "
            "and `rloo` (generation with transformers' generate, or vLLM in server or colocate mode); the others get "
            "LS014.",
            enum=("sft", "dpo", "kto", "orpo", "cpo", "grpo", "rloo", "ppo", "reward"),
        ),
        F(
            "objective_settings",
            OBJECT,
            "The settings of a preference or RL objective that change memory, as TRL 1.16's trainer configs name "
            "them (absent: TRL's defaults, given on each key). The DPO and KTO steps read `reference` and "
            "`max_completion_length`, the reward step `center_rewards_coefficient`, all three `disable_dropout`; GRPO "
            "and RLOO read `reference`, `max_completion_length`, `num_generations`, `generation_batch_size`, "
            "`steps_per_generation`, `disable_dropout`, `use_vllm`, `vllm_mode`, `vllm_gpu_memory_utilization` and "
            "`vllm_enable_sleep_mode`.",
            children=(
                F(
                    "reference",
                    ENUM,
                    "Where DPO/KTO (and GRPO with `beta > 0`) get reference log-probabilities: `adapter_disabled` "
                    "(the same PEFT model with its adapters off, one more forward without grad: TRL's default when "
                    "the trainer is given a `peft_config` and no `ref_model`, dpo_trainer.py:1323-1336), "
                    "`adapter_copy` (a PEFT model handed to TRL 1.16's DPOTrainer: a frozen copy of its adapter, "
                    "named `ref`, is the reference, dpo_trainer.py:666-691), `model` (a second model loaded beside "
                    "the policy: the trainer's `ref_model`, frozen, its forward without grad; the step builds it as "
                    "a second copy of `base_model` as declared, dpo_trainer.py:908-990), `precomputed` "
                    "(`precompute_ref_log_probs: true`, default false, dpo_config.py:227: before training), `none` "
                    "(ORPO, CPO/SimPO; GRPO's default `beta: 0.0`, grpo_config.py:681).",
                    enum=("adapter_disabled", "adapter_copy", "model", "precomputed", "none"),
                ),
                F(
                    "disable_dropout",
                    SWITCH,
                    "Every dropout module's probability set to 0 before training (DPO/KTO/GRPO/RLOO/reward: TRL's "
                    "`disable_dropout`, default true, dpo_config.py:185, reward_config.py:128): LoRA's dropout then "
                    "allocates nothing.",
                ),
                F(
                    "center_rewards_coefficient",
                    NUMBER,
                    "Reward models: the coefficient of the auxiliary loss that centres the rewards near zero "
                    "(TRL's `RewardConfig.center_rewards_coefficient`, default none: off, reward_config.py:160; "
                    "reward_trainer.py:794-795 adds `coefficient * mean((chosen + rejected) ** 2)`, a few floats "
                    "per pair).",
                    minimum=0,
                ),
                F(
                    "max_completion_length",
                    INT,
                    "Tokens generated per completion (GRPO/RLOO, default 512, grpo_config.py:494). For DPO: the "
                    "completion tokens of a row (TRL 1.16 has no such setting: absent, the estimate for a GPU takes "
                    "every position after the first, an upper bound; its fused head scores completion tokens only).",
                    minimum=1,
                ),
                F(
                    "num_generations",
                    INT,
                    "Completions sampled per prompt (GRPO/RLOO, default 8, grpo_config.py:480).",
                    minimum=1,
                ),
                F(
                    "generation_batch_size",
                    INT,
                    "Sequences generated at once (default: the effective training batch, grpo_config.py:521).",
                    minimum=1,
                ),
                F(
                    "steps_per_generation",
                    INT,
                    "Optimizer micro-steps per generation (default: gradient_accumulation_steps, grpo_config.py:528).",
                    minimum=1,
                ),
                F(
                    "use_vllm",
                    SWITCH,
                    "Completions generated by vLLM (default false, grpo_config.py:587-588): the training process "
                    "holds no generation (no KV cache), syncs the weights to vLLM before each generation (PEFT "
                    "models: the adapters merged, every base parameter packed and sent, unmerged) and computes the "
                    "old policy's log-probs for TRL's importance-sampling correction.",
                ),
                F(
                    "vllm_mode",
                    ENUM,
                    "`colocate` (default, grpo_config.py:594-595: vLLM in the training process, its share of the "
                    "card taken before training, outside the training step's allocator) or `server` (another process "
                    "or GPU: the training card holds only the weight sync).",
                    enum=("colocate", "server"),
                ),
                F(
                    "vllm_gpu_memory_utilization",
                    NUMBER,
                    "The share of the card colocated vLLM takes (default 0.3, grpo_config.py:656-657): vLLM sizes "
                    "its weights, activations and KV cache to this fraction of the card's total memory.",
                    minimum=0,
                ),
                F(
                    "vllm_enable_sleep_mode",
                    SWITCH,
                    "Colocated vLLM put to sleep (level 2) after each generation (default false, "
                    "grpo_config.py:612-613): its weights and KV cache are released to the driver while training runs.",
                ),
            ),
        ),
    ),
)

GRADIENTS = F(
    "gradients",
    OBJECT,
    "Gradients exist only for trainable tensors; in LoRA the frozen base has none.",
    children=(
        F(
            "parameters",
            COUNT,
            "Parameters that receive gradients (after backward). Must not exceed "
            "`method.trainable_parameters`. " + _SRC,
            minimum=0,
        ),
        F("dtype", STRING, "Gradient dtype (equal to the parameter dtype in plain PyTorch autograd)."),
    ),
)

OPTIMIZER = F(
    "optimizer",
    OBJECT,
    "The optimizer and its state: only parameters in `param_groups` get state.",
    children=(
        F(
            "name",
            STRING,
            "Exact optimizer, e.g. adamw_torch, adamw_torch_fused, adam, sgd, adamw_8bit, "
            "paged_adamw_8bit, paged_adamw_32bit, adafactor.",
        ),
        F(
            "optimized_parameters",
            COUNT,
            "Parameters in the optimizer's param_groups. Should equal the trainable parameters. " + _SRC,
            minimum=0,
        ),
        F(
            "state_format",
            STRING,
            "How the state is stored, e.g. `2 x fp32 moments`, `2 x uint8 blockwise + fp32 absmax`.",
        ),
        F(
            "bits",
            INT,
            "Bits per optimizer state value (32 or 8). 8-bit keeps tensors under `min_8bit_size` in 32-bit.",
            minimum=1,
        ),
        F("paged", SWITCH, "Paged optimizer: state in unified memory, evicted to host under pressure."),
        F(
            "min_8bit_size",
            INT,
            "Tensors with fewer elements keep 32-bit state (bitsandbytes default 4096).",
            minimum=0,
        ),
    ),
)

MEMORY_OPTIONS = F(
    "memory_options",
    OBJECT,
    "Options that trade memory for time.",
    children=(
        F(
            "gradient_checkpointing",
            SWITCH,
            "Activation (gradient) checkpointing: recomputes layer activations in "
            "backward. Its saving depends on the model and workload, not a fixed percentage.",
        ),
        F("checkpointing_kind", STRING, "Which checkpointing (reentrant, non-reentrant, selective)."),
        F("activation_offload", SWITCH, "Offload saved activations to host memory."),
        F("offload_mode", STRING, "How activations are offloaded (sync, async streams, pinned)."),
        F("cpu_offload", SWITCH, "Offload parameters or optimizer state to CPU."),
        F(
            "sharding",
            ENUM,
            "Sharding strategy of the model state (fsdp1: FullyShardedDataParallel, as parallelism.strategy: fsdp1).",
            enum=("none", "fsdp1", "fsdp2", "zero1", "zero2", "zero3"),
        ),
    ),
)

PARALLELISM = F(
    "parallelism",
    OBJECT,
    "Several GPUs: memory is per rank; N GPUs of M GB are not one device of "
    "N x M GB, and single-GPU memory / N is not a sharding formula.",
    children=(
        F("gpu_count", INT, "Number of GPUs (ranks).", minimum=1),
        F("strategy", STRING, "Parallel strategy, e.g. ddp, fsdp2, zero3."),
        F("parameter_placement", STRING, "Where parameters live (replicated, sharded, cpu)."),
        F("gradient_placement", STRING, "Where gradients live (replicated, sharded, cpu)."),
        F("optimizer_placement", STRING, "Where optimizer state lives (replicated, sharded, cpu)."),
        F("cpu_offload", SWITCH, "CPU offload of sharded state."),
        F(
            "reshard_after_forward",
            SWITCH,
            "FSDP2: free gathered parameters after forward (true) or keep them until backward (false).",
        ),
        F(
            "mixed_precision_policy",
            OBJECT,
            "FSDP2's `MixedPrecisionPolicy` (`fully_shard(mp_policy=...)`; accelerate's `mixed_precision_policy`, "
            "which `mixed_precision: bf16` sets to bf16/bf16). Absent: none (FSDP2's default: the parameters are "
            "gathered, computed and reduced in their own dtype). The shards, the sharded gradients and the "
            "optimizer state stay in the parameters' dtype.",
            children=(
                F(
                    "param_dtype",
                    STRING,
                    "Dtype of the all-gathered (unsharded) floating parameters, hence of compute and of the "
                    "unsharded gradients. Absent: each parameter's own dtype.",
                ),
                F(
                    "reduce_dtype",
                    STRING,
                    "Dtype of the gradient reduce-scatter; the reduced shard is cast back to the parameter's "
                    "dtype. Absent: param_dtype.",
                ),
                F(
                    "buffer_dtype",
                    STRING,
                    "FSDP1 only (`MixedPrecision.buffer_dtype`; FSDP2's policy has none): the dtype FSDP1 casts the "
                    "model's floating buffers to at the first forward (e.g. the rotary `inv_freq`); accelerate's "
                    "`mixed_precision: bf16` sets it to bf16. Absent: the buffers keep their dtype.",
                ),
            ),
        ),
        F(
            "backward_prefetch",
            STRING,
            "FSDP1 (`parallelism.strategy: fsdp1`): `backward_pre`, `backward_post` or `no_prefetch` (accelerate's "
            "`fsdp_backward_prefetch`). With a prefetch the next unit's parameters are all-gathered before the "
            "current unit's gradients are computed: one more gathered unit alive in backward. Absent: "
            "`no_prefetch`, what transformers' `TrainingArguments` (`fsdp_config.backward_prefetch` "
            "'NO_PREFETCH') and accelerate without the setting pass.",
        ),
        F(
            "forward_prefetch",
            SWITCH,
            "FSDP1: all-gather the next unit before the current unit's forward (accelerate's "
            "`fsdp_forward_prefetch`). Absent: false.",
        ),
        F(
            "limit_all_gathers",
            SWITCH,
            "FSDP1: at most two all-gathers in flight (a CUDA-event rate limiter; without streams, as on the CPU, it "
            "changes nothing). Absent: true (accelerate's default).",
        ),
        F(
            "sync_module_states",
            SWITCH,
            "FSDP1: broadcast each unit's parameters and buffers from rank 0 as it is wrapped (accelerate's "
            "`fsdp_sync_module_states`, forced on by `fsdp_cpu_ram_efficient_loading`): each 250 MiB bucket is "
            "flattened into a new tensor on the device during the load, which the device-level verdict replays "
            "(held bytes unchanged). Absent: false (accelerate's `FullyShardedDataParallelPlugin` default; "
            "`accelerate launch` and transformers' `TrainingArguments` pass true unless told otherwise).",
        ),
        F(
            "activation_checkpointing",
            SWITCH,
            "FSDP: who applies the gradient checkpointing that `memory_options.gradient_checkpointing: true` "
            "declares. true: FSDP's wrapper, torch's `apply_activation_checkpointing`, on each decoder layer inside "
            "its unit, whatever transformers version is declared (as Answer.AI's `fsdp_qlora` train.py and "
            "llama-recipes do, and accelerate's `fsdp_activation_checkpointing`, which is non-reentrant and also "
            "wraps each PEFT LoRA module: that nesting is not modelled). `memory_options.checkpointing_kind` says "
            "reentrant or not. Absent: false, transformers' own checkpointing, which sits around the FSDP1 unit "
            "before transformers 4.52 and inside it since.",
        ),
        F(
            "use_orig_params",
            SWITCH,
            "FSDP1: keep the original parameters as views into the flat parameter (true) or expose only the flat "
            "parameters (false: no 16-byte alignment padding between parameters; the optimizer sees flat "
            "parameters). Absent: true (transformers' `fsdp_config.use_orig_params` default).",
        ),
        F(
            "shard_group_size",
            INT,
            "Hybrid sharding (FSDP1 `HYBRID_SHARD`, or `_HYBRID_SHARD_ZERO2` with `reshard_after_forward: false`; "
            "FSDP2 `fully_shard` on a 2-D (replicate, shard) device mesh, HSDP): "
            "the ranks of one shard group, usually the GPUs of one node. Parameters, gradients and optimizer "
            "state are sharded within a group and replicated across groups, so each rank holds what it would "
            "hold on `shard_group_size` GPUs. Absent: every rank is in one group (`FULL_SHARD` / `SHARD_GRAD_OP`).",
            minimum=1,
        ),
        F(
            "deepspeed",
            OBJECT,
            "DeepSpeed ZeRO options that set per-rank memory under `strategy: zero2` / `zero3` (the ZeRO stage is the "
            "strategy), named as in a DeepSpeed config's `zero_optimization` block. Absent keys take DeepSpeed "
            "0.19.8's own defaults (`deepspeed/runtime/zero/config.py`, `DeepSpeedZeroConfig`), documented on each "
            "key. Sizes are numbers of elements, as in DeepSpeed.",
            children=(
                F(
                    "stage3_prefetch_bucket_size",
                    INT,
                    "ZeRO-3: elements of parameters prefetched ahead of the module being computed (default 5e7).",
                    minimum=0,
                ),
                F(
                    "stage3_max_live_parameters",
                    INT,
                    "ZeRO-3: most elements kept gathered at once before older ones are released (default 1e9).",
                    minimum=0,
                ),
                F(
                    "stage3_max_reuse_distance",
                    INT,
                    "ZeRO-3: a parameter reused within this many elements of computation is not released (default "
                    "1e9).",
                    minimum=0,
                ),
                F(
                    "stage3_param_persistence_threshold",
                    INT,
                    "ZeRO-3: parameters with fewer elements are never partitioned (whole on every rank; default 1e5).",
                    minimum=0,
                ),
                F(
                    "reduce_bucket_size",
                    INT,
                    "Elements per gradient reduce bucket (ZeRO-3 allocates a contiguous buffer of this size; default "
                    "5e8).",
                    minimum=1,
                ),
                F("allgather_bucket_size", INT, "ZeRO-1/2: elements per all-gather bucket (default 5e8).", minimum=0),
                F(
                    "overlap_comm",
                    SWITCH,
                    "Overlap gradient reduction with backward (more buffers). Default: true for ZeRO-3, false "
                    "otherwise.",
                ),
                F(
                    "contiguous_gradients",
                    SWITCH,
                    "Copy gradients into one contiguous buffer as they are produced (default true).",
                ),
                F(
                    "zero_force_ds_cpu_optimizer",
                    SWITCH,
                    "The top-level DeepSpeed key (default true): with offload (`optimizer_placement: cpu`) the step "
                    "runs DeepSpeedCPUAdam, built from the DeepSpeed config's `optimizer` block; DeepSpeed refuses "
                    "another client optimizer. false: the Trainer's own optimizer steps the host partitions.",
                ),
            ),
        ),
        F(
            "nccl",
            OBJECT,
            "NCCL settings of the run (the `NCCL_*` environment), for the device memory NCCL's communicators hold "
            "outside the caching allocator on every rank. Absent keys take NCCL's defaults, documented on each key.",
            children=(
                F(
                    "buffsize",
                    SIZE,
                    "`NCCL_BUFFSIZE`: the Simple protocol's buffer per channel and connection (default 4 MiB; the LL "
                    "and LL128 buffers, 512 KiB and 4.6875 MiB, come on top). " + _MEM,
                ),
                F(
                    "channels",
                    INT,
                    "Channels NCCL uses for collectives (`NCCL_MAX_NCHANNELS` caps them). Absent: what NCCL picks for "
                    "the topology (the docs' outside-allocator catalogue assumes 16 with NVLink, 2 over PCIe).",
                    minimum=1,
                ),
                F(
                    "nvls_enable",
                    SWITCH,
                    "`NCCL_NVLS_ENABLE`: NVLink SHARP buffers on NVSwitch systems (H100/H200/B200 SXM boards). Absent: "
                    "NCCL's automatic choice (on where the GPUs support multicast).",
                ),
                F(
                    "runtime_connect",
                    SWITCH,
                    "`NCCL_RUNTIME_CONNECT` (NCCL 2.22+): connect, and allocate the buffers of, only the algorithms a "
                    "collective uses (true, NCCL's default) or all of them at init (false).",
                ),
                F(
                    "communicators",
                    INT,
                    "NCCL communicators on each rank that run collectives (one per process group used, e.g. 2 for "
                    "HSDP's shard and replicate groups): each holds its own buffers. Default 1.",
                    minimum=0,
                ),
            ),
        ),
        F(
            "per_rank_peak",
            FIGURES,
            "Peak memory of each rank, one figure per rank. A single total summed across "
            "GPUs is not a per-rank figure. " + _MEM + _SRC,
        ),
    ),
)

_LEDGER_KEYS = (
    (
        "frozen_base",
        "Frozen base weights and buffers, resident for computation (quantized storage and its constants for QLoRA; "
        "buffers only in full fine-tuning).",
    ),
    (
        "adapter",
        "Adapter weights: trainable parameters x adapter dtype bytes (in full fine-tuning: the trainable model "
        "weights, every parameter in its own dtype).",
    ),
    ("gradients", "Gradients: parameters with gradients x gradient dtype bytes."),
    (
        "optimizer",
        "Optimizer state on the device (e.g. two fp32 Adam moments: 8 bytes per optimized "
        "parameter; 8-bit states and paged state differ).",
    ),
    (
        "activations",
        "Activations saved for backward: depend on microbatch, sequence shapes, depth, hidden size, "
        "attention implementation and checkpointing. Only an estimate (CALCULATED) or a measurement.",
    ),
    (
        "temporary",
        "Temporary and runtime tensors (workspaces, dequantized weights, allocator slack): only "
        "a measurement reveals them.",
    ),
    (
        "calculated_subtotal",
        "Sum of the calculated components. Not the peak: no universal `x 1.10` factor turns it into one.",
    ),
)
LEDGER = F(
    "ledger",
    OBJECT,
    "The Training Memory Ledger: each component with where its number came from.",
    children=tuple(F(k, MEMORY, d + " " + _MEM + _SRC) for k, d in _LEDGER_KEYS),
)

_PHASE_KEYS = (
    ("after_load", "Allocated memory after loading the base model (protocol step 2)."),
    ("after_adapter_injection", "After injecting the exact adapters (step 3)."),
    ("after_optimizer_init", "After creating the optimizer (step 4; Adam states appear at the first step)."),
    (
        "generation_peak",
        "Online RL (GRPO): peak during the first representative step's generation phase (the completions "
        "generated with the KV cache under no_grad, scored, their reference log-probs), before its forward.",
    ),
    ("forward_peak", "Peak during a representative forward pass (step 5)."),
    ("backward_peak", "Peak during loss + backward (step 6)."),
    ("optimizer_step_peak", "Peak during the optimizer step (step 7)."),
    ("steady_state_peak", "Peak over repeated representative training steps (step 8)."),
)
#: the phases only online RL's step has (GRPO/RLOO: ``phases.generation_peak``)
GENERATION_PHASES = ("generation_peak",)
#: a device verdict at the edge (``x-estimate.verdict.uncertain``): its word, and why such a step does not fit, in every
#: face that says it (estimate, shard, --fit, a sweep's check, validate -v, report, the status ladder)
AT_THE_EDGE = "AT THE EDGE"
EDGE_WHY = "it completes only with the typical bytes outside the allocator"
#: the parts of ``outside_allocator`` a ledger may hold beside ``total``: each replaces the catalogue's part of that
#: name (the estimate's ``outside.with_declared``), and the status ladder checks they are still what it took
OUTSIDE_PARTS = ("context", "nccl", "other")
#: every protocol phase key in run order, with the ``result.oom_phase`` word of a run out of memory in it (the
#: generation's decoding forwards are forwards: the spec's list has no word of its own for them)
PHASE_OOM_WORDS = {
    "after_load": "load",
    "after_adapter_injection": "adapter_injection",
    "after_optimizer_init": "optimizer_init",
    "generation_peak": "forward",
    "forward_peak": "forward",
    "backward_peak": "backward",
    "optimizer_step_peak": "optimizer_step",
    "steady_state_peak": "later_iteration",
}
PHASES = F(
    "phases",
    OBJECT,
    "Per-phase peaks of the measurement protocol; peak counters are reset between phases.",
    children=tuple(F(k, MEMORY, d + " " + _MEM + _SRC) for k, d in _PHASE_KEYS),
)

METRICS = F(
    "metrics",
    OBJECT,
    "Whole-run peaks.",
    children=(
        F(
            "peak_allocated",
            MEMORY,
            "Peak memory allocated to tensors by the PyTorch allocator "
            "(`torch.cuda.max_memory_allocated`). " + _MEM + _SRC,
        ),
        F(
            "peak_reserved",
            MEMORY,
            "Peak memory reserved by the PyTorch caching allocator; never below peak_allocated. " + _MEM + _SRC,
        ),
        F(
            "device_peak",
            MEMORY,
            "Device-level peak of the process from NVML: the caching allocator's reserved bytes plus what it does "
            "not see (the CUDA context and kernel modules, NCCL buffers; see `outside_allocator`). " + _MEM + _SRC,
        ),
        F("host_peak", MEMORY, "Peak host (CPU) memory; required with activation offload. " + _MEM + _SRC),
        F(
            "step_time_s",
            SECONDS,
            "Time of one training step in seconds; required with activation offload. " + _SRC,
            minimum=0,
        ),
    ),
)

OUTSIDE_ALLOCATOR = F(
    "outside_allocator",
    OBJECT,
    "Device memory one rank holds OUTSIDE PyTorch's caching allocator: the CUDA context and kernel modules, NCCL's "
    "buffers, unified memory. `torch.cuda.max_memory_reserved` never sees it; NVML does (`metrics.device_peak`). "
    "Absent: the docs' outside-allocator catalogue gives a figure for the declared stack (`software.gpu_name`, "
    "`cuda`, `cuda_module_loading`, `parallelism.gpu_count`, `parallelism.nccl`). `ledgerspec measure --device "
    "cuda` writes what it saw (MEASURED), which replaces the catalogue's figure.",
    children=(
        F(
            "context",
            MEMORY,
            "The CUDA context and the modules loaded with it: device memory of the process after CUDA is "
            "initialised and before its first allocation (MEASURED: NVML's used memory of the process then). "
            + _MEM
            + _SRC,
        ),
        F(
            "nccl",
            MEMORY,
            "NCCL communicators' buffers on this rank (per channel and connection, NVLS buffers): 0 on one GPU. "
            + _MEM
            + _SRC,
        ),
        F(
            "other",
            MEMORY,
            "Everything else outside the allocator: kernel modules loaded at their first use (lazy loading), "
            "library handles' own memory, resident pages of unified memory (bitsandbytes' paged optimizers). "
            + _MEM
            + _SRC,
        ),
        F(
            "after_load",
            MEMORY,
            "Device memory outside the allocator at the end of `after_load`: NVML's used memory of the process minus "
            "`torch.cuda.memory_reserved`, read together. " + _MEM + _SRC,
        ),
        F(
            "total",
            MEMORY,
            "This rank's figure to add to the caching allocator's reserved bytes for the device-level peak: "
            "MEASURED as `metrics.device_peak - peak reserved` of the phase with the device peak; else the sum of "
            "the parts. With several ranks, the worst rank. " + _MEM + _SRC,
        ),
        F(
            "per_rank",
            FIGURES,
            "`total` of each rank, one figure per rank (`ledgerspec measure --nproc`). " + _MEM + _SRC,
        ),
    ),
)

COMPARISON = F(
    "comparison",
    OBJECT,
    "Calculated versus measured: the difference is what the calculation could "
    "not see (activations, temporaries, allocator).",
    children=(
        F("calculated_subtotal", MEMORY, "The ledger's calculated subtotal. " + _MEM + _SRC),
        F("measured_peak", MEMORY, "The measured peak it is compared with. " + _MEM + _SRC),
        F("difference", MEMORY, "measured_peak - calculated_subtotal. " + _MEM + _SRC),
        F("known_explanation", ANY, "What explains the difference (required when a difference is present)."),
    ),
)

MEASUREMENT = F(
    "measurement",
    OBJECT,
    "How the measurement was taken.",
    children=(
        F(
            "device",
            ENUM,
            "Device measured on: cuda (a real GPU) or cpu (tensor tracking; never VALIDATED).",
            enum=("cuda", "cpu"),
        ),
        F("device_name", STRING, "Device name as reported by the driver."),
        F("device_memory", SIZE, "Total memory of the device. " + _MEM),
        F("steps", INT, "Number of representative training steps measured (VALIDATED needs >= 2).", minimum=0),
        F("repeats", INT, "Number of repeats of the whole measurement.", minimum=0),
        F("protocol", STRING, "Measurement protocol version, e.g. `ledgerspec-measure/1`."),
        F("date", STRING, "Date of the measurement (ISO 8601)."),
        F("command", STRING, "The exact command that produced the measurement."),
    ),
)

RESULT = F(
    "result",
    OBJECT,
    "The outcome.",
    children=(
        F("oom", SWITCH, "Whether the run ran out of memory."),
        F("oom_phase", ENUM, "The phase where OOM happened: it points at the component to fix.", enum=PHASES_OOM),
        F(
            "target_device",
            OBJECT,
            "The device the configuration must fit.",
            children=(
                F("name", STRING, "Target device name, e.g. `RTX 4090 24GB`."),
                F("memory", SIZE, "Target device memory per GPU. " + _MEM),
            ),
        ),
        F("candidate_configuration", ANY, "The configuration proposed for the target device."),
        F("fits", SWITCH, "Whether the best peak figure fits the target device."),
    ),
)

_PASSFAIL = ("PASS", "FAIL")
TRIAGE = F(
    "triage",
    OBJECT,
    "The OOM Triage Worksheet: controlled tests that locate the component that ran out.",
    children=(
        F("phase", ENUM, "The phase where OOM happened.", enum=PHASES_OOM),
        F(
            "controlled_tests",
            OBJECT,
            "Each change tested alone: PASS (no OOM) or FAIL.",
            children=(
                F("microbatch_reduced", ENUM, "Microbatch reduced.", enum=_PASSFAIL),
                F("sequence_reduced", ENUM, "Sequence length reduced.", enum=_PASSFAIL),
                F("checkpointing_changed", ENUM, "Gradient checkpointing toggled.", enum=_PASSFAIL),
                F("optimizer_changed", ENUM, "Optimizer changed (e.g. to 8-bit).", enum=_PASSFAIL),
            ),
        ),
        F(
            "hypothesis",
            OBJECT,
            "Which component is suspected, and why.",
            children=tuple(
                F(k, STRING, f"Hypothesis about {d}.")
                for k, d in (
                    ("base_residency", "the frozen base residency"),
                    ("activations", "activations"),
                    ("gradients", "gradients"),
                    ("optimizer", "optimizer state"),
                    ("temporary_runtime", "temporary/runtime tensors"),
                    ("allocator", "allocator fragmentation"),
                    ("unknown", "anything not yet explained"),
                )
            ),
        ),
    ),
)

PILOT = F(
    "pilot",
    OBJECT,
    "Results of a pilot run, if any (intake only).",
    children=(
        F("peak_allocated", MEMORY, "Pilot peak allocated. " + _MEM + _SRC),
        F("peak_reserved", MEMORY, "Pilot peak reserved. " + _MEM + _SRC),
        F("device_peak", MEMORY, "Pilot device-level peak. " + _MEM + _SRC),
        F("oom_phase", ENUM, "Phase where the pilot ran out of memory.", enum=PHASES_OOM),
    ),
)

TOP_STATUS = F(
    "status",
    ENUM,
    "Declared status. The validator computes the status the evidence supports; "
    "a declaration above it is an error (LS001).",
    enum=STATUSES,
)
TOP_TITLE = F("title", STRING, "A short title.")
TOP_NOTES = F("notes", ANY, "Free-form notes.")

INTAKE_SECTIONS = (
    IDENTITY,
    SOFTWARE,
    METHOD,
    BASE_MODEL,
    ADAPTER,
    WORKLOAD,
    TRAINING,
    OPTIMIZER,
    MEMORY_OPTIONS,
    PARALLELISM,
)
LEDGER_SECTIONS = (
    *INTAKE_SECTIONS[:5],
    WORKLOAD,
    TRAINING,
    GRADIENTS,
    OPTIMIZER,
    MEMORY_OPTIONS,
    PARALLELISM,
    LEDGER,
    PHASES,
    METRICS,
    OUTSIDE_ALLOCATOR,
    COMPARISON,
    MEASUREMENT,
    RESULT,
    TRIAGE,
)

#: the sections whose fields are configuration inputs (ASSUMPTION there caps the status at CANDIDATE), in catalogue
#: order (what is listed from them reads the same on every run)
INPUT_SECTION_NAMES = tuple(s.name for s in INTAKE_SECTIONS)

KINDS = {
    "ledger": (TOP_STATUS, TOP_TITLE, TOP_NOTES, *LEDGER_SECTIONS),
    "intake": (TOP_STATUS, TOP_TITLE, TOP_NOTES, *INTAKE_SECTIONS, PILOT),
}
VERSIONS = {"ledger": (1,), "intake": (1,)}


def top_fields(kind: str) -> tuple[Field, ...]:
    return KINDS[kind]


def lookup(kind: str, path: tuple[str, ...]) -> Field | None:
    """The catalogue entry at ``path`` (section, key, subkey...) in a document of ``kind``."""
    fields: tuple[Field, ...] = KINDS.get(kind, ())
    found: Field | None = None
    for part in path:
        found = next((f for f in fields if f.name == part), None)
        if found is None:
            return None
        fields = found.children
    return found


def walk(fields: tuple[Field, ...], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field]]:
    """Every field with its path, depth first, in catalogue order."""
    for f in fields:
        path = (*prefix, f.name)
        yield path, f
        if f.kind == OBJECT:
            yield from walk(f.children, path)
