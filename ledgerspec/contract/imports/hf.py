"""Hugging Face files -> intake: ``TrainingArguments`` / TRL ``SFTConfig`` (the ``args`` a Trainer runs with, as
``args.to_json_string()`` writes them, or the same keys in YAML), PEFT's ``adapter_config.json``, a model's
``config.json`` (its ``quantization_config``), and a DeepSpeed JSON. Checked against transformers 5.24.0
(``training_args.py``, ``modeling_utils.py``), TRL 1.9.0 (``trainer/sft_config.py``, ``trainer/sft_trainer.py``,
``trainer/utils.py``) and PEFT 0.21.2 (``tuners/lora/config.py``).

What the files do not say and the intake records:

- transformers >= 5 loads a model in its checkpoint's dtype (``from_pretrained(dtype="auto")``); TRL's
  ``SFTTrainer`` given a model id loads it in float32 unless ``model_init_kwargs.dtype`` is set.
- activation checkpointing without kwargs is non-reentrant (``{"use_reentrant": False}``, ``modeling_utils.py``).
- PEFT upcasts the adapters to float32 (``autocast_adapter_dtype=True``); TRL 1.9 casts them to bfloat16 on a
  quantized base and keeps the base dtype under ZeRO-3 without quantization.
- neither the Trainer nor TRL 1.9's ``SFTTrainer`` calls ``prepare_model_for_kbit_training``: a script may.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.imports import common as C
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.source import Source, as_int

TA = f"transformers {C.VERSIONS['transformers']} TrainingArguments"
TRL = f"TRL {C.VERSIONS['trl']} SFTConfig"
PEFT = f"PEFT {C.VERSIONS['peft']} LoraConfig"
#: keys only TRL's SFTConfig has (not TrainingArguments)
TRL_KEYS = frozenset(C.known_keys("trl") - C.known_keys("transformers"))
#: bitsandbytes 4-bit settings and ``BitsAndBytesConfig``'s defaults (transformers 5.24,
#: ``utils/quantization_config.py``)
BNB4_DEFAULTS = {
    "bnb_4bit_quant_type": ("type", "fp4"),
    "bnb_4bit_use_double_quant": ("double_quant", False),
    "bnb_4bit_compute_dtype": ("compute_dtype", "float32"),
    "bnb_4bit_quant_storage": ("storage_dtype", "uint8"),
}


def is_trl(src: Source) -> bool:
    return bool(set(src.plain) & TRL_KEYS)


#: keys only one TRL trainer's config has -> ``training.objective`` (trl 1.16: ``KTOConfig``, ``RewardConfig``,
#: ``RLOOConfig`` (its own keys), ``GRPOConfig``/``RLOOConfig``, ``CPOConfig``, ``DPOConfig``), checked in this order
TRL_OBJECTIVE_KEYS = (
    (("desirable_weight", "undesirable_weight"), "kto"),
    (("center_rewards_coefficient",), "reward"),
    (("normalize_advantages", "reward_clip_range"), "rloo"),
    (("num_generations", "steps_per_generation", "use_vllm", "vllm_mode"), "grpo"),
    (("cpo_alpha", "simpo_gamma"), "cpo"),
    (("ref_model_init_kwargs", "precompute_ref_log_probs", "rpo_alpha", "reference_free", "ref_adapter_name"), "dpo"),
    # trl.experimental's ORPOConfig: after CPO's and DPO's (CPOConfig shares generate_during_eval and
    # is_encoder_decoder, an older DPOConfig all three)
    (("padding_value", "generate_during_eval", "is_encoder_decoder"), "orpo"),
)


def objective(src: Source, b: Builder, o: str) -> None:
    """``training.objective`` from the keys of a TRL trainer's config (a dump of ``DPOConfig`` etc.)."""
    keys = set(src.plain)
    for names, value in TRL_OBJECTIVE_KEYS:
        found = sorted(keys.intersection(names))
        if not found:
            continue
        if value == "grpo":
            b.assume(
                ("training", "objective"),
                "grpo",
                o + ", ".join(found),
                "GRPOConfig's keys; RLOOConfig has them too (declare rloo for an RLOO run)",
                src.path,
            )
        else:
            b.set(("training", "objective"), value, o + f"{', '.join(found)}: a {value.upper()} trainer's config")
        if value == "rloo":  # read: a few floats per completion at most (the advantages' normalisation, clipping)
            for name in names:
                if src.has(name):
                    src.take(name)
        settings = {k: src.take(k) for k in C.OBJECTIVE_SETTINGS if src.has(k)}
        if settings.get("generation_batch_size") is not None and settings.get("steps_per_generation") is not None:
            # a dump of a live GRPOConfig/RLOOConfig: TRL derived one from the other (grpo_config.py:1097-1116; a user
            # may set only one); the step uses steps_per_generation
            b.finding(
                src.path,
                src.position("generation_batch_size"),
                "generation_batch_size",
                f"{settings.pop('generation_batch_size')} beside steps_per_generation "
                f"{settings['steps_per_generation']}: TRL derives one from the other (a live config's dump); "
                "steps_per_generation is kept",
                "note",
            )
        C.objective_settings(b, settings, o, src.path)
        precomputed = src.take("precompute_ref_log_probs") if src.has("precompute_ref_log_probs") else None
        beta = src.take("beta") if src.has("beta") else None  # read for the reference: 0 means none (GRPO)
        C.reference(b, value, precomputed, beta, o, src.path)
        return


