"""What the importers share: the tools' key lists, the settings that do not change memory, dtype, optimizer,
DeepSpeed and FSDP mappings, and the accounting of the keys no mapping read (never a silent drop)."""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from typing import Any

from ledgerspec.contract import dtypes
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.source import Source, position_in
from ledgerspec.contract.optimizers import OPTIMIZERS

#: ``base_model.quantized``, which the importers write into a new intake (only ``contract/config.py`` reads it)
QUANTIZED = ("base_model", "quantized")
#: the versions whose sources the mappings were checked against (docs "From your setup" cites them)
VERSIONS = {
    "axolotl": "0.18.0",
    "llamafactory": "0.9.5",
    "transformers": "5.24.0",
    "trl": "1.9.0",
    "peft": "0.21.2",
    "accelerate": "1.15.0",
}


@cache
def known_keys(tool: str) -> frozenset[str]:
    """Every key ``tool`` accepts at :data:`VERSIONS` (``keys/<tool>.txt``, written by ``scripts/import-keys``)."""
    text = resources.files("ledgerspec.contract.imports").joinpath("keys", f"{tool}.txt").read_text("utf-8")
    keys = frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    # an SFTConfig is a TrainingArguments: a dump from an older transformers holds that version's fields too
    return keys | known_keys("transformers") if tool.startswith("trl") else keys


#: settings that change what is learned, logged or saved, not what is resident during a step
IGNORED = frozenset(
    """
    accelerator_config megatron_core qalora_group_size
    learning_rate lr lr_scheduler lr_scheduler_type lr_scheduler_kwargs lr_quadratic_warmup lr_div_factor
    cosine_min_lr_ratio cosine_constant_lr_ratio warmup_steps warmup_ratio weight_decay adam_beta1 adam_beta2
    adam_beta3 adam_epsilon adam_epsilon2 num_epochs num_train_epochs max_steps seed data_seed full_determinism
    output_dir overwrite_output_dir logging_dir logging_steps logging_strategy logging_first_step
    logging_nan_inf_filter log_level log_level_replica log_on_each_node disable_tqdm report_to run_name project
    save_steps save_strategy save_total_limit save_only_model save_safetensors save_on_each_node saves_per_epoch
    save_first_step eval_steps eval_strategy evaluation_strategy evals_per_epoch eval_delay eval_on_start
    eval_accumulation_steps eval_do_concat_batches eval_use_gather_object per_device_eval_batch_size eval_batch_size
    do_train do_eval do_predict prediction_loss_only val_set_size metric_for_best_model greater_is_better
    load_best_model_at_end early_stopping_patience resume_from_checkpoint auto_resume_from_checkpoints
    ignore_data_skip restore_callback_states_from_checkpoint push_to_hub hub_model_id hub_strategy hub_token
    hub_private_repo hub_always_push hub_revision hub_model_revision push_dataset_to_hub hf_use_auth_token
    dataset_prepared_path datasets test_datasets dataset dataset_dir eval_dataset template dataset_processes
    dataset_num_proc preprocessing_num_workers dataloader_num_workers dataloader_pin_memory
    dataloader_prefetch_factor dataloader_persistent_workers dataloader_drop_last dataloader_in_order
    dataloader_multiprocessing_context remove_unused_columns label_names length_column_name include_for_metrics
    include_num_input_tokens_seen batch_eval_metrics skip_memory_metrics trackio_space_id trackio_bucket_id
    trackio_static_space_id wandb_project wandb_entity wandb_watch wandb_name wandb_run_id wandb_log_model
    mlflow_tracking_uri mlflow_experiment_name comet_api_key comet_workspace comet_project_name use_tensorboard
    use_wandb use_mlflow use_comet use_swanlab use_trackio special_tokens tokens chat_template chat_template_jinja
    default_system_message train_on_inputs tokenizer_type tokenizer_config tokenizer_use_fast tokenizer_legacy
    tokenizer_name_or_path model_type strict shuffle_merged_datasets shuffle_before_merging_datasets overwrite_cache
    plot_loss max_samples val_size ddp_timeout ddp_backend ddp_find_unused_parameters ddp_broadcast_buffers
    ddp_bucket_cap_mb ddp_static_graph debug label_smoothing_factor neftune_noise_alpha lr_scheduler_warmup_steps
    dataset_text_field dataset_kwargs shuffle_dataset eos_token pad_token chat_template_path completion_only_loss
    assistant_only_loss truncation_mode eval_packing router_aux_loss_coef tf32 use_rslora peft_use_rslora
    loraplus_lr_ratio loraplus_lr_embedding lora_fan_in_fan_out fan_in_fan_out init_lora_weights
    peft_init_lora_weights train_sampling_strategy average_tokens_across_devices enable_jit_checkpoint use_cpu
    local_rank do_sample temperature top_p top_k num_beams max_new_tokens repetition_penalty length_penalty
    skip_special_tokens default_system enable_thinking mask_history streaming buffer_size mix_strategy
    interleave_probs tokenized_path ignore_pad_token_for_loss
    """.split()
)


