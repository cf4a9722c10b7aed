"""What a document declares about parallelism, read once for every strategy: the rank count and the shard group,
FSDP's mixed-precision policy, CPU offload and FSDP1's wrapping options, DeepSpeed ZeRO's stage and options, and the
refusals they imply before anything is built (QLoRA storage, FSDP1 mixed precision over adapters in another dtype).

Every strategy's room (:mod:`.fsdp`, :mod:`.zero`, :mod:`.offload`), :func:`ledgerspec.derivations.shard.shard` and
``measure --nproc`` read the document through these functions; a bad value is a one-line usage error at its line.
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledgerspec.contract import config, dtypes
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.contract.fsdp1_precision import declares_fsdp1, lora_input_dtype_conflict
from ledgerspec.contract.values import Value
from ledgerspec.derivations.shard import state as S
from ledgerspec.errors import EXIT_FINDINGS, EXIT_USAGE, LedgerspecError

_err = ErrorAt("shard")


def world_size(doc: Document, nproc: int | None) -> int:
    if nproc is not None:
        if nproc < 1:
            raise LedgerspecError(f"--nproc must be >= 1, got {nproc}", doc.path, rule="shard", exit_code=EXIT_USAGE)
        return nproc
    gpus = doc.get("parallelism", "gpu_count").integer()
    if gpus is None or gpus < 1:
        raise _err(
            doc,
            ("parallelism",) if doc.get("parallelism").present else ("ledgerspec",),
            "no rank count: parallelism.gpu_count is missing or UNKNOWN",
            "pass --nproc N",
            exit_code=EXIT_USAGE,
        )
    return gpus


def shard_group(doc: Document, world: int) -> int:
    """The ranks one parameter is sharded over: ``parallelism.shard_group_size`` under hybrid sharding (FSDP1
    ``HYBRID_SHARD``, FSDP2 ``fully_shard`` on a 2-D (replicate, shard) device mesh; each rank then holds what it
    holds on that many ranks: its group's shard, replicated across the groups), else ``world``. A size that does
    not divide ``world`` is a usage error at its line."""
    path = ("parallelism", "shard_group_size")
    value = doc.get(*path)
    if no_shard(doc, world):
        return 1
    if not value.present or value.unknown:
        return world
    size = value.integer()
    if size is None or size < 1 or world % size:
        raise _err(
            doc,
            path,
            f"shard_group_size {value.value!r} must be a whole number that divides the {world} ranks",
            "the GPUs of one node, e.g. 8 of 16",
            exit_code=EXIT_USAGE,
        )
    if size < world and zero_stage(doc) is not None:
        raise _err(
            doc,
            path,
            "hybrid sharding is modelled for FSDP (FSDP1 HYBRID_SHARD, FSDP2 on a (replicate, shard) mesh), not for "
            "DeepSpeed's hierarchical partitioning (hpZ, MiCS)",
            "set parallelism.strategy: fsdp1 or fsdp2, or drop shard_group_size",
            exit_code=EXIT_USAGE,
        )
    return size


#: the placements FSDP1's NO_SHARD replicates (and FULL_SHARD / SHARD_GRAD_OP shard)
PLACEMENTS = ("parameter_placement", "gradient_placement", "optimizer_placement")


def no_shard(doc: Document, world: int | None = None) -> bool:
    """FSDP1's ``NO_SHARD`` (``ShardingStrategy.NO_SHARD``, accelerate's ``fsdp_sharding_strategy: NO_SHARD``,
    Answer.AI's ``--sharding_strategy ddp``): ``parallelism.strategy: fsdp1`` with ``parameter_placement:
    replicated``. Every rank holds every flat parameter whole, its gradient and its optimizer state, as one GPU does;
    FSDP1 all-reduces each unit's flat gradient after its backward (``_reduce_grad_no_shard``) where the sharded
    strategies reduce-scatter it. So a NO_SHARD rank is simulated as FSDP1 on a group of one rank
    (:func:`shard_group` is 1), which FSDP1 itself runs as NO_SHARD. Gradients or optimizer state declared sharded
    beside replicated parameters, a shard group, or CPU offload are a usage error at their line (``world``: the ranks,
    for the shard group's check)."""
    if not is_fsdp1(doc):
        return False

    def placement(key: str) -> str | None:
        text = doc.get("parallelism", key).text()
        return text.strip().lower() if text is not None else None

    if placement("parameter_placement") != "replicated":
        for key in PLACEMENTS[1:]:  # FSDP1 shards gradients and optimizer state only with the parameters
            if placement(key) == "replicated":
                raise _err(
                    doc,
                    ("parallelism", key),
                    f"parallelism.{key} 'replicated' beside parameters that are not: FSDP1 replicates all three "
                    "(NO_SHARD) or shards all three (FULL_SHARD, SHARD_GRAD_OP)",
                    "declare all three replicated (NO_SHARD) or all three sharded",
                    exit_code=EXIT_USAGE,
                )
        return False
    for key in PLACEMENTS[1:]:
        text = placement(key) or "replicated"
        if text != "replicated":
            raise _err(
                doc,
                ("parallelism", key),
                f"parallelism.{key} {text!r} beside parameter_placement: replicated: FSDP1's NO_SHARD replicates the "
                "parameters, their gradients and the optimizer state alike",
                "declare all three replicated (NO_SHARD) or all three sharded (FULL_SHARD, SHARD_GRAD_OP)",
                exit_code=EXIT_USAGE,
            )
    group = doc.get("parallelism", "shard_group_size").integer()
    if group is not None and world is not None and group != 1:
        raise _err(
            doc,
            ("parallelism", "shard_group_size"),
            f"shard_group_size {group} beside parameter_placement: replicated: FSDP1's NO_SHARD shards nothing",
            "drop shard_group_size, or declare the placements sharded for HYBRID_SHARD",
            exit_code=EXIT_USAGE,
        )
    offload = cpu_offload(doc)
    if offload is not None:
        raise _err(
            doc,
            offload,
            "CPU offload under FSDP1's NO_SHARD is not modelled",
            "declare cpu_offload: false, or shard the model (parameter_placement: sharded)",
            exit_code=EXIT_USAGE,
        )
    return True


def check_qlora(doc: Document, rule: str = "shard", code: int = EXIT_FINDINGS) -> None:
    """QLoRA is shardable only with ``bnb_4bit_quant_storage`` equal to the loaded float dtype (``shard`` and
    ``measure --nproc`` both refuse other layouts here, each under its own rule name and exit code)."""
    cfg = config.read(doc)
    if not cfg.quantized:
        return
    q = config.QUANT
    if cfg.quantization.type == "int8":
        name = "FSDP1" if is_fsdp1(doc) else "FSDP2"
        raise _err(
            doc, (*q, "type"), f"{name} per rank covers 4-bit (nf4/fp4) QLoRA, not int8", exit_code=code, rule=rule
        )
    if cfg.quantization.scheme == "gptq" and is_fsdp1(doc) and cfg.quantization.kernel == "triton_v2":
        return  # fms-acceleration's FSDP1 GPTQ-LoRA: qweight/qzeros sharded as float parameters (engine.gptq)
    if cfg.quantization.scheme not in ("bnb4", None):
        raise _err(
            doc,
            (*q, "type"),
            f"the sharded step covers bitsandbytes 4-bit (nf4/fp4) QLoRA and fms-acceleration's FSDP1 GPTQ-LoRA "
            f"(triton_v2 kernel), not a {cfg.quantization.type} base here (QuantLinear buffers under FSDP2, ZeRO or "
            "another kernel are not modelled)",
            "estimate it on one GPU (`ledgerspec estimate`), or measure the sharded run",
            exit_code=code,
            rule=rule,
        )
    storage = doc.get(*q, "storage_dtype")
    why = S.qlora_shardable(cfg.quantization.storage_dtype, cfg.loaded_dtype)
    if why:
        path = (*q, "storage_dtype") if storage.present else (q if doc.get(*q).present else ("base_model",))
        raise _err(
            doc,
            path,
            why,
            "set base_model.quantization.storage_dtype to the loaded dtype "
            "(BitsAndBytesConfig(bnb_4bit_quant_storage=...)), as FSDP-QLoRA recipes do",
            exit_code=code,
            rule=rule,
        )


#: how an unset ``reshard_after_forward`` is reported (as ``measure --nproc`` records it)
FSDP2_DEFAULT = "fsdp2 default"

MIXED_PRECISION = ("parallelism", "mixed_precision_policy")


@dataclass(frozen=True)
class MixedPrecision:
    """``parallelism.mixed_precision_policy``: FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.

    torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_api.py``: ``param_dtype`` is the dtype of the unsharded
    parameter (all-gather, forward and backward compute, the unsharded gradient); ``reduce_dtype`` the dtype of the
    reduce-scatter (None: the gradient's, i.e. ``param_dtype``); ``FSDPParam.init_dtype_attrs`` drops either when
    it equals what the parameter already has, and never casts non-floating parameters. accelerate 1.15
    (``FullyShardedDataParallelPlugin.set_mixed_precision``) sets ``param_dtype = reduce_dtype = output_dtype`` to
    the ``mixed_precision`` dtype and (``fsdp_utils.fsdp2_prepare_model``) upcasts the trainable parameters to
    float32 before ``fully_shard``; declare ``adapter.dtype: float32`` for that.
    """

    param_dtype: str | None
    reduce_dtype: str | None
    #: FSDP1's ``MixedPrecision.buffer_dtype`` (``_runtime_utils._root_pre_forward`` casts the floating buffers to
    #: it at the first forward, ``_cast_buffers_to_dtype_and_device``); FSDP2's policy has no such field
    buffer_dtype: str | None = None

    def describe(self) -> str:
        buffers = f", buffer_dtype={self.buffer_dtype}" if self.buffer_dtype else ""
        return f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}{buffers})"


