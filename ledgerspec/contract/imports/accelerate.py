"""An accelerate config (``accelerate config`` / ``accelerate launch --config_file``) -> intake: the number of
processes, the mixed precision and the FSDP or DeepSpeed plugin. Checked against accelerate 1.15.0
(``commands/config/config_args.py`` ``ClusterConfig``; ``utils/dataclasses.py`` ``FullyShardedDataParallelPlugin``,
whose ``__post_init__`` gives the defaults when a key is absent; ``utils/launch.py`` turns the config into the
``FSDP_*`` / ``ACCELERATE_DEEPSPEED_*`` environment the plugins read).

- ``num_processes`` is the total number of processes over all machines: the GPUs (ranks) and the data-parallel
  world size.
- ``fsdp_config.fsdp_version`` absent is 1 (``FSDP_VERSION`` default "1"): FSDP1, ``FULL_SHARD`` without
  ``fsdp_sharding_strategy``, no backward prefetch without ``fsdp_backward_prefetch``, ``use_orig_params`` true
  without ``fsdp_use_orig_params`` (``accelerate launch``'s argument defaults, ``commands/launch.py``, which it
  passes on as ``FSDP_*`` variables).
- ``mixed_precision`` bf16/fp16 under FSDP gives the plugin ``MixedPrecision(param_dtype, reduce_dtype)`` of that
  dtype (``FullyShardedDataParallelPlugin.set_mixed_precision``).
- ``deepspeed_config``: ``zero_stage`` and ``offload_{optimizer,param}_device``, or a ``deepspeed_config_file``
  (read beside the file, like a DeepSpeed JSON).

Pure Python; the contract wing.
"""

from __future__ import annotations

from typing import Any

from ledgerspec.contract.imports import common as C
from ledgerspec.contract.imports.builder import Builder
from ledgerspec.contract.imports.source import Source, as_int

LABEL = f"accelerate {C.VERSIONS['accelerate']} config"
#: ``distributed_type`` values that start several data-parallel processes without sharding
_DATA_PARALLEL = {"MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU"}
#: launcher settings that do not change training memory
_LAUNCH = (
    "compute_environment",
    "debug",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "rdzv_backend",
    "same_network",
    "gpu_ids",
    "enable_cpu_affinity",
    "command_file",
    "commands",
    "tpu_env",
    "tpu_name",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_vm",
    "tpu_zone",
    "downcast_bf16",
)