#: the TRL config classes a live trainer's arguments may be (the class names the objective; a dump's keys guess it)
CONFIG_OBJECTIVES = {
    "SFTConfig": "sft",
    "DPOConfig": "dpo",
    "KTOConfig": "kto",
    "ORPOConfig": "orpo",
    "CPOConfig": "cpo",
    "GRPOConfig": "grpo",
    "RLOOConfig": "rloo",
    "RewardConfig": "reward",
}


def online_settings(src: Source, b: Builder, objective: str, o: str) -> None:
    """GRPOConfig's/RLOOConfig's remaining settings: the sampling and loss settings at their defaults (read), others
    not modelled; those that change no tensor ignored (``common.ONLINE_DEFAULTS``, ``common.ONLINE_IGNORED``)."""
    defaults = dict(C.ONLINE_DEFAULTS)
    if objective == "grpo":
        defaults["loss_type"] = "dapo"
    for key, default in defaults.items():
        if not src.has(key):
            continue
        value = src.peek(key)
        if value == default or (default is None and C.is_off(value)):
            src.take(key)
            b.ignored.setdefault(src.path, []).append(key)
        else:
            src.take(key)
            C.not_modelled(
                src,
                b,
                key,
                value,
                f"{key}: {value!r}: the simulated {objective.upper()} step runs TRL's default ({default!r}); "
                "not modelled",
            )
    for key in [k for k in src.plain if k in C.ONLINE_IGNORED]:
        if src.has(key):
            src.take(key)
            b.ignored.setdefault(src.path, []).append(key)