def is_off(value: Any) -> bool:
    """A setting left at nothing: None, false, 0, an empty string or collection."""
    return value is None or value is False or value == 0 or (isinstance(value, str | list | dict) and not value)


def account_for_rest(src: Source, b: Builder, tool: str, label: str) -> None:
    """Every key no mapping read: not a key of ``tool`` (a finding: a typo?), a setting that does not change memory
    (listed in ``x-import.ignored``), off (the same), or one that may change memory and is not modelled (a finding,
    its value kept in ``x-import.not_modelled``)."""
    known = known_keys(tool)
    for key in src.left():
        value = src.plain[key]
        where = src.position(key)
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            b.finding(
                src.path,
                where,
                key,
                f"not a setting of {label}{guess}: not read; check the spelling and the tool's version",
                "unknown-key",
            )
            b.unknown_keys.setdefault(src.path, []).append(key)
        elif key in IGNORED or is_off(value):
            b.ignored.setdefault(src.path, []).append(key)
        else:
            b.finding(
                src.path,
                where,
                key,
                "may change training memory and is not modelled by ledgerspec yet: not carried over (its value "
                "is kept in x-import.not_modelled)",
                "not-modelled",
            )
            b.not_modelled.setdefault(src.path, {})[key] = value


def max_grad_norm(src: Source, b: Builder, o: str, unset: str = "max_grad_norm", tool_note: str = "") -> None:
    """``training.max_grad_norm`` from the file's ``max_grad_norm``, else transformers' ``TrainingArguments`` default
    1.0 as an ASSUMPTION (from ``o + unset``, its note after ``tool_note``): the tools pass none of their own."""
    path = ("training", "max_grad_norm")
    if src.has("max_grad_norm"):
        b.set(path, src.number("max_grad_norm"), o + "max_grad_norm", src.path)
    else:
        b.assume(path, 1.0, o + unset, tool_note + "transformers TrainingArguments default 1.0", src.path)


def launched_ranks(
    src: Source,
    b: Builder,
    multi: Any,
    o: str,
    single: str,
    launcher: str = "the launcher",
    launch: str = "the launcher",
) -> None:
    """``parallelism.gpu_count`` and ``workload.dp_world_size``. With multi-GPU settings in the file (``multi``: its
    DeepSpeed or FSDP settings) the launcher starts the ranks: UNKNOWN, ``--gpu-count`` gives them. Else one rank and
    no sharding, as ASSUMPTIONs from ``o + single`` (``launch``, what may still start several DDP ranks).
    ``launcher``: what starts them, in the tool's words."""
    if multi:
        b.unknown(
            ("parallelism", "gpu_count"), f"{o}the number of GPUs comes from {launcher}: give --gpu-count", src.path
        )
        b.unknown(("workload", "dp_world_size"), o + "data-parallel ranks = GPUs: give --gpu-count", src.path)
        return
    for path in (("parallelism", "gpu_count"), ("workload", "dp_world_size")):
        b.assume(
            path,
            1,
            o + single,
            f"no multi-GPU settings in the file; {launch} may still start several DDP ranks",
            src.path,
        )
    b.assume(("memory_options", "sharding"), "none", o + single, "no sharding settings", src.path)


def not_modelled(src: Source, b: Builder, key: str, value: Any, why: str, where: tuple[Any, Any] | None = None) -> None:
    """A set value the ledger cannot express: a finding with ``why``, the value kept in ``x-import.not_modelled``."""
    b.finding(src.path, where or src.position(key.split(".")[0]), key, why, "not-modelled")
    b.not_modelled.setdefault(src.path, {})[key] = value


