"""LLaMA-Factory YAML -> intake, checked against LLaMA-Factory 0.9.5 (``src/llamafactory/hparams/``,
``model/adapter.py``, ``model/model_utils/quantization.py``, ``model/model_utils/checkpointing.py``).

What LLaMA-Factory does that the file does not say:

- ``quantization_bit: 4`` builds ``BitsAndBytesConfig(bnb_4bit_compute_dtype=compute_dtype,
  bnb_4bit_use_double_quant=double_quantization (default true), bnb_4bit_quant_type=quantization_type (default nf4),
  bnb_4bit_quant_storage=compute_dtype)``; ``compute_dtype`` is bfloat16 under ``bf16``/``pure_bf16``, float16
  under ``fp16`` (``hparams/parser.py``), and the model is loaded in it.
- it never calls PEFT's ``prepare_model_for_kbit_training``; its own ``prepare_model_for_training`` upcasts the
  norms to float32 only under ``upcast_layernorm`` and enables gradient checkpointing unless
  ``disable_gradient_checkpointing`` (``use_reentrant_gc``, default true).
- the trainable parameters are cast to float32 unless ``pure_bf16`` (``_setup_lora_tuning``); ``lora_alpha``
  defaults to ``lora_rank * 2``; ``lora_target: all`` is every Linear except the output layer.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.imports import common as C
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.source import Source, as_int

TOOL = "llamafactory"
LABEL = f"LLaMA-Factory {C.VERSIONS['llamafactory']}"
#: flash_attn -> transformers attn_implementation (``model/model_utils/attention.py``)
ATTENTION = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2", "fa3": "flash_attention_3"}


def default(key: str, value: Any) -> str:
    return f"{LABEL} default ({key} not set): {value}"


def convert(src: Source, b: Builder) -> None:
    b.tools.append(f"{LABEL} ({src.path})")
    o = "LLaMA-Factory: "
    m, q = ("method",), ("base_model", "quantization")

    if src.has("model_name_or_path"):
        b.set(("identity", "model_id"), str(src.take("model_name_or_path")), o + "model_name_or_path", src.path)
    if src.has("model_revision") and src.peek("model_revision") != "main":
        b.set(("identity", "revision"), str(src.take("model_revision")), o + "model_revision", src.path)
    else:
        src.take("model_revision")
        b.unknown(("identity", "revision"), o + "model_revision main (the Hub's latest)", src.path)

    ft = src.take("finetuning_type", "lora")
    if ft not in ("lora", "full"):
        from ledgerspec.errors import LedgerspecError

        line, col = src.position("finetuning_type")
        raise LedgerspecError(
            f"finetuning_type {ft!r}: ledgerspec sizes LoRA, QLoRA and full fine-tunes only",
            src.path,
            line,
            col,
            rule="import",
            hint="set finetuning_type: lora or full, or size this run another way",
        )
    full = ft == "full"  # every parameter trained (_setup_full_tuning): see _full
    if full and src.peek("quantization_bit") is not None:
        from ledgerspec.errors import LedgerspecError

        line, col = src.position("quantization_bit")
        raise LedgerspecError(
            "finetuning_type full with quantization_bit: a quantized base cannot be fully fine-tuned (LLaMA-Factory "
            "refuses it too: init_adapter, 'Quantized models can only be used for the LoRA tuning')",
            src.path,
            line,
            col,
            rule="import",
            hint="remove quantization_bit for full fine-tuning, or set finetuning_type: lora",
        )
    lora_keys = [k for k in _LORA_KEYS if src.has(k)] if full else []
    stage = src.take("stage", "sft")
    objective = {"sft": "sft", "pt": "sft", "dpo": "dpo", "kto": "kto", "rm": "reward", "ppo": "ppo"}.get(str(stage))
    loss = str(src.peek("pref_loss") or "sigmoid")
    if objective == "dpo" and loss in ("orpo", "simpo"):  # LLaMA-Factory's DPO stage runs them without a reference
        objective = "orpo" if loss == "orpo" else "cpo"
    if objective is not None:
        b.set(
            ("training", "objective"),
            objective,
            o + f"stage {stage}" + (f", pref_loss {loss}" if stage == "dpo" else ""),
            src.path,
        )
    if objective not in (None, "sft"):  # its DPO/KTO/RM/PPO trainers subclass TRL's, at the TRL it pins
        b.assume(
            ("software", "trl"),
            "0.9.6",
            o + f"stage {stage}: LLaMA-Factory's trainer for it subclasses TRL's",
            f"LLaMA-Factory {C.VERSIONS['llamafactory']} requires trl>=0.8.6,<=0.9.6 (extras/misc.py check_version): "
            "the newest it accepts, whose DPOTrainer computes the full logits",
            src.path,
        )
    if objective in ("dpo", "kto"):
        if src.peek("ref_model"):
            b.set(("training", "objective_settings", "reference"), "model", o + "ref_model", src.path)
        else:
            C.reference(b, objective, None, None, o, src.path)
    elif objective in ("orpo", "cpo"):
        C.reference(b, objective, None, None, o, src.path)
    if stage not in ("sft", "pt"):
        C.not_modelled(
            src,
            b,
            "stage",
            stage,
            f"stage {stage!r} trains more than one model (reference/reward): only the policy is sized",
        )

    # -- precision ----------------------------------------------------------------------------------------------
    bf16, fp16, pure = src.take("bf16"), src.take("fp16"), src.take("pure_bf16")
    if bf16 or pure:
        compute = "bfloat16"
    elif fp16:
        compute = "float16"
    else:
        compute = None
    infer = src.take("infer_dtype", "auto")
    sharded = bool(src.peek("deepspeed") or src.peek("fsdp") or src.peek("fsdp_config"))
    if full and not pure and not sharded:
        b.set(
            ("base_model", "loaded_dtype"),
            "float32",
            o + "finetuning_type full: init_adapter casts every trainable parameter to float32 "
            "(cast_trainable_params_to_fp32: not pure_bf16, no quantization, no ZeRO-3/FSDP)",
            src.path,
        )
    elif compute:
        b.set(("base_model", "loaded_dtype"), compute, o + "bf16/fp16/pure_bf16 -> compute_dtype", src.path)
    elif infer != "auto":
        b.set(("base_model", "loaded_dtype"), str(infer), o + "infer_dtype", src.path)
    else:
        b.assume(
            ("base_model", "loaded_dtype"),
            "bfloat16",
            o + "no bf16/fp16: infer_optim_dtype",
            f"{LABEL} picks bfloat16 when the GPU supports it and the checkpoint is bf16 (else float16)",
            src.path,
        )
    mp = "no" if pure else "bf16" if bf16 else "fp16" if fp16 else "no"
    b.set(("training", "mixed_precision"), mp, o + ("pure_bf16 (no autocast)" if pure else "bf16/fp16"), src.path)
    b.set(("training", "loop"), "trainer", o + "trains with transformers' Trainer (CustomSeq2SeqTrainer)")

    # -- method -------------------------------------------------------------------------------------------------
    bits = src.take("quantization_bit")
    method = src.take("quantization_method", "bnb")
    quantized = bits is not None
    b.set(
        ("method", "kind"),
        "full" if full else "QLoRA" if quantized else "LoRA",
        o + (f"finetuning_type {ft}" if full else f"finetuning_type lora, quantization_bit {bits}"),
        src.path,
    )
    b.set(C.QUANTIZED, quantized, o + "quantization_bit", src.path)
    rank = src.take("lora_rank")
    if rank is not None:
        rank = as_int(src, "lora_rank", rank)
    if rank is None:
        rank = 8
        b.assume((*m, "rank"), 8, o + "lora_rank", default("lora_rank", 8), src.path)
    else:
        b.set((*m, "rank"), int(rank), o + "lora_rank", src.path, src.position("lora_rank"))
    if src.has("lora_alpha"):
        b.set((*m, "alpha"), src.take("lora_alpha"), o + "lora_alpha", src.path)
    else:
        b.assume((*m, "alpha"), int(rank) * 2, o + "lora_alpha", default("lora_alpha", "lora_rank * 2"), src.path)
    if src.has("lora_dropout"):
        b.set((*m, "dropout"), src.number("lora_dropout"), o + "lora_dropout", src.path)
    else:
        b.assume((*m, "dropout"), 0.0, o + "lora_dropout", default("lora_dropout", 0.0), src.path)
    target = src.take("lora_target")
    names = [t.strip() for t in str(target).split(",") if t.strip()] if target is not None else ["all"]
    value: Any = "all-linear" if names == ["all"] else names
    why = "all: every Linear except the output layer (find_all_linear_modules)" if value == "all-linear" else ""
    if target is None:
        b.assume(
            (*m, "target_modules"), value, o + "lora_target", default("lora_target", "all") + f" ({why})", src.path
        )
    else:
        b.set((*m, "target_modules"), value, o + "lora_target" + (f" {why}" if why else ""), src.path)
    if src.has("additional_target"):
        extra = [t.strip() for t in str(src.take("additional_target")).split(",") if t.strip()]
        b.set((*m, "modules_to_save"), extra, o + "additional_target", src.path)
    b.assume((*m, "bias"), "none", o + "PEFT LoraConfig bias", f"{LABEL} passes no bias: PEFT default 'none'", src.path)
    if src.has("use_dora"):
        b.set((*m, "use_dora"), bool(src.take("use_dora")), o + "use_dora", src.path)
    else:
        b.assume((*m, "use_dora"), False, o + "use_dora", default("use_dora", False), src.path)

    # -- quantization -------------------------------------------------------------------------------------------
    if quantized:
        if method != "bnb":
            C.not_modelled(
                src, b, "quantization_method", method, f"quantization_method {method!r}: ledgerspec models bitsandbytes"
            )
        if bits == 8:
            b.set((*q, "type"), "int8", o + "quantization_bit 8 (BitsAndBytesConfig(load_in_8bit=True))", src.path)
            b.set((*q, "bits"), 8, o + "quantization_bit", src.path)
        elif bits == 4:
            b.set((*q, "bits"), 4, o + "quantization_bit", src.path)
            for key, field, fallback in (
                ("quantization_type", "type", "nf4"),
                ("double_quantization", "double_quant", True),
            ):
                if src.has(key):
                    b.set((*q, field), src.take(key), o + key, src.path)
                else:
                    b.assume((*q, field), fallback, o + key, default(key, fallback), src.path)
            cd = compute or b.value(("base_model", "loaded_dtype"))
            origin = o + "bnb_4bit_compute_dtype = bnb_4bit_quant_storage = compute_dtype (quantization.py)"
            if compute:
                b.set((*q, "compute_dtype"), cd, origin, src.path)
                b.set((*q, "storage_dtype"), cd, origin, src.path)
            else:
                note = f"{LABEL}: compute_dtype follows the loaded dtype (no bf16/fp16 set)"
                b.assume((*q, "compute_dtype"), cd, origin, note, src.path)
                b.assume((*q, "storage_dtype"), cd, origin, note, src.path)
            b.set((*q, "blocksize"), 64, "bitsandbytes 4-bit block size (Params4bit)", src.path)
        else:
            b.finding(
                src.path,
                src.position("quantization_bit"),
                "quantization_bit",
                f"{bits} bits: bitsandbytes takes 4 or 8",
                "unknown",
            )
    for key in ("quantization_type", "double_quantization", "quantization_device_map"):
        src.take(key)

    b.set(
        ("base_model", "prepare_for_kbit_training"),
        False,
        o + "never calls PEFT's prepare_model_for_kbit_training",
        src.path,
    )
    if src.take("upcast_layernorm"):
        b.set(
            ("base_model", "module_dtypes"),
            {"norm": "float32"},
            o + "upcast_layernorm (1-D norm weights to float32)",
            src.path,
        )
    dtype = b.value(("base_model", "loaded_dtype")) if pure else "float32"
    b.set(
        ("adapter", "dtype"),
        dtype,
        o
        + (
            "pure_bf16: trainable params stay in half precision"
            if pure
            else "trainable params cast to float32 (_setup_lora_tuning)"
        ),
        src.path,
    )

    if full:
        _full(src, b, lora_keys)

    # -- workload -----------------------------------------------------------------------------------------------
    w = ("workload",)
    if src.has("cutoff_len"):
        b.set((*w, "max_length"), src.integer("cutoff_len"), o + "cutoff_len", src.path)
    else:
        b.assume((*w, "max_length"), 2048, o + "cutoff_len", default("cutoff_len", 2048), src.path)
    neat = src.take("neat_packing")
    packing = src.take("packing")
    if neat:
        b.set((*w, "packing"), True, o + "neat_packing", src.path)
        b.set((*w, "packing_strategy"), "neat (block-diagonal attention)", o + "neat_packing", src.path)
    elif packing is not None:
        b.set((*w, "packing"), bool(packing), o + "packing", src.path)
    else:
        b.assume(
            (*w, "packing"), stage == "pt", o + "packing", default("packing", "on for stage pt, else off"), src.path
        )
    counts: tuple[tuple[str, tuple[str, ...], int], ...] = (
        ("per_device_train_batch_size", (*w, "microbatch"), 8),
        ("gradient_accumulation_steps", (*w, "gradient_accumulation"), 1),
    )
    for count_key, count_path, count_default in counts:
        if src.has(count_key):
            b.set(count_path, src.integer(count_key), o + count_key, src.path, src.position(count_key))
        else:
            note = f"transformers TrainingArguments default {count_key}: {count_default}"
            b.assume(count_path, count_default, o + count_key, note, src.path)

    # -- optimizer, step, checkpointing --------------------------------------------------------------------------
    if src.has("optim"):
        C.optimizer(src, b, "optim", src.take("optim"), o + "optim")
    else:
        b.assume(
            ("optimizer", "name"),
            "adamw_torch_fused",
            o + "optim",
            "transformers 5.x TrainingArguments default optim",
            src.path,
        )
    C.max_grad_norm(src, b, o)
    b.assume(
        ("training", "use_cache"),
        False,
        o + "gradient checkpointing sets model.config.use_cache = False; the Trainer sets it from args.use_cache",
        "transformers 5.x Trainer: model.config.use_cache = args.use_cache (default False)",
        src.path,
    )
    mo = ("memory_options",)
    disabled = src.take("disable_gradient_checkpointing")
    src.take("gradient_checkpointing")  # LLaMA-Factory enables it itself (prepare_model_for_training)
    if disabled is None:
        b.assume(
            (*mo, "gradient_checkpointing"),
            True,
            o + "disable_gradient_checkpointing",
            default("disable_gradient_checkpointing", "false: checkpointing on"),
            src.path,
        )
    else:
        b.set((*mo, "gradient_checkpointing"), not disabled, o + "disable_gradient_checkpointing", src.path)
    if not disabled:
        reentrant = src.take("use_reentrant_gc")
        if reentrant is None:
            b.assume(
                (*mo, "checkpointing_kind"),
                "reentrant",
                o + "use_reentrant_gc",
                default("use_reentrant_gc", True),
                src.path,
            )
        else:
            b.set(
                (*mo, "checkpointing_kind"),
                "reentrant" if reentrant else "non-reentrant",
                o + "use_reentrant_gc",
                src.path,
            )
    b.set((*mo, "activation_offload"), False, o + "has no activation offload setting", src.path)
    fa = src.take("flash_attn", "auto")
    if fa in ATTENTION:
        b.set(("software", "attention_implementation"), ATTENTION[fa], o + f"flash_attn: {fa}", src.path)
    else:
        b.assume(
            ("software", "attention_implementation"),
            "sdpa",
            o + "flash_attn: auto",
            f"{LABEL} flash_attn auto leaves transformers' default (sdpa)",
            src.path,
        )
    for key in (
        "use_unsloth",
        "enable_liger_kernel",
        "use_unsloth_gc",
        "shift_attn",
        "use_galore",
        "use_apollo",
        "use_badam",
        "mixture_of_depths",
    ):
        if key == "enable_liger_kernel" and src.has(key) and src.peek(key):
            src.take(key)
            _liger(src, b, o)
            continue
        if src.has(key) and src.peek(key):
            C.not_modelled(src, b, key, src.take(key), f"{key} changes training memory and is not modelled")
            if key == "use_unsloth":
                b.set(("software", "kernel_backend"), "unsloth", o + key, src.path)
    unsloth = {"use_unsloth": "unsloth", "use_unsloth_gc": "unsloth_gradient_checkpointing"}
    on = [k for k in unsloth if src.peek(k)]
    if on:
        b.set(
            ("software", "kernels", "other"),
            [unsloth[k] for k in on],
            o + " + ".join(on) + ": Unsloth's patched model / its offloaded checkpointing (hidden states to pageable "
            "host memory)",
            src.path,
        )

    # -- parallelism --------------------------------------------------------------------------------------------
    ds = src.take("deepspeed")
    fsdp = src.take("fsdp")
    fsdp_cfg = src.take("fsdp_config")
    if ds:
        config = ds if isinstance(ds, dict) else C.read_json_beside(src, b, "deepspeed", str(ds))
        if config is not None:
            C.deepspeed(
                src,
                b,
                config,
                f"LLaMA-Factory: deepspeed ({ds if isinstance(ds, str) else 'inline'})",
                src.position("deepspeed"),
            )
    if fsdp or fsdp_cfg:
        C.not_modelled(
            src,
            b,
            "fsdp",
            {"fsdp": fsdp, "fsdp_config": fsdp_cfg},
            f"{LABEL} runs FSDP through `accelerate launch --config_file` (its version and sharding live there): "
            "not read; set memory_options.sharding by hand",
        )
    C.launched_ranks(src, b, ds or fsdp or fsdp_cfg, o, "no deepspeed settings")
    C.account_for_rest(src, b, TOOL, LABEL)


#: LoRA settings LLaMA-Factory reads only with finetuning_type lora (hparams/finetuning_args.py)
_LORA_KEYS = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target",
    "additional_target",
    "use_dora",
    "use_rslora",
    "pissa_init",
    "pissa_iter",
    "create_new_adapter",
)


def _full(src: Source, b: Builder, lora_keys: list[str]) -> None:
    """``finetuning_type: full``: every parameter trained (``_setup_full_tuning``, model/adapter.py), no adapters.
    Unless ``pure_bf16`` (or ZeRO-3/FSDP, which LLaMA-Factory leaves alone), ``init_adapter`` casts the trainable
    parameters to float32 (``cast_trainable_params_to_fp32``): the precision section wrote that ``loaded_dtype``. The
    LoRA mapping above ran as for any file; its fields are taken out again (a full fine-tune has no rank, targets or
    adapter dtype) and the LoRA keys the file holds are listed as not read."""
    for path in [p for p in b.entries if p[0] == "adapter" or (p[0] == "method" and p[1] != "kind")]:
        del b.entries[path]
    for key in lora_keys:
        b.ignored.setdefault(src.path, []).append(key)


def _liger(src: Source, b: Builder, o: str) -> None:
    """``enable_liger_kernel``: applied before the model loads with Liger's defaults for pt/sft; for the other stages
    (which need the logits) the fused linear cross-entropy off and the plain one on (llamafactory 0.9.5,
    ``model/model_utils/liger_kernel.py:94-100``)."""
    stage = src.peek("stage") or "sft"
    chosen = dict(C.LIGER_DEFAULTS)
    if stage not in ("pt", "sft"):
        chosen["cross_entropy"] = "liger_cross_entropy"
    b.set(("software", "kernel_backend"), "liger", o + "enable_liger_kernel", src.path)
    C.kernels(b, chosen, o + f"enable_liger_kernel (stage {stage}): Liger's kernels for Llama-like models", src.path)