def training_args(src: Source, b: Builder) -> None:
    trl = is_trl(src)
    b.facts["trl"] = b.facts.get("trl", False) or trl
    objective(src, b, "TRL config: ")
    online = b.value(("training", "objective")) in ("grpo", "rloo")
    label = TRL if trl else TA
    o = "SFTConfig: " if trl else "TrainingArguments: "
    if online:  # GRPOConfig/RLOOConfig: their own defaults (TRL 1.16) name them
        name = f"{str(b.value(('training', 'objective'))).upper()}Config"
        label, o = f"TRL 1.16.0 {name}", f"{name}: "
    tool = "trl" if trl else "transformers"
    b.tools.append(f"{label} ({src.path})")
    w, mo = ("workload",), ("memory_options",)

    def take(key: str, path: tuple[str, ...], fallback: Any, conv: Any = None) -> Any:
        if src.has(key):
            value = src.peek(key)
            if conv is int:
                value = src.integer(key)
            elif conv is float:
                value = src.number(key)
            else:
                value = src.take(key)
                value = conv(value) if conv else value
            b.set(path, value, o + key, src.path, src.position(key))
            return value
        src.take(key)
        b.assume(path, fallback, o + key, f"{label} default {key}: {fallback}", src.path)
        return fallback

    take("per_device_train_batch_size", (*w, "microbatch"), 8, int)
    take("gradient_accumulation_steps", (*w, "gradient_accumulation"), 1, int)
    if online:
        # GRPOConfig/RLOOConfig (TRL 1.16) have no sequence length, packing, padding-free batching or activation
        # offloading: a row is a prompt (the data's) and its max_completion_length tokens, padded
        name = f"{str(b.value(('training', 'objective'))).upper()}Config"
        b.unknown(
            (*w, "max_length"),
            f"{name} has no sequence length: the longest prompt (the data's) + max_completion_length; LedgerCallback "
            "fills it from the batches it sees",
            src.path,
        )
        for key in ("packing", "padding_free"):
            b.set((*w, key), False, f"{name} has no {key} (TRL pads prompts and completions)", src.path)
        online_settings(src, b, str(b.value(("training", "objective"))), o)
    elif trl:
        take("max_length", (*w, "max_length"), 1024, int)
        packing = take("packing", (*w, "packing"), False, bool)
        if packing:
            take("packing_strategy", (*w, "packing_strategy"), "bfd")
        else:
            src.take("packing_strategy")
        take("padding_free", (*w, "padding_free"), False, bool)
    else:
        b.unknown(
            (*w, "max_length"),
            "TrainingArguments hold no sequence length: give your tokenizer's truncation length",
            src.path,
        )
    b.set(("training", "loop"), "trainer", o + ("TRL's SFTTrainer (a Trainer)" if trl else "transformers' Trainer"))

    # precision: SFTConfig's bf16 default is `not fp16` (trainer/base_config.py)
    fp16 = bool(src.take("fp16"))
    bf16 = src.take("bf16")
    if bf16 is None and trl:
        bf16 = not fp16
        b.assume(
            ("training", "mixed_precision"), "fp16" if fp16 else "bf16", o + "bf16", f"{TRL} default bf16: not fp16"
        )
    else:
        mp = "bf16" if bf16 else "fp16" if fp16 else "no"
        b.set(("training", "mixed_precision"), mp, o + "bf16/fp16", src.path, src.position("bf16"))
    for key in ("bf16_full_eval", "fp16_full_eval", "half_precision_backend"):
        src.take(key)
    take("max_grad_norm", ("training", "max_grad_norm"), 1.0, float)
    take("use_cache", ("training", "use_cache"), False, bool)
    if src.has("optim"):
        C.optimizer(src, b, "optim", src.take("optim"), o + "optim")
    else:
        b.assume(("optimizer", "name"), "adamw_torch_fused", o + "optim", f"{label} default optim: adamw_torch_fused")

    # checkpointing: activation_checkpointing is the 5.x name, gradient_checkpointing its alias
    gc = src.take("activation_checkpointing")
    alias = src.take("gradient_checkpointing")
    gc = gc if gc is not None else alias
    kwargs = src.take("activation_checkpointing_kwargs") or src.take("gradient_checkpointing_kwargs")
    src.take("gradient_checkpointing_kwargs")
    if gc is None:
        fallback = bool(trl)
        b.assume(
            (*mo, "gradient_checkpointing"),
            fallback,
            o + "gradient_checkpointing",
            f"{label} default gradient_checkpointing: {fallback}",
        )
    else:
        b.set(
            (*mo, "gradient_checkpointing"), bool(gc), o + "activation_checkpointing/gradient_checkpointing", src.path
        )
    if gc or (gc is None and trl):
        if isinstance(kwargs, dict) and "use_reentrant" in kwargs:
            kind = "reentrant" if kwargs["use_reentrant"] else "non-reentrant"
            b.set((*mo, "checkpointing_kind"), kind, o + "gradient_checkpointing_kwargs.use_reentrant", src.path)
        else:
            b.assume(
                (*mo, "checkpointing_kind"),
                "non-reentrant",
                o + "no checkpointing kwargs",
                "transformers 5.24 checkpoints with use_reentrant=False when no kwargs are given (TRL forces "
                "use_reentrant=True for PEFT under ZeRO-3)",
            )
    if online:
        b.set((*mo, "activation_offload"), False, o + "GRPOConfig/RLOOConfig have no activation offloading", src.path)
        _model_init_kwargs(src, b, o)
    elif trl:
        ao = take("activation_offloading", (*mo, "activation_offload"), False, bool)
        if ao:
            b.set(
                (*mo, "offload_mode"),
                "TRL activation offloading (pinned host memory, CUDA streams)",
                o + "activation_offloading",
            )
        _model_init_kwargs(src, b, o)
    else:
        b.set((*mo, "activation_offload"), False, "TrainingArguments have no activation offload setting", src.path)

    liger = src.take("use_liger_kernel")
    liger_config = src.take("liger_kernel_config")
    if liger:
        b.set(("software", "kernel_backend"), "liger", o + "use_liger_kernel", src.path)
        chosen = C.liger_kernels(liger_config)
        how = "liger_kernel_config over Liger's defaults" if isinstance(liger_config, dict) else "Liger's defaults"
        if trl:  # SFTTrainer turns Liger's fused cross-entropy off: its own chunked LM head computes the loss
            chosen.pop("cross_entropy", None)
        C.kernels(
            b,
            chosen,
            o + f"use_liger_kernel: the Trainer applies {how} to the model (rope, rms_norm, swiglu, fused linear "
            "cross-entropy for Llama-like models)",
            src.path,
        )
    dpo = b.value(("training", "objective")) == "dpo"
    loss = src.take("loss_type")
    if dpo:
        # DPOTrainer scores with its fused LM head whatever the loss (dpo_trainer.py:955); its loss types combine
        # per-sequence log-probs, a few floats per row (:1386-1528)
        b.ignored.setdefault(src.path, []).append("loss_type")
    elif b.value(("training", "objective")) == "kto" and loss in (None, "kto"):
        # KTOConfig's default loss (kto_config.py): the KL batch and the KTO loss the simulated step runs; its other
        # loss, apo_zero_unpaired, has no KL batch (kto_trainer.py:815): not modelled (the finding below)
        b.ignored.setdefault(src.path, []).append("loss_type")
    elif online:
        pass  # GRPO's loss_type was read with the sampling settings (online_settings); RLOOConfig has none
    elif trl and loss in (None, "chunked_nll"):
        b.set(
            ("software", "kernels", "cross_entropy"),
            "trl_chunked_nll",
            o + f"loss_type {loss or 'not set'}: {TRL} computes the loss with its chunked LM head (chunked_nll)",
            src.path,
        )
    elif trl and loss in ("nll", "dft"):
        b.assume(
            ("software", "kernels", "cross_entropy"),
            "trl_chunked_nll",
            o + f"loss_type {loss}",
            f"TRL 1.16 computes loss_type {loss} with its fused LM head too (chunked_nll is its deprecated alias; dft "
            "weighs the per-token loss, a few per-token tensors more); TRL 1.9 computed nll on the model's logits",
            src.path,
        )
    elif loss not in (None, "nll"):
        C.not_modelled(src, b, "loss_type", loss, f"loss_type {loss!r} computes the loss differently: not modelled")
    if src.take("auto_find_batch_size"):
        b.finding(
            src.path,
            src.position("auto_find_batch_size"),
            "auto_find_batch_size",
            "the Trainer halves the batch after an out-of-memory error: the microbatch that runs may be smaller",
            "note",
        )
    _parallel(src, b, o)
    if dpo:  # a DPOConfig dump: its own fields (TRL 1.16)
        tool, label = "trl-dpo", "TRL 1.16.0 DPOConfig"
    elif b.value(("training", "objective")) == "reward":  # a RewardConfig dump (TRL 1.16)
        tool, label = "trl-reward", "TRL 1.16.0 RewardConfig"
    elif b.value(("training", "objective")) == "orpo":  # an ORPOConfig dump (TRL 1.16, trl.experimental)
        tool, label = "trl-orpo", "TRL 1.16.0 ORPOConfig"
    elif b.value(("training", "objective")) == "cpo":  # a CPOConfig dump (TRL 1.16, trl.experimental)
        tool, label = "trl-cpo", "TRL 1.16.0 CPOConfig"
    elif online:  # a GRPOConfig or RLOOConfig dump (TRL 1.16)
        objective_name = str(b.value(("training", "objective")))
        tool, label = f"trl-{objective_name}", f"TRL 1.16.0 {objective_name.upper()}Config"
    elif b.value(("training", "objective")) == "kto":  # a KTOConfig dump (TRL 1.16)
        tool, label = "trl-kto", "TRL 1.16.0 KTOConfig"
        for key in ("desirable_weight", "undesirable_weight"):  # the losses' weights: one float each (:1471-1474)
            if src.has(key):
                src.take(key)
                b.ignored.setdefault(src.path, []).append(key)
    C.account_for_rest(src, b, tool, label)