def mixed_precision(doc: Document) -> MixedPrecision | None:
    """The declared policy, None when absent (FSDP2's default); a dtype that is not floating is an error."""
    if not doc.get(*MIXED_PRECISION).present:
        return None
    out: dict[str, str | None] = {}
    for key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = doc.get(*MIXED_PRECISION, key)
        text = value.text()
        if text is None:
            out[key] = None
            continue
        name = dtypes.canonical(text)
        if name is None or not name.startswith(("float", "bfloat")):
            raise _err(
                doc,
                (*MIXED_PRECISION, key),
                f"{key} must be a floating dtype (float32, bfloat16, float16), got {text!r}",
                exit_code=EXIT_USAGE,
            )
        out[key] = name
    if out["buffer_dtype"] is not None and not is_fsdp1(doc):
        raise _err(
            doc,
            (*MIXED_PRECISION, "buffer_dtype"),
            "buffer_dtype is FSDP1's (MixedPrecision); FSDP2's MixedPrecisionPolicy has none: its buffers keep "
            "their dtype",
            "drop buffer_dtype, or set parallelism.strategy: fsdp1",
            exit_code=EXIT_USAGE,
        )
    if all(v is None for v in out.values()):
        return None
    return MixedPrecision(out["param_dtype"], out["reduce_dtype"], out["buffer_dtype"])