#: what Liger turns on when a tool applies it with no per-kernel settings (``apply_liger_kernel_to_llama`` and the other
#: Llama-like models' functions, liger-kernel 0.8.5 ``transformers/monkey_patch.py``: rope, rms_norm, swiglu and the
#: fused linear cross-entropy on; the plain cross-entropy off)
LIGER_DEFAULTS = {
    "rope": "liger_rope",
    "norm": "liger_rms_norm",
    "mlp_activation": "liger_swiglu",
    "cross_entropy": "liger_fused_linear_cross_entropy",
}
#: Liger's per-kernel switches (``liger_kernel_config`` keys, ``apply_liger_kernel_to_*`` arguments) -> (op, kernel)
LIGER_SWITCHES = {
    "rope": ("rope", "liger_rope"),
    "rms_norm": ("norm", "liger_rms_norm"),
    "layer_norm": ("norm", "liger_layer_norm"),
    "swiglu": ("mlp_activation", "liger_swiglu"),
    "geglu": ("mlp_activation", "liger_geglu"),
    "cross_entropy": ("cross_entropy", "liger_cross_entropy"),
    "fused_linear_cross_entropy": ("cross_entropy", "liger_fused_linear_cross_entropy"),
}


def kernels(b: Builder, chosen: dict[str, str], origin: str, file: str) -> None:
    """``software.kernels.<op>`` for each op of ``chosen`` (op -> kernel id), all from one setting."""
    for op, name in chosen.items():
        b.set(("software", "kernels", op), name, origin, file)


def liger_kernels(config: Any) -> dict[str, str]:
    """The kernels Liger applies with the per-kernel ``config`` (None or {}: its defaults; a key set to false turns
    that kernel off, true turns it on, over the defaults)."""
    chosen = dict(LIGER_DEFAULTS)
    if isinstance(config, dict):
        for key, on in config.items():
            if key not in LIGER_SWITCHES:
                continue
            op, name = LIGER_SWITCHES[key]
            if on:
                chosen[op] = name
            elif chosen.get(op) == name:
                chosen[op] = "eager"
    return chosen


#: ``training.objective_settings`` keys read as TRL 1.16's config fields of the same name
OBJECTIVE_SETTINGS = (
    "max_completion_length",
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "disable_dropout",
    "center_rewards_coefficient",
)
OS = ("training", "objective_settings")


#: GRPOConfig's and RLOOConfig's settings (TRL 1.16.0, ``grpo_config.py``, ``rloo_config.py``) that the simulated step
#: runs at TRL's default (``engine/grpo.py``: sampling with transformers' ``generate`` or vLLM, one iteration per
#: generation batch, the clipped token-level loss, with vLLM the sequence-level importance-sampling correction on one
#: vLLM rank): a file that gives the default is read; another value is not modelled (a finding). ``loss_type`` and the
#: importance-sampling settings are GRPO's only.
ONLINE_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "generation_kwargs": None,
    "cache_implementation": None,
    "num_iterations": 1,
    "importance_sampling_level": "token",
    "mask_truncated_completions": False,
    "top_entropy_quantile": 1.0,
    "cast_lm_head_to_fp32": False,
    "use_transformers_paged": False,
    "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None,
    "sync_ref_model": False,
    "max_tool_calling_iterations": None,
    "off_policy_mask_threshold": None,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "vllm_tensor_parallel_size": 1,  # grpo_config.py:671-672: colocated vLLM on one card
    "vllm_importance_sampling_correction": True,  # grpo_config.py:925-926
    # ZeRO-3: every parameter gathered for generate (trl/models/utils.py 141-150); false: the hooks gather per module
    "ds3_gather_for_generation": True,
    "vllm_importance_sampling_mode": "sequence_mask",  # grpo_config.py:934-935
}
#: GRPOConfig's and RLOOConfig's settings that change no tensor of the step beyond a few floats per completion (the
#: advantages' clipping and scaling, the rewards' weights, logging, evaluation, vLLM's server, the bounds of the
#: importance-sampling correction)
ONLINE_IGNORED = frozenset(
    """
    num_generations_eval shuffle_dataset pad_to_multiple_of chat_template_kwargs epsilon
    delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg
    vespo_lambda_neg reward_weights multi_objective_aggregation scale_rewards ref_model_mixup_alpha
    ref_model_sync_steps entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target use_bias_correction_kl
    log_completions log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo
    vllm_model_impl vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
    vllm_server_port vllm_server_timeout vllm_group_port vllm_max_model_length vllm_importance_sampling_clip_max
    vllm_importance_sampling_clip_min vllm_importance_sampling_cap router_aux_loss_coef trust_remote_code
    """.split()
)