def convert(src: Source, b: Builder) -> None:
    b.tools.append(f"{LABEL} ({src.path})")
    o = "accelerate config: "
    for key in _LAUNCH:
        if src.has(key):
            src.take(key)
            b.ignored.setdefault(src.path, []).append(key)
    kind = str(src.take("distributed_type", "NO")).upper()
    processes = as_int(src, "num_processes", src.take("num_processes", 1))
    machines = as_int(src, "num_machines", src.take("num_machines", 1)) or 1
    if src.take("use_cpu") is True:
        b.finding(
            src.path,
            src.position("use_cpu"),
            "use_cpu",
            "use_cpu: true trains on the CPU: no GPU memory",
            "not-modelled",
        )
    mp = str(src.take("mixed_precision", "no")).lower()
    if mp in ("bf16", "fp16", "no"):
        b.set(("training", "mixed_precision"), mp, o + "mixed_precision", src.path, src.position("mixed_precision"))
    else:  # fp8 and anything else
        C.not_modelled(src, b, "mixed_precision", mp, f"mixed_precision {mp!r} is not modelled (bf16, fp16, no are)")
    where = src.position("distributed_type")
    if kind == "FSDP":
        _fsdp(src, b, o, where, max(1, processes // machines))
    elif kind == "DEEPSPEED":
        _deepspeed(src, b, o, where)
    elif kind in _DATA_PARALLEL or kind == "NO":
        sharding = "none"
        b.set(("memory_options", "sharding"), sharding, o + f"distributed_type {kind}", src.path, where)
        b.set(("parallelism", "strategy"), "ddp" if kind != "NO" else "none", o + f"distributed_type {kind}", src.path)
    else:
        C.not_modelled(src, b, "distributed_type", kind, f"distributed_type {kind} is not modelled", where)
    ranks = 1 if kind == "NO" else processes
    b.set(("parallelism", "gpu_count"), ranks, o + "num_processes", src.path, src.position("num_processes"))
    b.set(("workload", "dp_world_size"), ranks, o + "num_processes", src.path, src.position("num_processes"))
    C.account_for_rest(src, b, "accelerate", LABEL)


def _fsdp(src: Source, b: Builder, o: str, where: tuple[Any, Any], per_node: int) -> None:
    raw = src.take("fsdp_config") or {}
    cfg = {str(k).removeprefix("fsdp_"): v for k, v in raw.items()} if isinstance(raw, dict) else {}
    version = int(cfg.get("version") or 1)
    offload = C._bool(cfg.get("offload_params", False))
    if version == 2:
        C.fsdp2(
            src,
            b,
            o + "fsdp_version 2",
            where,
            C._bool(cfg["reshard_after_forward"]) if "reshard_after_forward" in cfg else None,
            offload,
            "accelerate's FSDP2 default reshard_after_forward: true",
        )
    elif not C.fsdp1(
        src,
        b,
        o + f"FSDP version {version}",
        where,
        cfg,
        cfg.get("sharding_strategy", cfg.get("reshard_after_forward")),
        offload,
        "accelerate's FSDP1 default sharding strategy",
        group=per_node,  # HYBRID_SHARD's shard group: one node's processes (FSDP1's intra-node group)
    ):
        return
    else:
        # `accelerate launch` passes every FSDP setting to the plugin through FSDP_* variables, with its own
        # argument defaults for the absent ones (commands/launch.py: --fsdp_use_orig_params "true",
        # --fsdp_backward_prefetch none)
        for key, default in (("backward_prefetch", "no_prefetch"), ("use_orig_params", True)):
            if key not in cfg:
                b.assume(
                    ("parallelism", key), default, o + "fsdp_config", f"accelerate launch's default {key}", src.path
                )
        _sync_module_states(src, b, o, cfg)
    if C._bool(cfg.get("activation_checkpointing", False)):
        # accelerate applies the checkpoint inside each unit (apply_activation_checkpointing after the wrapping)
        for path in (("memory_options", "gradient_checkpointing"), ("parallelism", "activation_checkpointing")):
            b.set(path, True, o + "fsdp_activation_checkpointing", src.path)
    read = {
        "version",
        "offload_params",
        "reshard_after_forward",
        "sharding_strategy",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "activation_checkpointing",
        "sync_module_states",
        "cpu_ram_efficient_loading",
    }
    # settings that decide what is wrapped or how checkpoints are saved, not what a rank holds in a step
    echo = {
        "auto_wrap_policy",
        "transformer_layer_cls_to_wrap",
        "min_num_params",
        "state_dict_type",
    }
    rest = {f"fsdp_{k}": v for k, v in cfg.items() if k not in read | echo}
    if rest:
        C.not_modelled(src, b, "fsdp_config", rest, f"FSDP settings {sorted(rest)} are not modelled yet", where)
    C.fsdp_mixed_precision(src, b, o + "mixed_precision under FSDP")


def _sync_module_states(src: Source, b: Builder, o: str, cfg: dict[str, Any]) -> None:
    """FSDP1's ``sync_module_states`` as the training processes get it: ``accelerate launch`` passes
    ``--fsdp_sync_module_states`` and ``--fsdp_cpu_ram_efficient_loading``, both "true" when the file does not set them
    (accelerate 1.16 ``commands/launch.py`` 589-600, 1.0.1 the same), and ``FullyShardedDataParallelPlugin`` turns the
    first on when the second is (``utils/dataclasses.py`` 1858-1863)."""
    keys = ("sync_module_states", "cpu_ram_efficient_loading")
    path = ("parallelism", "sync_module_states")
    on = [k for k in keys if k in cfg and C._bool(cfg[k])]
    if on:  # either set true in the file turns it on
        b.set(path, True, o + f"fsdp_{on[0]}", src.path, src.position("fsdp_config"))
    elif all(k in cfg for k in keys):
        b.set(path, False, o + "fsdp_sync_module_states", src.path, src.position("fsdp_config"))
    else:  # an absent one is true
        b.assume(path, True, o + "fsdp_config", "accelerate launch's default sync_module_states: true", src.path)


def _deepspeed(src: Source, b: Builder, o: str, where: tuple[Any, Any]) -> None:
    raw = src.take("deepspeed_config") or {}
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else {}
    file = cfg.get("deepspeed_config_file")
    if file and str(file).lower() != "none":
        config = C.read_json_beside(src, b, "deepspeed_config", str(file))
        if config is not None:
            C.deepspeed(src, b, config, o + f"deepspeed_config_file {file}", where)
        return
    zero: dict[str, Any] = {"stage": as_int(src, "deepspeed_config.zero_stage", cfg.get("zero_stage", 0))}
    for key, name in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        if cfg.get(key):
            zero[name] = {"device": str(cfg[key])}
    C.deepspeed(src, b, {"zero_optimization": zero}, o + "deepspeed_config", where)
    # what the plugin reads besides the stage and offload (accelerate 1.15 ``DeepSpeedPlugin``): the Trainer's
    # own settings restated, or how the model is built and saved
    echo = {
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_config_file",
    }
    rest = {f"deepspeed_config.{k}": v for k, v in cfg.items() if k not in echo}
    if rest:
        C.not_modelled(
            src, b, "deepspeed_config", rest, f"DeepSpeed plugin settings {sorted(rest)} are not modelled", where
        )