def _known(doc: Document, path: tuple[str, ...], message: str, hint: str) -> Value:
    """The value at ``path``; declared ``UNKNOWN`` (or CONFIGURATION-SPECIFIC) it is a usage error at its line:
    ``message`` with ``{word}`` the word declared. The sharded step depends on the option, and reading it as the
    default would hide that."""
    value = doc.get(*path)
    if value.present and value.unknown:
        raise _err(doc, path, message.format(word=value.source or "UNKNOWN"), hint, exit_code=EXIT_USAGE)
    return value


def declared_switch(doc: Document, path: tuple[str, ...]) -> bool | None:
    """A sharding switch as declared (None: absent, or a plain null); ``UNKNOWN`` is a usage error (:func:`_known`)."""
    message = f"{path[-1]} is {{word}}: the sharded step depends on it"
    return _known(doc, path, message, "write true or false, or remove the key for the default").switch()


def reshard_after_forward_switch(doc: Document) -> bool | None:
    """``parallelism.reshard_after_forward`` as declared (None: absent, each strategy's default)."""
    return declared_switch(doc, ("parallelism", "reshard_after_forward"))


def cpu_offload(doc: Document) -> tuple[str, ...] | None:
    """Where the document turns CPU offload on (``parallelism.cpu_offload`` or ``memory_options.cpu_offload``);
    either declared ``UNKNOWN`` is a usage error at its line (:func:`declared_switch`)."""
    for path in (("parallelism", "cpu_offload"), ("memory_options", "cpu_offload")):
        if declared_switch(doc, path):
            return path
    return None