def objective_settings(b: Builder, values: dict[str, Any], origin: str, file: str) -> None:
    """``training.objective_settings.*`` from a mapping of TRL's field names (None values skipped)."""
    for key in OBJECTIVE_SETTINGS:
        if values.get(key) is not None:
            b.set((*OS, key), values[key], origin + key, file)


def reference(b: Builder, objective: str, precomputed: Any, beta: Any, origin: str, file: str) -> None:
    """``training.objective_settings.reference`` for an objective: precomputed when asked, none for objectives without
    a reference (ORPO, CPO; GRPO/RLOO at ``beta: 0``, TRL's default), else TRL's default with PEFT and no
    ``ref_model``: the adapters disabled (an ASSUMPTION: the trainer may be given a reference model)."""
    if objective in ("sft", "reward", "ppo"):
        return
    if precomputed:
        b.set((*OS, "reference"), "precomputed", origin + "precompute_ref_log_probs", file)
    elif objective in ("orpo", "cpo") or (objective in ("grpo", "rloo") and not beta):
        b.set((*OS, "reference"), "none", origin + f"{objective}{'' if beta is None else f' beta {beta}'}", file)
    else:
        b.assume(
            (*OS, "reference"),
            "adapter_disabled",
            origin + "no reference model in the config",
            "TRL's default with a PEFT model and no ref_model: the same model with its adapters disabled",
            file,
        )


def dtype_name(value: Any) -> str | None:
    """``bf16``, ``torch.bfloat16``, ``bfloat16`` -> ``bfloat16``; None for anything else (``auto``)."""
    return dtypes.canonical(str(value)) if isinstance(value, str) else None


# -- optimizers ------------------------------------------------------------------------------------------------------

#: other spellings of catalogue optimizers (axolotl's and bitsandbytes' names for transformers' ``optim`` values)
OPTIMIZER_ALIASES = {
    "adamw_hf": "adamw_torch",  # removed from transformers; was an AdamW implementation with two fp32 moments
    "adam": "adam",
    "adamw_bnb_8bit": "adamw_bnb_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
}


def optimizer(src: Source, b: Builder, key: str, name: Any, origin: str) -> None:
    """``optimizer.name`` from a tool's optimizer setting: the catalogue's spelling, or the name as given with a
    finding when the catalogue (``ledgerspec/contract/optimizers.py``) does not know it."""
    text = str(name).strip()
    canon = OPTIMIZER_ALIASES.get(text.lower(), text.lower())
    b.set(("optimizer", "name"), canon, origin, src.path, src.position(key))
    if canon not in OPTIMIZERS:
        from ledgerspec.contract.optimizers import suggest

        near = suggest(canon)
        b.finding(
            src.path,
            src.position(key),
            key,
            f"optimizer {text!r} is not in ledgerspec's optimizer catalogue"
            + (f" (did you mean {near!r}?)" if near else "")
            + ": its state cannot be sized; give optimizer.bits (and state_format) by hand, or use a catalogue "
            "optimizer",
            "not-modelled",
        )


# -- DeepSpeed and FSDP ----------------------------------------------------------------------------------------------

#: ZeRO stage -> (memory_options.sharding, parameter, gradient, optimizer placement)
ZERO = {
    0: ("none", "replicated", "replicated", "replicated"),
    1: ("zero1", "replicated", "replicated", "sharded"),
    2: ("zero2", "replicated", "sharded", "sharded"),
    3: ("zero3", "sharded", "sharded", "sharded"),
}
#: DeepSpeed keys the ledger reads (everything else in the JSON is kept in x-import.not_modelled)
_DS_READ = {"zero_optimization"}
_DS_ZERO_READ = {"stage", "offload_optimizer", "offload_param"}
#: DeepSpeed keys that only restate the Trainer's settings ("auto") or do not change memory
_DS_ECHO = {
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
}