def _model_init_kwargs(src: Source, b: Builder, o: str) -> None:
    kw = src.take("model_init_kwargs") or {}
    if not isinstance(kw, dict):
        kw = {}
    dtype = C.dtype_name(kw.get("dtype") or kw.get("torch_dtype"))
    if dtype:
        b.set(("base_model", "loaded_dtype"), dtype, o + "model_init_kwargs.dtype", src.path)
    elif (kw.get("dtype") or kw.get("torch_dtype")) != "auto":
        b.assume(
            ("base_model", "loaded_dtype"),
            "float32",
            o + "model_init_kwargs.dtype not set",
            f"{TRL}: SFTTrainer loads a model id in float32 unless model_init_kwargs.dtype is set (a model you load "
            "yourself keeps its dtype)",
        )
    if kw.get("attn_implementation"):
        b.set(
            ("software", "attention_implementation"),
            str(kw["attn_implementation"]),
            o + "model_init_kwargs.attn_implementation",
            src.path,
        )
    if isinstance(kw.get("quantization_config"), dict):
        quantization(src, b, kw["quantization_config"], o + "model_init_kwargs.quantization_config")
    rest = {
        k: v
        for k, v in kw.items()
        if k
        not in (
            "dtype",
            "torch_dtype",
            "attn_implementation",
            "quantization_config",
            "device_map",
            "trust_remote_code",
            "revision",
        )
    }
    if kw.get("revision"):
        b.set(("identity", "revision"), str(kw["revision"]), o + "model_init_kwargs.revision", src.path)
    if rest:
        C.not_modelled(src, b, "model_init_kwargs", rest, f"model_init_kwargs {sorted(rest)} not modelled")