def separate_reference(doc: Document) -> bool:
    """DPO/KTO with a separate reference model (``objective_settings.reference: model``): a second copy of the base
    every rank holds (sharded as TRL shards it: :func:`ledgerspec.derivations.shard.state.with_reference`)."""
    t = config.read(doc).training
    return t.objective in ("dpo", "kto") and t.dpo_reference == "model"


def is_fsdp1(doc: Document) -> bool:
    """``parallelism.strategy: fsdp1`` (or, without a strategy, ``memory_options.sharding: fsdp1``): FSDP1 as the
    Trainer/accelerate run it (``fsdp_version: 1``)."""
    return declares_fsdp1(doc)


def check_fsdp1_mixed_precision(doc: Document, rule: str = "shard", code: int = EXIT_USAGE) -> None:
    """Refuse, before any step runs, FSDP1 ``MixedPrecision(param_dtype)`` without autocast over adapters in another
    dtype: every real run fails at the first LoRA forward, and the simulation cannot be trusted to (its meta ``mm``
    does not check dtypes); see :mod:`ledgerspec.contract.fsdp1_precision` for the source lines."""
    conflict = lora_input_dtype_conflict(doc)
    if conflict is not None:
        raise _err(doc, conflict.path, conflict.message, conflict.hint, exit_code=code, rule=rule)


#: ``parallelism.backward_prefetch`` words -> ``torch.distributed.fsdp.BackwardPrefetch`` member (None: no prefetch)
BACKWARD_PREFETCH = {"backward_pre": "BACKWARD_PRE", "backward_post": "BACKWARD_POST", "no_prefetch": None}


@dataclass(frozen=True)
class Fsdp1Options:
    """FSDP1's wrapping options as accelerate passes them to ``FullyShardedDataParallel`` (accelerate 1.15
    ``Accelerator.prepare_model``), with the defaults of transformers' ``TrainingArguments`` (5.x
    ``_fsdp_plugin_args``: ``backward_prefetch`` 'NO_PREFETCH', ``forward_prefetch`` false, ``use_orig_params``
    true) and accelerate's ``limit_all_gathers`` true."""

    backward_prefetch: str | None = None  # a BackwardPrefetch member name
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    #: ``sync_module_states``: each unit broadcast from rank 0 as it is wrapped (:mod:`.fsdp.sync`); absent false,
    #: accelerate's ``FullyShardedDataParallelPlugin`` default (``FSDP_SYNC_MODULE_STATES`` unset, 1.0.1 and 1.16
    #: ``utils/dataclasses.py``), although ``accelerate launch`` and transformers' ``TrainingArguments`` pass true
    #: unless told otherwise and ``cpu_ram_efficient_loading`` forces it on
    sync_module_states: bool = False
    #: ``activation_checkpointing``: the checkpoint applied inside each unit by torch's
    #: ``apply_activation_checkpointing`` (accelerate's ``fsdp_activation_checkpointing``), whatever transformers
    #: version is declared: never around the unit (:mod:`.fsdp.legacy_checkpoint`)
    activation_checkpointing: bool = False

    def describe(self) -> str:
        return (
            f"backward_prefetch={self.backward_prefetch or 'None'}, forward_prefetch={self.forward_prefetch}, "
            f"limit_all_gathers={self.limit_all_gathers}, use_orig_params={self.use_orig_params}"
        )