def deepspeed(
    src: Source, b: Builder, config: dict[str, Any], origin: str, where: tuple[Any, Any], key: str = "deepspeed"
) -> None:
    """A DeepSpeed config (``zero_optimization``) as sharding and placements; the rest kept, with a finding."""
    block = config.get("zero_optimization")
    zero: dict[str, Any] = block if isinstance(block, dict) else {}
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or stage not in ZERO:
        b.finding(src.path, where, "zero_optimization.stage", f"ZeRO stage {stage!r} is not 0-3: not read", "unknown")
        return
    sharding, params, grads, opt = ZERO[stage]
    o = f"{origin}: zero_optimization.stage {stage}"
    b.set(("memory_options", "sharding"), sharding, o, src.path, where)
    b.set(("parallelism", "strategy"), f"zero{stage}" if stage else "ddp", o, src.path, where)
    off_opt = _offload_device(zero.get("offload_optimizer"))
    off_par = _offload_device(zero.get("offload_param"))
    if off_opt:
        opt = off_opt
    if off_par:
        params = off_par
    b.set(
        ("parallelism", "parameter_placement"), params, o + (f", offload_param {off_par}" if off_par else ""), src.path
    )
    b.set(("parallelism", "gradient_placement"), grads, o, src.path)
    b.set(
        ("parallelism", "optimizer_placement"), opt, o + (f", offload_optimizer {off_opt}" if off_opt else ""), src.path
    )
    offload = bool(off_opt or off_par)
    b.set(("memory_options", "cpu_offload"), offload, f"{origin}: offload_optimizer/offload_param", src.path)
    b.set(("parallelism", "cpu_offload"), offload, f"{origin}: offload_optimizer/offload_param", src.path)
    read = _zero_options(src, b, zero, origin)
    force = config.get("zero_force_ds_cpu_optimizer")
    if isinstance(force, bool):  # top-level: which optimizer steps the host partitions under offload
        b.set(("parallelism", "deepspeed", "zero_force_ds_cpu_optimizer"), force, f"{origin}", src.path)
    rest = {
        k: v
        for k, v in config.items()
        if k not in _DS_READ and k not in _DS_ECHO and not (k == "zero_force_ds_cpu_optimizer" and isinstance(v, bool))
    }
    rest.update({f"zero_optimization.{k}": v for k, v in zero.items() if k not in _DS_ZERO_READ and k not in read})
    if rest:
        not_modelled(
            src,
            b,
            key,
            rest,
            f"{origin}: DeepSpeed settings other than the ZeRO stage, offload and the options of parallelism.deepspeed "
            f'({", ".join(sorted(rest))}; "auto" values are filled by transformers from the model) are not read: '
            "kept in x-import.not_modelled",
            where,
        )


def _zero_options(src: Source, b: Builder, zero: dict[str, Any], origin: str) -> set[str]:
    """The ZeRO options that set per-rank memory, as ``parallelism.deepspeed.*`` (issue 16); the keys read.

    DeepSpeed accepts the stage-3 options with or without their ``stage3_`` prefix (``DeepSpeedZeroConfig``'s field
    names and aliases, ``deepspeed/runtime/zero/config.py``). ``"auto"`` is left out (transformers fills it from the
    model's hidden size when the Trainer starts: ``reduce_bucket_size = hidden**2``, ``stage3_prefetch_bucket_size
    = 0.9 * hidden**2``, ``stage3_param_persistence_threshold = 10 * hidden``), so it stays a not-modelled finding.
    """
    from ledgerspec.contract.config import DEEPSPEED_KEYS

    read: set[str] = set()
    for key, switch in DEEPSPEED_KEYS.items():
        for spelling in dict.fromkeys((key, key.removeprefix("stage3_"))):
            if spelling not in zero:
                continue
            value = zero[spelling]
            if switch and isinstance(value, bool):
                ok: Any = value
            elif not switch and not isinstance(value, bool) and isinstance(value, int | float) and value >= 0:
                if value != int(value):
                    continue
                ok = int(value)
            else:
                continue
            b.set(("parallelism", "deepspeed", key), ok, f"{origin}: zero_optimization.{spelling}", src.path)
            read.add(spelling)
    return read


def _offload_device(block: Any) -> str | None:
    if not isinstance(block, dict):
        return None
    device = str(block.get("device", "none")).lower()
    return device if device in ("cpu", "nvme") else None


