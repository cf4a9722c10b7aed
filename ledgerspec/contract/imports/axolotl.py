"""axolotl YAML -> intake, checked against axolotl 0.18.0 (``src/axolotl/utils/schemas/``, ``loaders/model.py``,
``loaders/adapter.py``, ``utils/config/__init__.py``).

What axolotl does that the file does not say, and the intake records (each cited in docs "From your setup"):

- QLoRA (``adapter: qlora`` + ``load_in_4bit``) builds ``BitsAndBytesConfig(bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=cfg.torch_dtype, bnb_4bit_quant_storage=torch.bfloat16)``
  updated with ``bnb_config_kwargs`` (``loaders/model.py``, ``_set_quantization_config``); ``adapter: lora`` +
  ``load_in_8bit`` is LLM.int8. ``cfg.torch_dtype`` is bfloat16 under ``bf16``, float16 under ``fp16`` or
  ``load_in_8bit``, else float32 (``utils/config/__init__.py``, ``resolve_dtype``).
- a quantized base goes through PEFT's ``prepare_model_for_kbit_training`` (``_prepare_model_for_quantization``;
  skipped under FSDP-QLoRA and ZeRO-3), after which the norms and the embeddings (``embed_tokens``, ``lm_head``) are
  cast back to ``cfg.torch_dtype`` (``_convert_embedding_modules_dtype``).
- gradient checkpointing without ``gradient_checkpointing_kwargs`` is reentrant (``normalize_config`` sets
  ``{"use_reentrant": True}``).
- LoRA/QLoRA auto-enables axolotl's fused LoRA kernels (``check_auto_enable_lora_kernels``) unless set: a custom
  autograd function ledgerspec does not model.
- ``bias="none"`` always (``_build_peft_lora_config``); the adapters stay in PEFT's float32 unless
  ``peft_autocast_adapter_dtype: false``.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.imports import common as C
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.source import Source, as_int
from ledgerspec.contract.kernels import likely_ops

TOOL = "axolotl"
LABEL = f"axolotl {C.VERSIONS['axolotl']}"
_TORCH_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}
#: attention flags -> transformers attn_implementation (``utils/schemas/enums.py``, LEGACY_ATTN_FLAG_TO_IMPL)
ATTENTION_FLAGS = {
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "flex_attention": "flex_attention",
    "eager_attention": "eager",
    "xformers_attention": "xformers",
    "sage_attention": "sage",
}
_LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")


def default(key: str, value: Any) -> str:
    return f"{LABEL} default ({key} not set): {value}"


def convert(src: Source, b: Builder) -> None:
    b.tools.append(f"{LABEL} ({src.path})")
    o = "axolotl: "

    def at(key: str) -> tuple[Any, Any]:
        return src.position(key)

    # -- identity -----------------------------------------------------------------------------------------------
    if src.has("base_model"):
        b.set(("identity", "model_id"), str(src.take("base_model")), o + "base_model", src.path, at("base_model"))
    else:
        b.unknown(("identity", "model_id"), "axolotl: base_model missing", src.path)
        b.finding(
            src.path,
            (None, None),
            "base_model",
            "base_model missing: axolotl requires it (the model to fine-tune); the intake's identity.model_id is "
            "UNKNOWN until you set it (or identity.config_path)",
            "unknown",
        )
    if src.has("revision_of_model"):
        b.set(("identity", "revision"), str(src.take("revision_of_model")), o + "revision_of_model", src.path)
    else:
        b.unknown(("identity", "revision"), "axolotl: revision_of_model not set: the Hub's latest is used", src.path)
    src.take("base_model_config")

    # -- precision ----------------------------------------------------------------------------------------------
    bf16, fp16 = src.take("bf16"), src.take("fp16")
    bfloat16, float16 = src.take("bfloat16"), src.take("float16")
    load4, load8 = bool(src.take("load_in_4bit")), bool(src.take("load_in_8bit"))
    dtype_note = None
    if bf16 == "auto" and not fp16:
        torch_dtype = "bfloat16"
        dtype_note = f"{LABEL}: bf16: auto turns bf16 on where the GPU supports it (Ampere or newer), else fp16"
    elif bf16 is True or bfloat16:
        torch_dtype = "bfloat16"
    elif load8 or fp16 or float16:
        torch_dtype = "float16"
    else:
        torch_dtype = "float32"
    why = "bf16/fp16/load_in_8bit -> cfg.torch_dtype (resolve_dtype)"
    if dtype_note:
        b.assume(("base_model", "loaded_dtype"), torch_dtype, o + why, dtype_note, src.path)
        b.assume(("training", "mixed_precision"), "bf16", o + "bf16: auto", dtype_note, src.path)
    else:
        b.set(("base_model", "loaded_dtype"), torch_dtype, o + why, src.path, at("bf16"))
        mp = "bf16" if bf16 is True else "fp16" if fp16 else "no"
        b.set(("training", "mixed_precision"), mp, o + "bf16/fp16 (TrainingArguments)", src.path, at("bf16"))

    # -- method -------------------------------------------------------------------------------------------------
    adapter = src.take("adapter")
    full = adapter is None  # no adapter: axolotl fine-tunes every parameter of the model
    if adapter not in ("lora", "qlora", None):
        from ledgerspec.errors import LedgerspecError

        raise LedgerspecError(
            f"adapter {adapter!r}: ledgerspec sizes LoRA, QLoRA and full fine-tunes only",
            src.path,
            *src.position("adapter"),
            rule="import",
            hint="set adapter: lora or qlora (or leave it out for a full fine-tune), or size this run another way",
        )
    if full and (load4 or load8):
        from ledgerspec.errors import LedgerspecError

        key = "load_in_4bit" if load4 else "load_in_8bit"
        raise LedgerspecError(
            f"{key} without an adapter: a full fine-tune of a quantized base (quantized weights cannot be trained)",
            src.path,
            *src.position(key),
            rule="import",
            hint="set adapter: qlora (or lora with load_in_8bit), or remove the quantization for a full fine-tune",
        )
    if full:
        b.set(("method", "kind"), "full", o + "no adapter: every parameter trained", src.path)
        lora_keys = [k for k in src.left() if k.startswith(("lora_", "peft_"))]  # read with an adapter only
        if lora_keys:  # a forgotten `adapter:` turns a LoRA run into a full fine-tune: many times the memory
            b.finding(
                src.path,
                src.position(lora_keys[0]),
                lora_keys[0],
                f"{', '.join(lora_keys)} without adapter: axolotl ignores them and fine-tunes every parameter (sized "
                "here as a full fine-tune); did you forget `adapter: lora` (or `adapter: qlora`)?",
                "conflict",
            )
        for key in lora_keys:
            src.take(key)
            b.ignored.setdefault(src.path, []).append(key)
    elif adapter == "qlora" or (adapter == "lora" and load8):
        b.set(("method", "kind"), "QLoRA", o + f"adapter: {adapter}" + (" + load_in_8bit" if load8 else ""), src.path)
    elif adapter == "lora":
        b.set(("method", "kind"), "LoRA", o + "adapter: lora", src.path, at("adapter"))
        if load4:
            b.finding(
                src.path,
                at("load_in_4bit"),
                "load_in_4bit",
                f"with adapter: lora, {LABEL} builds no 4-bit quantization config (only adapter: qlora does): the base "
                "is read as not quantized",
                "note",
            )
    if not full:
        _lora(src, b, o)
        b.set(("method", "bias"), "none", o + "always bias='none' (loaders/adapter.py)", src.path)

    # -- base model ---------------------------------------------------------------------------------------------
    quantized = (adapter == "qlora" and load4) or (adapter == "lora" and load8)
    b.set(C.QUANTIZED, quantized, o + f"adapter {adapter}, load_in_4bit {load4}, load_in_8bit {load8}")
    kwargs = src.take("bnb_config_kwargs") or {}
    fsdp_on = bool(src.peek("fsdp_config") or src.peek("fsdp"))
    deepspeed_ref = src.peek("deepspeed")
    ds_config: dict[str, Any] | None = None
    if isinstance(deepspeed_ref, dict):
        ds_config = deepspeed_ref
    elif deepspeed_ref:
        ds_config = C.read_json_beside(src, b, "deepspeed", str(deepspeed_ref))
    zero3 = _zero3(ds_config if ds_config is not None else deepspeed_ref)
    if adapter == "qlora" and load4:
        _bnb4(src, b, torch_dtype, kwargs if isinstance(kwargs, dict) else {})
    elif quantized:  # lora + load_in_8bit
        q = ("base_model", "quantization")
        b.set((*q, "type"), "int8", o + "load_in_8bit (BitsAndBytesConfig(load_in_8bit=True))", src.path)
        b.set((*q, "bits"), 8, o + "load_in_8bit", src.path)
    if quantized:
        skip = fsdp_on or zero3
        reason = "FSDP/ZeRO-3 skip it" if skip else "a quantized base goes through it"
        b.set(
            ("base_model", "prepare_for_kbit_training"),
            not skip,
            o + f"prepare_model_for_kbit_training: {reason} (loaders/model.py)",
            src.path,
        )
        if not skip and not (adapter == "qlora" and fsdp_on):
            dt = {"norm": torch_dtype, "embed_tokens": torch_dtype, "lm_head": torch_dtype}
            b.set(
                ("base_model", "module_dtypes"),
                dt,
                o
                + "norms and embeddings cast back to cfg.torch_dtype after prepare (_convert_embedding_modules_dtype)",
                src.path,
            )
        if zero3 is None and isinstance(deepspeed_ref, str):
            b.finding(
                src.path,
                at("deepspeed"),
                "deepspeed",
                "the DeepSpeed file could not be read: prepare_model_for_kbit_training is taken to run (axolotl "
                "skips it "
                "under ZeRO-3)",
                "note",
            )
    else:
        b.set(("base_model", "prepare_for_kbit_training"), False, o + "the base is not quantized", src.path)
    src.take("embeddings_skip_upcast")
    autocast = src.take("peft_autocast_adapter_dtype")
    if full:
        pass  # no adapters: the weights keep cfg.torch_dtype
    elif autocast is False:
        b.set(("adapter", "dtype"), torch_dtype, o + "peft_autocast_adapter_dtype: false", src.path)
    else:
        b.assume(
            ("adapter", "dtype"),
            "float32",
            o + "PEFT's get_peft_model(autocast_adapter_dtype=True)",
            f"{LABEL} leaves peft_autocast_adapter_dtype unset: PEFT 0.21 upcasts the adapters to float32",
            src.path,
        )

    # -- workload -----------------------------------------------------------------------------------------------
    w = ("workload",)
    _int(src, b, "sequence_len", (*w, "max_length"), 512)
    if src.take("pad_to_sequence_len"):
        b.entries[(*w, "max_length")].origin += "; pad_to_sequence_len pads every row to it"
    packing = src.take("sample_packing")
    if packing is None:
        b.assume((*w, "packing"), False, o + "sample_packing", default("sample_packing", "off"), src.path)
    else:
        b.set((*w, "packing"), bool(packing), o + "sample_packing", src.path, at("sample_packing"))
        if packing:
            b.set((*w, "packing_strategy"), "multipack", o + "sample_packing (multipack, per-sequence position_ids)")
    _int(src, b, "micro_batch_size", (*w, "microbatch"), 1)
    batch = src.take("batch_size")
    if batch and not src.has("gradient_accumulation_steps") and src.has("micro_batch_size"):
        accum = as_int(src, "batch_size", batch) // max(
            1, as_int(src, "micro_batch_size", src.peek("micro_batch_size"))
        )
        why = o + "batch_size // micro_batch_size (normalize_config)"
        b.set((*w, "gradient_accumulation"), accum, why, src.path, src.position("batch_size"))
    _int(src, b, "gradient_accumulation_steps", (*w, "gradient_accumulation"), 1)

    # -- training step ------------------------------------------------------------------------------------------
    b.set(("training", "loop"), "trainer", o + "trains with transformers' Trainer (AxolotlTrainer)")
    C.max_grad_norm(src, b, o, "max_grad_norm not set", f"{LABEL} passes no max_grad_norm: ")
    b.assume(
        ("training", "use_cache"),
        False,
        o + "TrainingArguments.use_cache",
        "transformers 5.24 Trainer sets model.config.use_cache = args.use_cache (default False)",
        src.path,
    )

    # -- optimizer ----------------------------------------------------------------------------------------------
    if src.has("optimizer"):
        C.optimizer(src, b, "optimizer", src.take("optimizer"), o + "optimizer")
    else:
        b.assume(("optimizer", "name"), "adamw_torch_fused", o + "optimizer", default("optimizer", "adamw_torch_fused"))
    if src.has("optim_args"):
        C.not_modelled(
            src, b, "optim_args", src.take("optim_args"), "optimizer arguments are not modelled (state size only)"
        )

    # -- memory options -----------------------------------------------------------------------------------------
    _checkpointing(src, b, o, adapter)
    if src.has("unfrozen_parameters"):
        C.not_modelled(
            src,
            b,
            "unfrozen_parameters",
            src.take("unfrozen_parameters"),
            "unfrozen base parameters train in full beside the adapters: not modelled (list them in "
            "method.modules_to_save if they are whole modules)",
        )

    # -- attention and kernels ------------------------------------------------------------------------------------
    _attention(src, b, o)
    _kernels(src, b, adapter, load8)
    _objective(src, b, o)

    # -- parallelism --------------------------------------------------------------------------------------------
    _parallel(src, b, o, ds_config)
    C.account_for_rest(src, b, TOOL, LABEL)


def _lora(src: Source, b: Builder, o: str) -> None:
    m = ("method",)
    if src.has("lora_r"):
        b.set((*m, "rank"), src.integer("lora_r"), o + "lora_r", src.path, src.position("lora_r"))
    else:
        b.unknown((*m, "rank"), o + "lora_r not set", src.path)
    if src.has("lora_alpha"):
        b.set((*m, "alpha"), src.take("lora_alpha"), o + "lora_alpha", src.path)
    if src.has("lora_dropout"):
        b.set((*m, "dropout"), src.number("lora_dropout"), o + "lora_dropout", src.path)
    else:
        b.assume((*m, "dropout"), 0.0, o + "lora_dropout", default("lora_dropout", 0.0), src.path)
    targets = src.take("lora_target_modules")
    linear = src.take("lora_target_linear")
    if linear:
        b.set(
            (*m, "target_modules"),
            "all-linear",
            o + "lora_target_linear: every Linear except the output layer (find_all_linear_names)",
            src.path,
            src.position("lora_target_linear"),
        )
        if targets:
            b.finding(
                src.path,
                src.position("lora_target_modules"),
                "lora_target_modules",
                f"axolotl adds {targets!r} to every linear layer; the ledger says all-linear: list the modules by hand "
                "if any of these is not a Linear layer",
                "note",
            )
    elif targets:
        b.set((*m, "target_modules"), targets, o + "lora_target_modules", src.path, src.position("lora_target_modules"))
        if isinstance(targets, str) and "," in targets:  # a list written as one string (a regex has no use for it)
            b.finding(
                src.path,
                src.position("lora_target_modules"),
                "lora_target_modules",
                f"{targets!r} is one string: PEFT matches a string as one regular expression against each module's "
                "whole name (a comma-separated list matches none); write a list, e.g. [q_proj, v_proj]",
                "conflict",
            )
    if src.has("lora_target_parameters"):
        b.set((*m, "target_parameters"), src.take("lora_target_parameters"), o + "lora_target_parameters", src.path)
    if not linear and not targets and not b.read_from_file((*m, "target_parameters")):
        b.unknown((*m, "target_modules"), o + "no lora_target_modules / lora_target_linear", src.path)
    for key, field in (
        ("lora_modules_to_save", "modules_to_save"),
        ("lora_rank_pattern", "rank_pattern"),
        ("lora_alpha_pattern", "alpha_pattern"),
    ):
        if src.has(key):
            b.set((*m, field), src.take(key), o + key, src.path)
    if src.has("peft_use_dora"):
        b.set((*m, "use_dora"), bool(src.take("peft_use_dora")), o + "peft_use_dora", src.path)
    else:
        b.assume((*m, "use_dora"), False, o + "peft_use_dora", default("peft_use_dora", "off (PEFT use_dora=False)"))


def _bnb4(src: Source, b: Builder, torch_dtype: str, kwargs: dict[str, Any]) -> None:
    q = ("base_model", "quantization")
    o = "axolotl: adapter qlora + load_in_4bit -> BitsAndBytesConfig"
    fixed = {
        "type": ("bnb_4bit_quant_type", "nf4"),
        "double_quant": ("bnb_4bit_use_double_quant", True),
        "compute_dtype": ("bnb_4bit_compute_dtype", torch_dtype),
        "storage_dtype": ("bnb_4bit_quant_storage", "bfloat16"),
    }
    for field, (key, value) in fixed.items():
        if key in kwargs:
            v = kwargs[key]
            b.set((*q, field), C.dtype_name(v) or v, f"axolotl: bnb_config_kwargs.{key}", src.path)
        else:
            extra = (
                " (float32 for jamba, qwen2_moe, nemotron_h without DeepSpeed/FSDP)" if field == "storage_dtype" else ""
            )
            b.set((*q, field), value, f"{o}({key}={value!r}) (loaders/model.py){extra}", src.path)
    b.set((*q, "bits"), 4, "axolotl: load_in_4bit", src.path)
    b.set((*q, "blocksize"), 64, "bitsandbytes 4-bit block size (Params4bit)", src.path)
    rest = {k: v for k, v in kwargs.items() if k not in {key for key, _ in fixed.values()}}
    if rest.get("llm_int8_skip_modules"):
        b.set((*q, "skip_modules"), rest.pop("llm_int8_skip_modules"), "axolotl: bnb_config_kwargs", src.path)
    rest = {
        k: v for k, v in rest.items() if k not in ("llm_int8_threshold", "llm_int8_has_fp16_weight", "load_in_4bit")
    }
    if rest:
        C.not_modelled(src, b, "bnb_config_kwargs", rest, f"bnb_config_kwargs {sorted(rest)} not modelled")


def _int(src: Source, b: Builder, key: str, path: tuple[str, ...], fallback: int) -> None:
    if src.has(key):
        b.set(path, src.integer(key), "axolotl: " + key, src.path, src.position(key))
    else:
        b.assume(path, fallback, "axolotl: " + key, default(key, fallback), src.path)


_OFFLOAD_MODES = {"disk": "to disk", "hidden_states": "the checkpointed hidden states only", "legacy": "one stream"}


def _checkpointing(src: Source, b: Builder, o: str, adapter: Any) -> None:
    mo = ("memory_options",)
    gc = src.take("gradient_checkpointing")
    kwargs = src.take("gradient_checkpointing_kwargs")
    if gc is None:
        b.assume(
            (*mo, "gradient_checkpointing"),
            False,
            o + "gradient_checkpointing",
            default("gradient_checkpointing", False),
        )
    else:
        b.set((*mo, "gradient_checkpointing"), bool(gc), o + f"gradient_checkpointing: {gc}", src.path)
    if gc in ("offload", "offload_disk"):
        b.set((*mo, "activation_offload"), True, o + f"gradient_checkpointing: {gc}", src.path)
        b.set((*mo, "offload_mode"), f"axolotl gradient_checkpointing {gc}", o + "gradient_checkpointing", src.path)
    if gc:
        if isinstance(kwargs, dict) and "use_reentrant" in kwargs:
            kind = "reentrant" if kwargs["use_reentrant"] else "non-reentrant"
            b.set((*mo, "checkpointing_kind"), kind, o + "gradient_checkpointing_kwargs.use_reentrant", src.path)
        elif src.peek("unfrozen_parameters") is None and src.peek("rl") is None:
            b.set(
                (*mo, "checkpointing_kind"),
                "reentrant",
                o + "no gradient_checkpointing_kwargs: normalize_config sets use_reentrant: true",
                src.path,
            )
        else:
            b.assume(
                (*mo, "checkpointing_kind"),
                "non-reentrant",
                o + "gradient_checkpointing_kwargs",
                f"{LABEL} passes use_reentrant: false to the Trainer when no kwargs are set",
                src.path,
            )
    ao = src.take("activation_offloading")
    if ao:
        b.set((*mo, "activation_offload"), True, o + f"activation_offloading: {ao}", src.path)
        b.set((*mo, "offload_mode"), f"axolotl activation_offloading {ao}", o + "activation_offloading", src.path)
    mode = ao if ao not in (None, True, False) else ("disk" if gc == "offload_disk" else None)
    if mode in ("disk", "hidden_states", "legacy"):
        b.finding(
            src.path,
            src.position("activation_offloading" if ao else "gradient_checkpointing"),
            "activation_offloading",
            f"offloading mode {mode} ({_OFFLOAD_MODES[mode]}) is estimated as TRL's streamed offloading to pinned "
            "host memory: not modelled as such",
            "not-modelled",
        )
    elif not gc or gc is True:
        b.set((*mo, "activation_offload"), False, o + "activation_offloading not set", src.path)
    if (ao in (True, "legacy", "disk") or gc in ("offload", "offload_disk")) and adapter in ("lora", "qlora"):
        # the trainer's gradient_checkpointing is turned off and adapters get no recompute wrap: every saved
        # activation is offloaded, none recomputed (core/builders/base.py, loaders/model.py)
        b.entries.pop((*mo, "gradient_checkpointing"), None)
        b.entries.pop((*mo, "checkpointing_kind"), None)
        b.set(
            (*mo, "gradient_checkpointing"),
            False,
            o + "activation offloading on a LoRA/QLoRA run: axolotl turns the Trainer's gradient checkpointing off and "
            "offloads the activations instead of recomputing them",
            src.path,
        )


def _attention(src: Source, b: Builder, o: str) -> None:
    impl = src.take("attn_implementation")
    flags = [k for k in ATTENTION_FLAGS if src.take(k)]
    if impl:
        b.set(("software", "attention_implementation"), str(impl), o + "attn_implementation", src.path)
    elif flags:
        b.set(("software", "attention_implementation"), ATTENTION_FLAGS[flags[0]], o + f"{flags[0]}: true", src.path)
    else:
        b.assume(
            ("software", "attention_implementation"),
            "sdpa",
            o + "no attention setting",
            "transformers picks sdpa by default where the model supports it",
            src.path,
        )


#: axolotl's LoRA kernel switches -> (kernel id, the projections that must all carry LoRA for it to attach:
#: ``monkeypatch/lora_kernels.py`` patches q/k/v together, o alone, gate/up/down together)
_LORA_KERNEL_IDS = {
    "lora_mlp_kernel": ("axolotl_lora_mlp", ("gate_proj", "up_proj", "down_proj")),
    "lora_qkv_kernel": ("axolotl_lora_qkv", ("q_proj", "k_proj", "v_proj")),
    "lora_o_kernel": ("axolotl_lora_o", ("o_proj",)),
}
#: axolotl's Liger plugin switches (``integrations/liger/args.py``; unset is off) -> Liger's switch names
_LIGER_FLAGS = {
    "liger_rope": "rope",
    "liger_rms_norm": "rms_norm",
    "liger_layer_norm": "layer_norm",
    "liger_glu_activation": "swiglu",
    "liger_swiglu": "swiglu",
    "liger_cross_entropy": "cross_entropy",
    "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy",
}


def _kernels(src: Source, b: Builder, adapter: Any, load8: bool) -> None:
    """``software.kernels`` as axolotl will run them: its LoRA kernels (auto-enabled for LoRA/QLoRA when no
    ``lora_*_kernel`` is set: ``check_auto_enable_lora_kernels``, ``utils/schemas/validation.py``
    ``lora_kernels_auto_enable``), the Liger plugin's switches and the Cut Cross-Entropy plugin."""
    o = "axolotl: "
    set_kernels = {k: src.take(k) for k in _LORA_KERNELS if src.has(k)}
    on = [k for k, v in set_kernels.items() if v]
    auto = (
        not set_kernels
        and adapter in ("lora", "qlora")
        and not (adapter == "lora" and load8)
        and not src.peek("rl")
        and not src.peek("nvfp4_merge_aware")
        and not src.peek("trust_remote_code")
        and not (src.peek("fsdp_config") and str(src.peek("fsdp_version")) != "2")
    )
    targets = b.entries.get(("method", "target_modules"))
    wrapped = targets.value if targets is not None else None

    def attaches(projections: tuple[str, ...]) -> bool:
        if wrapped == "all-linear":
            return True
        names = [wrapped] if isinstance(wrapped, str) else list(wrapped or [])
        return all(any(p == n or str(n).endswith(p) for n in names) for p in projections)

    if on or auto:
        why = (
            f"{', '.join(on)} true"
            if on
            else f"{LABEL} auto-enables lora_mlp_kernel, lora_qkv_kernel, lora_o_kernel and lora_embedding_kernel "
            "for LoRA/QLoRA when none is set (check_auto_enable_lora_kernels)"
        )
        ids = [kid for key, (kid, group) in _LORA_KERNEL_IDS.items() if (auto or key in on) and attaches(group)]
        b.set(("software", "kernel_backend"), "axolotl LoRA kernels", "axolotl: " + why, src.path)
        if ids:
            b.set(
                ("software", "kernels", "lora_projections"),
                ids,
                o + why + "; each attaches where all its projections carry LoRA (apply_lora_kernel_patches)",
                src.path,
            )
            b.set(("software", "kernels", "packages"), {"axolotl": C.VERSIONS["axolotl"]}, o + "the kernels' package")
        b.finding(
            src.path,
            src.position(on[0]) if on else src.position("adapter"),
            on[0] if on else "adapter",
            f"{why}: fused LoRA autograd kernels that save other tensors than PEFT's layers, declared in "
            "software.kernels.lora_projections where they attach (the estimate models them)",
            "note",
        )
    elif set_kernels and adapter in ("lora", "qlora"):
        b.set(
            ("software", "kernels", "lora_projections"), ["eager"], o + "lora_*_kernel false: PEFT's layers", src.path
        )
    plugins = src.take("plugins") or []
    plugins = [str(p) for p in plugins] if isinstance(plugins, list) else [str(plugins)]
    liger = any("liger" in p.lower() for p in plugins)
    cce = any("cut_cross_entropy" in p.lower() for p in plugins)
    flags = {key: src.take(key) for key in _LIGER_FLAGS if src.has(key)}
    if liger:
        chosen: dict[str, str] = {}
        for key, value in flags.items():
            op, name = C.LIGER_SWITCHES[_LIGER_FLAGS[key]]
            if value:
                if key in ("liger_glu_activation", "liger_swiglu") and "gemma" in str(src.peek("base_model")).lower():
                    name = "liger_geglu"
                chosen[op] = name
        if chosen:
            C.kernels(b, chosen, o + "LigerPlugin with " + ", ".join(k for k, v in flags.items() if v), src.path)
    elif any(flags.values()):
        for key, value in flags.items():
            if value:
                C.not_modelled(
                    src,
                    b,
                    key,
                    value,
                    "a Liger switch without axolotl.integrations.liger.LigerPlugin in "
                    "plugins: axolotl does not apply it",
                )
    if cce:
        setting = src.take("cut_cross_entropy")
        if setting is None or setting:
            b.set(
                ("software", "kernels", "cross_entropy"),
                "cut_cross_entropy",
                o + "CutCrossEntropyPlugin (cut_cross_entropy defaults to true when the plugin is listed)",
                src.path,
            )
    other = [p for p in plugins if "liger" not in p.lower() and "cut_cross_entropy" not in p.lower()]
    for p in other:
        b.finding(src.path, src.position("plugins"), "plugins", f"plugin {p} is not modelled", "not-modelled")
    kernel_like = [p for p in other if likely_ops(p)]
    if kernel_like:
        b.set(("software", "kernels", "other"), kernel_like, o + "plugins that replace kernels", src.path)