def fsdp1_options(doc: Document) -> Fsdp1Options:
    """The declared FSDP1 options (absent ones at the Trainer's defaults); a bad value is a usage error at its line."""
    path = ("parallelism", "backward_prefetch")
    declared = _known(
        doc,
        path,
        "backward_prefetch is {word}: FSDP1's step depends on it",
        f"write one of {', '.join(BACKWARD_PREFETCH)}, or remove the key for the Trainer's default",
    )
    text = declared.text()
    prefetch = None
    if text is not None:
        key = text.strip().lower().replace("-", "_")
        if key not in BACKWARD_PREFETCH:
            raise _err(
                doc,
                path,
                f"backward_prefetch {text!r} is not one of {', '.join(BACKWARD_PREFETCH)}",
                exit_code=EXIT_USAGE,
            )
        prefetch = BACKWARD_PREFETCH[key]

    def switch(name: str, default: bool) -> bool:
        hint = f"write true or false, or remove the key for FSDP1's default ({str(default).lower()})"
        message = f"{name} must be true or false"
        value = _known(doc, ("parallelism", name), message + " (it is {word}: FSDP1's step depends on it)", hint)
        if not value.present or value.value is None:
            return default
        on = value.switch()
        if on is None:
            raise _err(doc, ("parallelism", name), message, hint, exit_code=EXIT_USAGE)
        return on

    return Fsdp1Options(
        prefetch,
        switch("forward_prefetch", False),
        switch("limit_all_gathers", True),
        switch("use_orig_params", True),
        switch("sync_module_states", False),
        switch("activation_checkpointing", False),
    )


# -- DeepSpeed ZeRO --------------------------------------------------------------------------------------------------

#: ``parallelism.strategy`` / ``memory_options.sharding`` values run by DeepSpeed ZeRO
STRATEGIES = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class ZeroOptions:
    """The DeepSpeed ``zero_optimization`` options that set per-rank memory, as the ledger declares them.

    Defaults are DeepSpeed 0.19.8's own (``deepspeed/runtime/zero/config.py``, ``DeepSpeedZeroConfig``); ``None`` for
    ``overlap_comm`` is DeepSpeed's dynamic default (true for stage 3, false otherwise: ``overlap_comm_valid``).
    """

    stage: int
    prefetch_bucket_size: int = 50_000_000  # config.py:222 stage3_prefetch_bucket_size pp_int(5e7)
    max_live_parameters: int = 1_000_000_000  # config.py:245 stage3_max_live_parameters pp_int(1e9)
    max_reuse_distance: int = 1_000_000_000  # config.py:251 stage3_max_reuse_distance pp_int(1e9)
    param_persistence_threshold: int = 100_000  # config.py:228 stage3_param_persistence_threshold pp_int(1e5)
    reduce_bucket_size: int = 500_000_000  # config.py:113 pp_int(5e8)
    allgather_bucket_size: int = 500_000_000  # config.py:132 pp_int(5e8)
    overlap_comm: bool | None = None  # config.py:138, 384-386
    contiguous_gradients: bool = True  # config.py:102
    #: ``offload_optimizer: {device: cpu}``: the fp32 partitions, their gradients and the optimizer on the host
    offload_optimizer: bool = False
    #: ``offload_param: {device: cpu}`` (ZeRO-3 only): the parameter partitions on the host
    offload_param: bool = False
    #: the top-level ``zero_force_ds_cpu_optimizer`` (default true, ``runtime/constants.py``): with
    #: ``offload_optimizer`` DeepSpeed refuses a client optimizer other than ``DeepSpeedCPUAdam`` (``engine.py``
    #: 2342-2346), so the step runs the optimizer of the config's ``optimizer`` block, ``DeepSpeedCPUAdam``
    force_ds_cpu_optimizer: bool = True
    #: a placement declared ``nvme`` (DeepSpeed's NVMe offload, ZeRO-Infinity): refused, not modelled
    nvme: bool = False
    #: ``cpu_offload: false`` declared beside a ``cpu`` placement: refused (which one ran?)
    contradicted: bool = False

    def zero_optimization(self) -> dict[str, Any]:
        """The ``zero_optimization`` block of a DeepSpeed config."""
        block: dict[str, Any] = {
            "stage": self.stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "allgather_bucket_size": self.allgather_bucket_size,
            "contiguous_gradients": self.contiguous_gradients,
        }
        if self.overlap_comm is not None:
            block["overlap_comm"] = self.overlap_comm
        if self.offload_optimizer:
            block["offload_optimizer"] = {"device": "cpu"}
        if self.offload_param:
            block["offload_param"] = {"device": "cpu"}
        if self.stage == 3:
            block.update(
                stage3_prefetch_bucket_size=self.prefetch_bucket_size,
                stage3_max_live_parameters=self.max_live_parameters,
                stage3_max_reuse_distance=self.max_reuse_distance,
                stage3_param_persistence_threshold=self.param_persistence_threshold,
            )
        return block

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer or self.offload_param

    @property
    def cpu_adam(self) -> bool:
        """The step runs ``DeepSpeedCPUAdam`` built from the config's ``optimizer`` block (not the Trainer's)."""
        return self.offload_optimizer and self.force_ds_cpu_optimizer

    def describe(self) -> str:
        z = self.zero_optimization()
        for key in ("offload_optimizer", "offload_param"):
            if key in z:
                z[key] = "cpu"
        text = ", ".join(f"{k}={v}" for k, v in z.items())
        if self.cpu_adam:
            text += ", optimizer DeepSpeedCPUAdam"
        elif self.offload_optimizer:
            text += ", zero_force_ds_cpu_optimizer=False (the Trainer's optimizer on the host)"
        return text