def read_json_beside(src: Source, b: Builder, key: str, ref: str) -> dict[str, Any] | None:
    """A JSON file named by a setting (``deepspeed: ds_z3.json``), relative to the source file; None (with a
    finding) when it cannot be read. Read with the same safe loader as every source."""
    import os

    from ledgerspec.contract.imports.source import read
    from ledgerspec.errors import LedgerspecError

    path = ref if os.path.isabs(ref) else os.path.join(os.path.dirname(src.path) or ".", ref)
    try:
        other = read(path, "deepspeed")
    except LedgerspecError as exc:
        b.finding(
            src.path,
            src.position(key),
            key,
            f"cannot read {ref} ({exc.message}): its ZeRO stage and offload stay UNKNOWN; import the DeepSpeed JSON "
            "itself as another file",
            "unknown",
        )
        return None
    return other.plain


def fsdp2(
    src: Source,
    b: Builder,
    origin: str,
    where: tuple[Any, Any],
    reshard: Any,
    offload: Any,
    reshard_default_note: str | None,
) -> None:
    """FSDP2 as the ledger knows it: parameters, gradients and optimizer state sharded per rank."""
    _sharded(src, b, origin, where, "fsdp2", offload)
    if reshard is not None:
        b.set(("parallelism", "reshard_after_forward"), bool(reshard), origin, src.path, where)
    elif reshard_default_note:
        b.assume(("parallelism", "reshard_after_forward"), True, origin, reshard_default_note, src.path)


#: FSDP1 sharding strategies (accelerate 1.15 ``FSDP_SHARDING_STRATEGY``, 1-based numbers as accelerate accepts them)
#: -> ``parallelism.reshard_after_forward`` (the two the ledger models)
FSDP1_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False}
_FSDP1_NUMBERED = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
#: FSDP1 settings -> (ledger key under ``parallelism``, how the value is read)
_FSDP1_OPTIONS = {
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "limit_all_gathers": "limit_all_gathers",
    "use_orig_params": "use_orig_params",
}


def _sharded(
    src: Source, b: Builder, origin: str, where: tuple[Any, Any], strategy: str, offload: Any, whole: bool = False
) -> None:
    """FSDP1 and FSDP2 alike: the strategy, and parameters, gradients and optimizer state sharded per rank (on the
    host with CPU offload; ``whole``: replicated on every rank, FSDP1's NO_SHARD)."""
    b.set(("memory_options", "sharding"), strategy, origin, src.path, where)
    b.set(("parallelism", "strategy"), strategy, origin, src.path, where)
    place = "cpu" if offload else "replicated" if whole else "sharded"
    how = " with CPU offload" if offload else ": NO_SHARD (every rank the whole model)" if whole else ""
    for k in ("parameter_placement", "gradient_placement", "optimizer_placement"):
        b.set(("parallelism", k), place, origin + how, src.path)
    b.set(("memory_options", "cpu_offload"), bool(offload), origin, src.path)
    b.set(("parallelism", "cpu_offload"), bool(offload), origin, src.path)


def fsdp1_strategy(value: Any) -> str | None:
    """An FSDP1 ``sharding_strategy`` / ``reshard_after_forward`` as accelerate reads it (a name in any case, or its
    1-based number); None when it is not one."""
    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(_FSDP1_NUMBERED):
        return _FSDP1_NUMBERED[int(text) - 1]
    text = text.removeprefix("SHARDINGSTRATEGY.").lstrip("_")
    return text if text in _FSDP1_NUMBERED else None