#: ``fsdp_config`` keys the import reads, or that decide wrapping or saving, not what a rank holds (transformers 5.24
#: ``TrainingArguments._fsdp_plugin_args``); FSDP1 reads more
_FSDP_READ = frozenset(
    {
        "version",
        "reshard_after_forward",
        "cpu_offload",
        "offload_params",
        "activation_checkpointing",
        "auto_wrap_policy",
        "transformer_layer_cls_to_wrap",
        "min_num_params",
        "state_dict_type",
        "cpu_ram_efficient_loading",
        "sync_module_states",
        "use_orig_params",
        "xla",
        "xla_fsdp_v2",
        "xla_fsdp_grad_ckpt",
    }
)
_FSDP1_READ = frozenset({"sharding_strategy", "backward_prefetch", "forward_prefetch", "limit_all_gathers"})


def _parallel(src: Source, b: Builder, o: str) -> None:
    ds = src.take("deepspeed")
    fsdp = src.take("fsdp")
    cfg = src.take("fsdp_config") or {}
    if ds:
        config = ds if isinstance(ds, dict) else C.read_json_beside(src, b, "deepspeed", str(ds))
        if config is not None:
            C.deepspeed(
                src, b, config, o + f"deepspeed ({ds if isinstance(ds, str) else 'inline'})", src.position("deepspeed")
            )
    if fsdp:
        items = fsdp.split() if isinstance(fsdp, str) else [str(i) for i in fsdp] if isinstance(fsdp, list) else []
        cfg = (
            {str(k).removeprefix("fsdp_") if k != "fsdp_version" else "version": v for k, v in cfg.items()}
            if isinstance(cfg, dict)
            else {}
        )
        version = as_int(src, "fsdp_config.version", cfg.get("version", 2))
        where = src.position("fsdp")
        offload = bool(cfg.get("cpu_offload") or cfg.get("offload_params") or "offload" in items)
        if version == 2:
            reshard = cfg.get("reshard_after_forward")
            if reshard is None and "shard_grad_op" in items:
                reshard = False
            elif reshard is None and "full_shard" in items:
                reshard = True
            C.fsdp2(
                src,
                b,
                o + f"fsdp {fsdp!r}, fsdp_config.version 2",
                where,
                reshard,
                offload,
                f"{TA} FSDP2 default reshard_after_forward: True",
            )
        else:
            # transformers 5.x `_apply_legacy_fsdp_to_config`: an `fsdp` strategy word becomes
            # fsdp_config["reshard_after_forward"] (the FSDP1 strategy name); "offload" becomes cpu_offload
            strategy = cfg.get("reshard_after_forward", cfg.get("sharding_strategy"))
            if strategy is None:
                strategy = next((i for i in items if C.fsdp1_strategy(i) is not None), None)
            modelled = C.fsdp1(
                src,
                b,
                o + f"fsdp {fsdp!r}, fsdp_config.version 1",
                where,
                cfg,
                strategy,
                offload,
                f"{TA} FSDP1 default reshard_after_forward 'full_shard'",
            )
            for key, default in (("backward_prefetch", "no_prefetch"), ("use_orig_params", True)):
                if modelled and key not in cfg:
                    b.assume(
                        ("parallelism", key),
                        default,
                        o + "fsdp_config",
                        f"{TA} FSDP1 default {key}: {default}",
                        src.path,
                    )
            if modelled:  # `_fsdp_plugin_args`: sync_module_states "true" unless set; the plugin forces it on
                # under cpu_ram_efficient_loading (accelerate utils/dataclasses.py 1858-1863)
                efficient = C._bool(cfg.get("cpu_ram_efficient_loading", False))
                path = ("parallelism", "sync_module_states")
                if "sync_module_states" in cfg or efficient:
                    on = efficient or C._bool(cfg["sync_module_states"])
                    key = "cpu_ram_efficient_loading" if efficient else "sync_module_states"
                    b.set(path, on, o + f"fsdp_config.{key}", src.path)
                else:
                    b.assume(path, True, o + "fsdp_config", f"{TA} FSDP1 default sync_module_states: true", src.path)
        if cfg.get("activation_checkpointing"):  # accelerate's: the checkpoint inside each unit
            for path in (("memory_options", "gradient_checkpointing"), ("parallelism", "activation_checkpointing")):
                b.set(path, True, o + "fsdp_config.activation_checkpointing", src.path)
        read = _FSDP_READ if version == 2 else _FSDP_READ | _FSDP1_READ
        rest = {k: v for k, v in cfg.items() if k not in read}
        if rest:
            C.not_modelled(src, b, "fsdp_config", rest, f"FSDP settings {sorted(rest)} are not modelled yet", where)
        C.fsdp_mixed_precision(src, b, o + "bf16/fp16 under FSDP")
    C.launched_ranks(src, b, ds or fsdp, o, "no deepspeed/fsdp")