#: axolotl's ``rl:`` values (``utils/schemas/enums.py`` RLType) -> ``training.objective``: IPO is DPO's trainer with
#: another loss, SimPO CPO's
_RL = {"dpo": "dpo", "ipo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "cpo", "cpo": "cpo", "grpo": "grpo"}


def _objective(src: Source, b: Builder, o: str) -> None:
    """``training.objective``: ``rl:`` names the TRL trainer axolotl builds; without it, supervised fine-tuning."""
    rl = src.take("rl")
    if not rl:
        b.set(("training", "objective"), "sft", o + "no rl: supervised fine-tuning", src.path)
        return
    value = _RL.get(str(rl).strip().lower())
    if value is None:
        C.not_modelled(src, b, "rl", rl, f"rl: {rl} is not an objective the ledger names")
        return
    b.set(("training", "objective"), value, o + f"rl: {rl}", src.path, src.position("rl"))
    trl = src.take("trl") if src.has("trl") else None  # axolotl's `trl:` block: TRL's GRPO/RLOO config fields
    trl = trl if isinstance(trl, dict) else {}
    C.objective_settings(b, trl, o + "trl.", src.path)
    _trl_rest(src, b, value, trl)
    length = b.entries.get(("workload", "max_length"))
    if value == "grpo" and length is not None:
        # axolotl 0.18 bounds no GRPO row by sequence_len: it drops or truncates no GRPO sample (utils/data/rl.py:
        # 177-178, 292) and keeps max_length and max_prompt_length out of GRPOConfig (core/trainers/grpo/__init__.py:
        # 239-245); a row is the data's prompt + trl.max_completion_length
        del b.entries[("workload", "max_length")]
        b.unknown(
            ("workload", "max_length"),
            o + "rl: grpo: sequence_len bounds no GRPO row (axolotl 0.18); give the longest prompt + "
            "trl.max_completion_length (LedgerCallback fills it from a run)",
            src.path,
        )
    precomputed = src.take("precompute_ref_log_probs") if src.has("precompute_ref_log_probs") else None
    beta = src.take("rl_beta") if src.has("rl_beta") else None  # DPO's/KTO's beta: one float in the loss
    if beta is not None:
        b.ignored.setdefault(src.path, []).append("rl_beta")
    C.reference(b, value, precomputed, trl.get("beta", beta), o, src.path)
    adapter = b.entries.get(("adapter", "dtype"))
    if value in ("dpo", "kto") and b.value(C.QUANTIZED) and adapter is not None and adapter.assumed:
        # axolotl hands TRL's DPOTrainer/KTOTrainer a peft_config: it wraps the model, then casts the trainable
        # parameters of a quantized model to bfloat16 (TRL 1.16, dpo_trainer.py:717-725, kto_trainer.py:777-780)
        trainer, where = (
            ("DPOTrainer", "dpo_trainer.py:717-725") if value == "dpo" else ("KTOTrainer", "kto_trainer.py:777-780")
        )
        del b.entries[("adapter", "dtype")]
        b.assume(
            ("adapter", "dtype"),
            "bfloat16",
            o + f"rl: {value} on a quantized base",
            f"TRL 1.16 {trainer} casts the adapters of a quantized model to bfloat16 ({where})",
            src.path,
        )


def _trl_rest(src: Source, b: Builder, objective: str, trl: dict[str, Any]) -> None:
    """The ``trl:`` keys beyond ``training.objective_settings`` and ``beta``, each accounted for as a GRPOConfig dump's
    are (:func:`ledgerspec.contract.imports.hf.online_settings`): at TRL's default or changing no tensor of the step,
    read (``x-import.ignored``); another sampling or loss setting, not modelled; axolotl's own (``reward_funcs``, the
    reward functions' names; ``reward_processing_classes``; ``vllm_*`` server settings) read."""
    defaults = {**C.ONLINE_DEFAULTS, **({"loss_type": "dapo"} if objective == "grpo" else {})}
    for key, v in trl.items():
        if key in C.OBJECTIVE_SETTINGS or key == "beta":
            continue
        if key in defaults and not (v == defaults[key] or (defaults[key] is None and C.is_off(v))):
            C.not_modelled(
                src,
                b,
                f"trl.{key}",
                v,
                f"trl.{key}: {v!r}: the simulated {objective.upper()} step runs TRL's default ({defaults[key]!r}); "
                "not modelled",
            )
        elif key in defaults or key in C.ONLINE_IGNORED or key in _TRL_OWN or C.is_off(v):
            b.ignored.setdefault(src.path, []).append(f"trl.{key}")
        else:
            C.not_modelled(src, b, f"trl.{key}", v, "may change training memory and is not modelled: not carried over")


#: axolotl's own ``trl:`` keys (``utils/schemas/trl.py`` TRLConfig) that name things rather than size them
_TRL_OWN = frozenset({"reward_funcs", "reward_processing_classes", "rollout_func", "vllm_device", "vllm_dtype"})


def _zero3(ref: Any) -> bool | None:
    """Whether a DeepSpeed setting is ZeRO-3 when it can be told from the value (a dict, or a file name that says
    ``zero3``, as axolotl's bundled ``deepspeed_configs/zero3*.json`` do); None when it cannot."""
    if isinstance(ref, dict):
        zero = ref.get("zero_optimization") or {}
        return isinstance(zero, dict) and zero.get("stage") == 3
    if isinstance(ref, str):
        return True if "zero3" in ref.lower() else None
    return False


def _parallel(src: Source, b: Builder, o: str, ds_config: dict[str, Any] | None) -> None:
    ds = src.take("deepspeed")
    fsdp_cfg = src.take("fsdp_config")
    fsdp_list = src.take("fsdp")
    version = src.take("fsdp_version")
    if ds:
        if ds_config is not None:
            C.deepspeed(
                src,
                b,
                ds_config,
                f"axolotl: deepspeed ({ds if isinstance(ds, str) else 'inline'})",
                src.position("deepspeed"),
            )
    if fsdp_cfg or fsdp_list:
        cfg = {str(k).removeprefix("fsdp_") if k != "fsdp_version" else k: v for k, v in (fsdp_cfg or {}).items()}
        version = as_int(src, "fsdp_version", version or cfg.get("fsdp_version") or cfg.get("version") or 1)
        where = src.position("fsdp_config" if fsdp_cfg else "fsdp")
        if int(version) == 2:
            C.fsdp2(
                src,
                b,
                "axolotl: fsdp_version 2",
                where,
                cfg.get("reshard_after_forward"),
                cfg.get("offload_params"),
                "FSDP2 fully_shard default reshard_after_forward=True (axolotl passes none)",
            )
            if cfg.get("activation_checkpointing"):
                b.set(
                    ("memory_options", "gradient_checkpointing"), True, "axolotl: fsdp_config.activation_checkpointing"
                )
        else:  # FSDP1: axolotl 0.18's default without fsdp_version
            items = (
                fsdp_list.split()
                if isinstance(fsdp_list, str)
                else [str(i) for i in fsdp_list]
                if isinstance(fsdp_list, list)
                else []
            )
            strategy = cfg.get("sharding_strategy", cfg.get("reshard_after_forward"))
            if strategy is None:
                strategy = next((i for i in items if C.fsdp1_strategy(i) is not None), None)
            C.fsdp1(
                src,
                b,
                f"axolotl: FSDP version {version}",
                where,
                cfg,
                strategy,
                cfg.get("offload_params") or "offload" in items,
                "accelerate's FSDP1 default sharding strategy",
            )
            if cfg.get("activation_checkpointing"):
                b.set(
                    ("memory_options", "gradient_checkpointing"), True, "axolotl: fsdp_config.activation_checkpointing"
                )
        rest = {
            k: v
            for k, v in cfg.items()
            if k
            not in (
                "fsdp_version",
                "version",
                "reshard_after_forward",
                "offload_params",
                "activation_checkpointing",
                "auto_wrap_policy",
                "transformer_layer_cls_to_wrap",
                "state_dict_type",
                "final_state_dict_type",
                "sync_module_states",
                "use_orig_params",
                "sharding_strategy",
                "backward_prefetch",
                "forward_prefetch",
                "limit_all_gathers",
            )
        }
        if rest:
            C.not_modelled(src, b, "fsdp_config", rest, f"FSDP settings {sorted(rest)} are not modelled yet", where)
        C.fsdp_mixed_precision(src, b, "axolotl: bf16/fp16 under FSDP")
    multi = ds or fsdp_cfg or fsdp_list
    launcher = "the launcher (accelerate/torchrun)"
    C.launched_ranks(src, b, multi, "axolotl: ", "no deepspeed/fsdp settings", launcher, "`accelerate launch`")
    for key in ("ddp",):
        src.take(key)
    for key in (
        "dp_shard_size",
        "dp_replicate_size",
        "context_parallel_size",
        "tensor_parallel_size",
        "sequence_parallel_degree",
    ):
        if src.has(key) and src.peek(key) not in (1, None):
            C.not_modelled(src, b, key, src.take(key), f"{key} is not modelled: ledgerspec models data parallelism")