#: ledger key under ``parallelism.deepspeed`` -> ZeroOptions attribute
OPTION_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "zero_force_ds_cpu_optimizer": "force_ds_cpu_optimizer",
}
#: ``optimizer.name`` values DeepSpeedCPUAdam stands for under ZeRO-Offload (the config's ``optimizer`` block type)
CPU_ADAM_TYPES = {"adamw_torch": "AdamW", "adamw_torch_fused": "AdamW", "adam": "Adam"}


def zero_stage(doc: Document) -> int | None:
    """1, 2 or 3 when the document runs DeepSpeed ZeRO (``parallelism.strategy``, else ``memory_options.sharding``)."""
    strategy = config.declared_strategy(doc)  # as every other reader of the strategy: ZeRO3 is zero3
    if strategy in STRATEGIES:
        return int(strategy[-1])
    return None


def zero_options(doc: Document) -> ZeroOptions:
    """The ZeRO options the document declares (``parallelism.deepspeed``), DeepSpeed's defaults for the rest."""
    stage = zero_stage(doc)
    if stage is None:
        raise ValueError("the document does not declare parallelism.strategy zero2 or zero3")
    options: dict[str, Any] = {OPTION_KEYS[key]: value for key, value in config.read(doc).deepspeed}
    optimizer, param = zero_offload(doc, stage)
    nvme = any(placement(doc, k) == "nvme" for k in ("optimizer_placement", "parameter_placement"))
    off = [doc.get(*where, "cpu_offload").switch() for where in (("parallelism",), ("memory_options",))]
    contradicted = (optimizer or param) and False in off
    return ZeroOptions(
        stage, offload_optimizer=optimizer, offload_param=param, nvme=nvme, contradicted=contradicted, **options
    )


def placement(doc: Document, key: str) -> str:
    """``parallelism.<key>`` as written, lower case (``""`` when absent)."""
    return (doc.get("parallelism", key).text() or "").strip().lower()


def zero_offload(doc: Document, stage: int) -> tuple[bool, bool]:
    """(``offload_optimizer``, ``offload_param``) as the document declares them: ``optimizer_placement: cpu`` and
    ``parameter_placement: cpu`` (what the DeepSpeed import writes for ``offload_optimizer`` / ``offload_param``);
    with neither, ``cpu_offload: true`` means both for ZeRO-3 and the optimizer's for ZeRO-2, as the calculated
    ``zeroN_offload`` rows count it."""
    optimizer = placement(doc, "optimizer_placement") == "cpu"
    param = placement(doc, "parameter_placement") == "cpu"
    if not (optimizer or param):
        on = any(doc.get(*where, "cpu_offload").switch() for where in (("parallelism",), ("memory_options",)))
        optimizer, param = on, on and stage == 3
    return optimizer, param


__all__ = [
    "BACKWARD_PREFETCH",
    "CPU_ADAM_TYPES",
    "FSDP2_DEFAULT",
    "OPTION_KEYS",
    "STRATEGIES",
    "Fsdp1Options",
    "MixedPrecision",
    "ZeroOptions",
    "check_fsdp1_mixed_precision",
    "check_qlora",
    "cpu_offload",
    "fsdp1_options",
    "is_fsdp1",
    "mixed_precision",
    "placement",
    "shard_group",
    "world_size",
    "zero_offload",
    "zero_options",
    "zero_stage",
]