def adapter_config(src: Source, b: Builder) -> None:
    b.tools.append(f"{PEFT} adapter_config.json ({src.path})")
    o = "adapter_config.json: "
    m = ("method",)
    peft_type = str(src.take("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        from ledgerspec.errors import LedgerspecError

        raise LedgerspecError(
            f"peft_type {peft_type}: ledgerspec sizes LoRA adapters only",
            src.path,
            *src.position("peft_type"),
            rule="import",
            hint="import a LoRA adapter_config.json",
        )
    if src.has("base_model_name_or_path"):
        b.set(
            ("identity", "model_id"), str(src.take("base_model_name_or_path")), o + "base_model_name_or_path", src.path
        )
    if src.has("revision"):
        b.set(("identity", "revision"), str(src.take("revision")), o + "revision", src.path)
    if src.has("r"):
        b.set((*m, "rank"), src.integer("r"), o + "r", src.path, src.position("r"))
    else:
        b.assume((*m, "rank"), 8, o + "r", f"{PEFT} default r: 8")
    if src.has("lora_alpha"):
        b.set((*m, "alpha"), src.take("lora_alpha"), o + "lora_alpha", src.path)
    else:
        b.assume((*m, "alpha"), 8, o + "lora_alpha", f"{PEFT} default lora_alpha: 8")
    if src.has("lora_dropout"):
        b.set((*m, "dropout"), src.number("lora_dropout"), o + "lora_dropout", src.path)
    else:
        b.assume((*m, "dropout"), 0.0, o + "lora_dropout", f"{PEFT} default lora_dropout: 0.0")
    targets = src.take("target_modules")
    if targets:
        value = sorted(targets) if isinstance(targets, list) else targets
        b.set((*m, "target_modules"), value, o + "target_modules", src.path, src.position("target_modules"))
    if src.peek("target_parameters"):
        b.set((*m, "target_parameters"), src.take("target_parameters"), o + "target_parameters", src.path)
    src.take("target_parameters")
    b.set((*m, "bias"), str(src.take("bias", "none")), o + "bias", src.path)
    for key, field in (
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
    ):
        value = src.take(key)
        if value:
            b.set((*m, field), value, o + key, src.path)
    b.set((*m, "use_dora"), bool(src.take("use_dora")), o + "use_dora", src.path)
    for key in ("task_type", "inference_mode", "peft_version", "auto_mapping", "base_model_name_or_path"):
        src.take(key)
    for key in (
        "layers_to_transform",
        "layers_pattern",
        "exclude_modules",
        "trainable_token_indices",
        "layer_replication",
        "lora_bias",
    ):
        value = src.take(key)
        if not C.is_off(value):
            C.not_modelled(
                src,
                b,
                key,
                value,
                f"{key} changes which layers get adapters: not modelled (the ledger adapts every matching module)",
            )
    C.account_for_rest(src, b, "peft", PEFT)


def model_config(src: Source, b: Builder) -> None:
    b.tools.append(f"model config.json ({src.path})")
    o = "config.json: "
    if src.has("_name_or_path"):
        b.set(("identity", "model_id"), str(src.peek("_name_or_path")), o + "_name_or_path", src.path)
    archs = src.peek("architectures")
    if isinstance(archs, list) and archs:
        b.set(("identity", "architecture"), str(archs[0]), o + "architectures", src.path)
    b.config_files.append(src.path)
    dtype = C.dtype_name(src.peek("dtype") or src.peek("torch_dtype"))
    if dtype:
        b.assume(
            ("base_model", "loaded_dtype"),
            dtype,
            o + "dtype",
            "transformers >= 5 loads the checkpoint's dtype (from_pretrained(dtype='auto')) unless the script passes "
            "one",
        )
    qc = src.peek("quantization_config")
    if isinstance(qc, dict):
        quantization(src, b, qc, o + "quantization_config", "quantization_config")
    # every other key describes the architecture: resolve reads the file through identity.config_path
    src.taken.update(src.plain)


def quantization(src: Source, b: Builder, qc: dict[str, Any], origin: str, key: str = "") -> None:
    q = ("base_model", "quantization")
    method = str(qc.get("quant_method", "bitsandbytes")).lower()
    where = src.position(key.split(".")[0]) if key else (None, None)
    if method != "bitsandbytes":
        b.set(C.QUANTIZED, True, origin + f".quant_method {method}", src.path)
        C.not_modelled(
            src,
            b,
            key or "quantization_config",
            qc,
            f"quant_method {method!r} is not modelled: ledgerspec models bitsandbytes",
            where,
        )
        return
    known = C.known_keys("bitsandbytes")
    unknown = sorted(k for k in qc if k not in known)
    for k in unknown:
        b.finding(
            src.path, where, f"{key}.{k}" if key else k, "not a BitsAndBytesConfig setting: not read", "unknown-key"
        )
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        b.set(C.QUANTIZED, True, origin + ".load_in_4bit", src.path)
        b.set((*q, "bits"), 4, origin + ".load_in_4bit", src.path)
        for k, (field, fallback) in BNB4_DEFAULTS.items():
            if k in qc and qc[k] is not None:
                v = qc[k]
                b.set((*q, field), C.dtype_name(v) or v, f"{origin}.{k}", src.path)
            else:
                b.assume(
                    (*q, field), fallback, f"{origin}.{k}", f"transformers BitsAndBytesConfig default {k}: {fallback}"
                )
        b.set((*q, "blocksize"), 64, "bitsandbytes 4-bit block size (Params4bit)", src.path)
    elif qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        b.set(C.QUANTIZED, True, origin + ".load_in_8bit", src.path)
        b.set((*q, "type"), "int8", origin + ".load_in_8bit", src.path)
        b.set((*q, "bits"), 8, origin + ".load_in_8bit", src.path)
    if qc.get("llm_int8_skip_modules"):
        b.set((*q, "skip_modules"), qc["llm_int8_skip_modules"], origin + ".llm_int8_skip_modules", src.path)
    if qc.get("llm_int8_enable_fp32_cpu_offload"):
        C.not_modelled(
            src, b, f"{key}.llm_int8_enable_fp32_cpu_offload", True, "CPU offload of modules is not modelled", where
        )


def deepspeed_file(src: Source, b: Builder) -> None:
    b.tools.append(f"DeepSpeed config ({src.path})")
    C.deepspeed(src, b, src.plain, "DeepSpeed", src.position("zero_optimization"), "zero_optimization")
    src.taken.update(src.plain)