def fsdp1(
    src: Source,
    b: Builder,
    origin: str,
    where: tuple[Any, Any],
    cfg: dict[str, Any],
    strategy: Any,
    offload: Any,
    defaults_note: str,
    group: int | None = None,
) -> bool:
    """FSDP1 (``FullyShardedDataParallel``) as the ledger knows it: ``parallelism.strategy: fsdp1`` with
    ``reshard_after_forward`` from the sharding strategy (FULL_SHARD true, SHARD_GRAD_OP false) and the wrapping
    options (``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``, ``use_orig_params``) read from
    ``cfg`` (keys without their ``fsdp_`` prefix). ``strategy`` None: FULL_SHARD, accelerate's and transformers'
    default (ASSUMPTION with ``defaults_note``). HYBRID_SHARD (``_ZERO2``) shards within groups of ``group`` ranks
    (the GPUs of one node: ``parallelism.shard_group_size``; UNKNOWN when the file cannot tell). NO_SHARD replicates:
    the placements ``replicated`` (no ``reshard_after_forward``); with CPU offload it is a finding, not modelled:
    False."""
    name = fsdp1_strategy(strategy) if strategy is not None else "FULL_SHARD"
    if name == "NO_SHARD" and not offload:  # every rank the whole model, FSDP1's flat parameters all the same
        _sharded(src, b, origin, where, "fsdp1", offload, whole=True)
        _fsdp1_options(src, b, origin, where, cfg)
        return True
    if name is None or name not in FSDP1_STRATEGIES:
        not_modelled(
            src,
            b,
            "fsdp_config",
            strategy,
            f"{origin}: FSDP1 sharding strategy {strategy!r} is not modelled (ledgerspec models FULL_SHARD, "
            "SHARD_GRAD_OP, HYBRID_SHARD and NO_SHARD without CPU offload)",
            where,
        )
        b.unknown(("memory_options", "sharding"), f"{origin}: FSDP1 {strategy} (not modelled)", src.path)
        return False
    _sharded(src, b, origin, where, "fsdp1", offload)
    if name.startswith("HYBRID"):
        if group:
            b.set(("parallelism", "shard_group_size"), group, f"{origin}: {name} within a node", src.path, where)
        else:
            b.unknown(
                ("parallelism", "shard_group_size"),
                f"{origin}: {name} shards within a node: give the GPUs per node",
                src.path,
            )
    if strategy is None:
        b.assume(("parallelism", "reshard_after_forward"), True, origin, defaults_note + ": FULL_SHARD", src.path)
    else:
        b.set(("parallelism", "reshard_after_forward"), FSDP1_STRATEGIES[name], f"{origin}: {name}", src.path, where)
    _fsdp1_options(src, b, origin, where, cfg)
    return True


def _fsdp1_options(src: Source, b: Builder, origin: str, where: tuple[Any, Any], cfg: dict[str, Any]) -> None:
    """FSDP1's wrapping options (``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``,
    ``use_orig_params``) read from ``cfg`` (keys without their ``fsdp_`` prefix)."""
    for key, field in _FSDP1_OPTIONS.items():
        if key not in cfg or cfg[key] is None:
            continue
        value = cfg[key]
        if key == "backward_prefetch":
            text = str(value).strip().upper().removeprefix("BACKWARDPREFETCH.")
            numbered = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
            if text.isdigit() and 1 <= int(text) <= 3:
                text = numbered[int(text) - 1]
            if text not in numbered:
                b.finding(src.path, where, f"fsdp_config.{key}", f"{value!r} is not one of {numbered}", "unknown")
                continue
            b.set(("parallelism", field), text.lower(), f"{origin}: {key}", src.path)
        else:
            on = _bool(value)
            if on is None:
                b.finding(src.path, where, f"fsdp_config.{key}", f"{value!r} is not true or false", "unknown")
                continue
            b.set(("parallelism", field), on, f"{origin}: {key}", src.path)


def fsdp_mixed_precision(src: Source, b: Builder, origin: str) -> None:
    """accelerate's FSDP mixed precision: with ``mixed_precision`` bf16/fp16 the FSDP plugin gets
    ``MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, ...)`` (accelerate 1.15 ``AcceleratorState`` ->
    ``FullyShardedDataParallelPlugin.set_mixed_precision``, FSDP1 and FSDP2 alike; FSDP1 also gets
    ``buffer_dtype=dtype`` unless ``buffer_autocast``, off by default), so the gathered parameters, compute and
    reduction run in that dtype. Needs ``training.mixed_precision`` set before."""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(str(b.value(("training", "mixed_precision")) or ""))
    if dtype is None:
        return
    keys = ["param_dtype", "reduce_dtype"]
    if b.value(("parallelism", "strategy")) == "fsdp1":  # FSDP1: buffer_dtype too (buffer_autocast off, the default)
        keys.append("buffer_dtype")
    for key in keys:
        b.set(
            ("parallelism", "mixed_precision_policy", key),
            dtype,
            origin + " (accelerate's FSDP MixedPrecision)",
            src.path,
        )


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return (
        True
        if text in ("true", "1", "yes", "y", "on", "t")
        else False
        if text in ("false", "0", "no", "n", "off", "f")
        else None
    )


def nested_where(src: Source, *path: str) -> tuple[int | None, int | None]:
    return position_in(src.data, *path)
