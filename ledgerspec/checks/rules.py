"""The rule catalogue LS001-LS080 (spec: "Rule catalogue") plus LS005-LS009, LS012-LS017, LS023, LS032, LS043,
LS061, LS062, LS063 and LS090. One function per rule, named after it.

Each rule is a pure function of a :class:`~ledgerspec.checks.context.Context` that yields
:class:`~ledgerspec.checks.findings.Hit`; the validator adds positions and severities.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from ledgerspec.checks.context import Context, ptr
from ledgerspec.checks.findings import ERROR, INFO, WARNING, Hit
from ledgerspec.checks.ladder import RANK
from ledgerspec.checks.registry import rule
from ledgerspec.checks.stale import edited_since
from ledgerspec.contract import config as C
from ledgerspec.contract import dtypes
from ledgerspec.contract import fields as F
from ledgerspec.contract.files import CONFIG_PATH, ConfigFile
from ledgerspec.contract.fingerprint import STAMPS, stale
from ledgerspec.contract.fsdp1_precision import lora_input_dtype_conflict
from ledgerspec.contract.intake import dotted, quantization_fields
from ledgerspec.contract.optimizers import OPTIMIZERS, optimizer_spec, suggest
from ledgerspec.contract.units import decimal_note, decimal_unit, format_size
from ledgerspec.contract.values import Value


@rule(
    "LS001",
    ERROR,
    "declared status above the status the evidence supports",
    "lower `status` to the supported one (`ledgerspec validate --fix` does it) or add the missing evidence",
    example="status: VALIDATED   # with no measurement",
)
def ls001_status_above_supported(ctx: Context) -> Iterator[Hit]:
    declared = ctx.get("status").text()
    if declared in RANK and RANK[declared] > RANK[ctx.status.status]:
        why = "; ".join(ctx.status.reasons[:3])
        more = f" (+{len(ctx.status.reasons) - 3} more)" if len(ctx.status.reasons) > 3 else ""
        yield Hit(
            ptr("status"), f"declared status {declared} is above the supported status {ctx.status.status}: {why}{more}"
        )


@rule(
    "LS002",
    INFO,
    "field is UNKNOWN or CONFIGURATION-SPECIFIC",
    "find the value (run `ledgerspec resolve` for derivable figures) or leave it: it holds the status down",
    example="identity:\n  revision: UNKNOWN",
)
def ls002_unknown_field(ctx: Context) -> Iterator[Hit]:
    for path, _field, v in ctx.fields():
        if v.source in ("UNKNOWN", "CONFIGURATION-SPECIFIC"):
            yield Hit(ptr(*path), f"{dotted(path)} is {v.source}")


@rule(
    "LS003",
    "error / warning",
    "ASSUMPTION without a note (error); every ASSUMPTION is listed (warning)",
    "say in `note` why the value is assumed, or replace it with a VERIFIED/MEASURED value",
    example="adapter:\n  dtype: {value: bfloat16, source: ASSUMPTION}",
)
def ls003_assumption(ctx: Context) -> Iterator[Hit]:
    for path, _field, v in ctx.fields():
        if v.source != "ASSUMPTION":
            continue
        if not v.note:
            yield Hit(ptr(*path), f"{dotted(path)} is an ASSUMPTION without a note", ERROR)
        else:
            yield Hit(ptr(*path), f"{dotted(path)} is an ASSUMPTION: {v.note}", WARNING)


@rule(
    "LS004",
    WARNING,
    "memory figure without a source (treated as ASSUMPTION)",
    "write the long form {value: ..., source: CALCULATED|MEASURED|..., method: ...}",
    example="ledger:\n  adapter: 80MB",
)
def ls004_figure_without_source(ctx: Context) -> Iterator[Hit]:
    for path, field, v in ctx.fields():
        if not field.figure or v.form != "plain" or isinstance(v.raw, dict):
            continue  # a mapping here is a malformed long form: the schema check reports it
        if field.kind == F.FIGURES and len(path) == 2:
            continue  # the list itself (a schema error when not a list); its items are checked
        yield Hit(ptr(*path), f"{dotted(path)} = {v.raw!r} has no source; it counts as an ASSUMPTION")


@rule(
    "LS010",
    ERROR,
    "global_batch is not microbatch x gradient_accumulation x dp_world_size",
    "fix global_batch or the factors; accumulation is sequential and is not an activation batch",
    example="workload: {microbatch: 2, gradient_accumulation: 8, dp_world_size: 1, global_batch: 32}",
)
def ls010_global_batch(ctx: Context) -> Iterator[Hit]:
    vals = [
        ctx.get("workload", k).integer()
        for k in ("microbatch", "gradient_accumulation", "dp_world_size", "global_batch")
    ]
    mb, ga, dp, gb = vals
    if mb is not None and ga is not None and dp is not None and gb is not None and mb * ga * dp != gb:
        yield Hit(
            ptr("workload", "global_batch"),
            f"global_batch {gb} != microbatch {mb} x gradient_accumulation {ga} x dp_world_size {dp} = {mb * ga * dp}",
        )


@rule(
    "LS011",
    WARNING,
    "only max_length given: no sequence_p50/p95 and packing unknown",
    "add sequence_p50/sequence_p95 of the tokenized data and say whether packing is on",
    example="workload: {max_length: 2048, microbatch: 1}",
)
def ls011_max_length_only(ctx: Context) -> Iterator[Hit]:
    if (
        ctx.get("workload", "max_length").known
        and ctx.get("workload", "sequence_p50").unknown
        and ctx.get("workload", "sequence_p95").unknown
        and ctx.switch("workload", "packing") is None
    ):
        yield Hit(
            ptr("workload", "max_length"),
            "only max_length is known: max_length is not the workload (no sequence_p50/p95, packing unknown)",
        )


@rule(
    "LS012",
    "warning / info",
    "the declared stack differs from the one the figures were computed with, in a known memory-relevant way",
    "install the declared versions and re-run (resolve / estimate), declare the versions you run, or accept the "
    "difference: list its id in software.accepted_differences (docs: Declared stack)",
    example="software: {bitsandbytes: 0.42.0}\n"
    "x-estimate: {differences: {bitsandbytes-4bit-matmul-input: {computed_as: newer}}}",
)
def ls012_declared_stack_differs(ctx: Context) -> Iterator[Hit]:
    from ledgerspec.contract.differences import stack_differences

    for diff in stack_differences(ctx.doc, C.read(ctx.doc).accepted_differences):
        if diff.accepted:
            yield Hit(
                ptr("software", "accepted_differences"),
                f"accepted: {diff.message()}",
                severity=INFO,
            )
        else:
            yield Hit(ptr("software", diff.difference.package), diff.message(), severity=WARNING)


@rule(
    "LS013",
    WARNING,
    "a declared kernel replacement the estimate does not model, or one ledgerspec does not know",
    "the estimate runs transformers' own op there: measure the run (`ledgerspec measure`), or turn the kernel off "
    "for a run the estimate describes; a near-miss id gets a did-you-mean (docs: The kernels users switch on)",
    example="software:\n  kernels: {lora_projections: [axolotl_lora_mlp], other: [unsloth]}",
)
def ls013_kernel_not_modelled(ctx: Context) -> Iterator[Hit]:
    from ledgerspec.contract import kernels as K

    declared = C.read(ctx.doc).kernels
    for op, name in declared.declared():
        spec = K.kernel(name)
        where = ptr("software", "kernels", op)
        if spec is None:
            near = K.suggest(name, op)
            hint = f" (did you mean {near}?)" if near else f" (known: {', '.join(K.ids_for(op))}, eager)"
            yield Hit(
                where,
                f"kernel {name!r} is not one ledgerspec knows for {op}{hint}: the estimate runs the eager {op} instead",
            )
        elif spec.op != op:
            yield Hit(where, f"kernel {name!r} replaces {spec.op}, not {op}: declare it as software.kernels.{spec.op}")
        elif not spec.modelled:
            yield Hit(
                where,
                f"kernel {name!r} ({spec.package}: {spec.summary}) is not modelled: the estimate runs "
                f"the eager {op} instead",
            )
    for name in declared.other:
        ops = K.likely_ops(name)
        likely = f"it likely replaces {', '.join(ops)}" if ops else "the ops it replaces are not known"
        yield Hit(
            ptr("software", "kernels", "other"),
            f"kernel replacement {name!r} is not modelled ({likely}): the estimate runs transformers' own ops there",
        )


@rule(
    "LS014",
    WARNING,
    "training.objective is one whose step the estimate does not simulate",
    "PPO runs a value model and its own generation, GRPO/RLOO with vLLM on a quantized base merge the adapters into "
    "the quantized layers, and ORPO/CPO on a GPTQ/AWQ or 8-bit base a layout no truth has checked: record the real "
    "trainer's run (LedgerCallback) until the estimate models them (supervised fine-tuning, DPO and KTO with their "
    "reference from the policy, a separate model or precomputed, reward models, ORPO and CPO (on a bitsandbytes 4-bit "
    "base too), GRPO and RLOO with transformers' generate or vLLM are simulated, on TRL 1.16)",
    example="training: {objective: ppo}",
)
def ls014_objective_not_modelled(ctx: Context) -> Iterator[Hit]:
    cfg = C.read(ctx.doc)
    training = cfg.training
    what = training.not_simulated
    q = cfg.quantization
    if what is None and training.objective in ("orpo", "cpo") and q.quantized and not q.four_bit:
        what = (
            f"training.objective {training.objective} on a base quantized as {q.type or 'not declared'} (the step "
            f"simulates TRL's {training.objective.upper()}Trainer on bitsandbytes 4-bit and unquantized bases)"
        )
    if what is None and training.objective in C.GENERATING and training.use_vllm and q.quantized:
        what = (
            f"training.objective {training.objective} with use_vllm on a quantized base (TRL syncs the weights through "
            "PEFT's merge_adapter, which dequantizes, adds and quantizes every layer again: not modelled)"
        )
    if what is not None and ctx.get("training", "objective").known:
        yield Hit(
            ptr("training", "objective"),
            f"{what}: `estimate` and `measure` do not simulate this step; its memory is not what they would size",
        )


@rule(
    "LS015",
    WARNING,
    "a TRL trainer on a quantized base: the adapters' dtype, preparation or casts declared are not what TRL does",
    "TRL 1.16's DPOTrainer, KTOTrainer and RewardTrainer cast every trainable parameter of a quantized model to "
    "bfloat16 before training (dpo_trainer.py:717-725, kto_trainer.py:777-780, reward_trainer.py:549-554): declare "
    "adapter.dtype: bfloat16, as the importers do; ORPOTrainer and CPOTrainer call prepare_model_for_kbit_training, "
    "keep PEFT's float32 adapters and, handed a peft_config with bf16, cast norms to float32 and lm_head/embed_tokens "
    "to bfloat16 (orpo_trainer.py:220-265, cpo_trainer.py:210-255): declare prepare_for_kbit_training: true, "
    "adapter.dtype: float32 and the module_dtypes of whoever cast the model (TRL's, or the tool's that wrapped it)",
    example="base_model: {quantized: true}\nadapter: {dtype: float32}\ntraining: {objective: dpo}",
)
def ls015_dpo_qlora_adapter_dtype(ctx: Context) -> Iterator[Hit]:
    cfg = C.read(ctx.doc)
    if cfg.training.objective in ("orpo", "cpo") and cfg.quantization.four_bit and cfg.training.simulated:
        yield from _orpo_qlora_preparation(ctx, cfg)
        return
    trainer = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}.get(cfg.training.objective)
    if trainer is None or not cfg.quantization.quantized or not cfg.training.simulated:
        return
    dtype = ctx.get("adapter", "dtype")
    if dtype.known and str(dtype.value).strip().lower() not in ("bfloat16", "bf16"):
        yield Hit(
            ptr("adapter", "dtype"),
            f"adapter.dtype {dtype.value}: TRL's {trainer} trains the adapters of a quantized base in bfloat16, so "
            "the run holds bfloat16 adapters, gradients and optimizer state",
        )


def _orpo_qlora_preparation(ctx: Context, cfg: C.Config) -> Iterator[Hit]:
    """ORPO/CPO on a 4-bit base: TRL's preparation (orpo_trainer.py:220-232), PEFT's float32 adapters (:243-261) and,
    with bf16, ``peft_module_casting_to_bf16`` (:262-265), as the ledger must declare them for the step to be TRL's."""
    trainer = f"{cfg.training.objective.upper()}Trainer"
    if not cfg.prepare_kbit:
        yield Hit(
            ptr("base_model", "prepare_for_kbit_training"),
            f"TRL's {trainer} prepares a quantized base with prepare_model_for_kbit_training (its 16-bit parameters "
            "that are not 4-bit weights in float32): declare base_model.prepare_for_kbit_training: true",
        )
    dtype = ctx.get("adapter", "dtype")
    if dtype.known and dtypes.canonical(str(dtype.value)) != "float32":
        yield Hit(
            ptr("adapter", "dtype"),
            f"adapter.dtype {dtype.value}: TRL's {trainer} keeps PEFT's float32 adapters on a quantized base",
        )
    if cfg.training.mixed_precision == "bf16" and not ctx.get("base_model", "module_dtypes").known:
        casts = ", ".join(f"{k}: {v}" for k, v in C.TRL_BF16_CASTS.items())
        yield Hit(
            ptr("base_model", "module_dtypes"),
            f"no base_model.module_dtypes: with bf16 TRL's {trainer}, handed the base and a peft_config, casts norms "
            f"to float32 and lm_head/embed_tokens to bfloat16 after wrapping it (peft_module_casting_to_bf16) and runs "
            f"its loss in an autocast region of its own: declare {{{casts}}}, or the casts of the tool that wrapped "
            "the model (axolotl's rl: orpo hands TRL a PEFT model)",
        )


@rule(
    "LS016",
    WARNING,
    "the sequence lengths disagree: sequence_p50 above sequence_p95, or a percentile above max_length",
    "percentiles of the tokenized data are ordered (p50 <= p95); a p95 above max_length means more than 5% of the "
    "sequences are longer than the step's rows (cut to max_length, or split at it when packed; the estimate uses "
    "max_length): check max_length or the percentiles",
    example="workload: {max_length: 512, sequence_p50: 300, sequence_p95: 2048, microbatch: 1}",
)
def ls016_sequence_lengths(ctx: Context) -> Iterator[Hit]:
    p50, p95, longest = (ctx.get("workload", k).integer() for k in ("sequence_p50", "sequence_p95", "max_length"))
    if p50 is not None and p95 is not None and p50 > p95:
        yield Hit(ptr("workload", "sequence_p50"), f"sequence_p50 {p50} is above sequence_p95 {p95}")
    share, above = ("more than 5%", p95) if p95 is not None else ("half or more", p50)
    if above is not None and longest is not None and above > longest:
        cut = "split at" if ctx.switch("workload", "packing") else "cut to"
        which = "sequence_p95" if p95 is not None else "sequence_p50"
        yield Hit(
            ptr("workload", which),
            f"{which} {above} is above max_length {longest}: {share} of the sequences are {cut} {longest} tokens",
        )


@rule(
    "LS017",
    "error / warning",
    "parallelism.strategy names no strategy ledgerspec knows (error); memory_options.sharding says another (warning)",
    "write one of none, ddp, device_map, fsdp1 (or FullyShardedDataParallel), fsdp2, zero1, zero2, zero3: an unknown "
    "name was simulated as FSDP2 by shard and measure (memory_options.sharding's names are the schema's)",
    example="parallelism:\n  gpu_count: 2\n  strategy: zero-3",
)
def ls017_unknown_strategy(ctx: Context) -> Iterator[Hit]:
    v = ctx.get("parallelism", "strategy")
    name = (v.text() or "").strip() if v.known else ""
    if not name:
        return
    if name.lower() not in C.KNOWN_STRATEGIES:
        guess = C.strategy_guess(name)
        mean = f": did you mean {guess!r}?" if guess else ""
        yield Hit(
            ptr("parallelism", "strategy"), f"unknown strategy {name!r}{mean} (known: {C.SHOWN_STRATEGIES})", ERROR
        )
        return
    sharding = (ctx.get("memory_options", "sharding").text() or "").strip().lower()
    if sharding in C.KNOWN_STRATEGIES and not C.same_strategy(name.lower(), sharding):
        yield Hit(
            ptr("memory_options", "sharding"),
            f"memory_options.sharding {sharding} disagrees with parallelism.strategy {name}, which every command "
            "reads: declare one strategy",
            WARNING,
        )


@rule(
    "LS020",
    ERROR,
    "gradients counted for more parameters than are trainable (frozen base with gradients)",
    "in LoRA/QLoRA only adapter tensors have gradients; count gradients for method.trainable_parameters",
    example="method: {kind: LoRA, trainable_parameters: {value: 4194304, source: VERIFIED}}\n"
    "gradients: {parameters: {value: 6738415616, source: ASSUMPTION, note: all params}}",
)
def ls020_frozen_base_has_gradients(ctx: Context) -> Iterator[Hit]:
    kind = ctx.get("method", "kind").text()
    if kind not in ("LoRA", "QLoRA"):
        return
    grads = ctx.get("gradients", "parameters").integer()
    trainable = ctx.get("method", "trainable_parameters").integer()
    total = ctx.get("identity", "total_parameters").integer()
    if grads is None:
        return
    if trainable is not None and grads > trainable:
        extra = " (that is every model parameter: the frozen base was counted)" if total == grads else ""
        yield Hit(
            ptr("gradients", "parameters"),
            f"gradients.parameters {grads:,} exceeds "
            f"method.trainable_parameters {trainable:,}{extra}; the frozen base has no gradients in {kind}",
        )
    elif trainable is None and total is not None and grads >= total:
        yield Hit(
            ptr("gradients", "parameters"),
            f"gradients.parameters {grads:,} counts every model parameter "
            f"(identity.total_parameters {total:,}); the frozen base has no gradients in {kind}",
        )


@rule(
    "LS021",
    WARNING,
    "optimized parameters differ from trainable parameters",
    "check requires_grad and optimizer.param_groups: the optimizer must hold exactly the trainable tensors",
    example="method: {trainable_parameters: {value: 4194304, source: VERIFIED}}\n"
    "optimizer: {optimized_parameters: {value: 6738415616, source: ASSUMPTION, note: all params}}",
)
def ls021_optimized_vs_trainable(ctx: Context) -> Iterator[Hit]:
    opt = ctx.get("optimizer", "optimized_parameters").integer()
    trainable = ctx.get("method", "trainable_parameters").integer()
    if opt is not None and trainable is not None and opt != trainable:
        yield Hit(
            ptr("optimizer", "optimized_parameters"),
            f"optimizer.optimized_parameters {opt:,} != method.trainable_parameters {trainable:,}",
        )


@rule(
    "LS022",
    ERROR,
    "adapter or gradient bytes do not equal parameters x dtype size",
    "ledger.adapter = trainable_parameters x adapter.dtype bytes; ledger.gradients = gradients.parameters x "
    "gradients.dtype bytes (write dtype `mixed` when tensors differ, with the breakdown)",
    example="method: {trainable_parameters: {value: 4194304, source: VERIFIED}}\nadapter: {dtype: float32}\n"
    "ledger: {adapter: {value: 1000, source: CALCULATED, method: x}}",
)
def ls022_bytes_vs_dtype(ctx: Context) -> Iterator[Hit]:
    checks = (
        ("adapter", ("method", "trainable_parameters"), ("adapter", "dtype")),
        ("gradients", ("gradients", "parameters"), ("gradients", "dtype")),
    )
    full = C.read(ctx.doc).full
    for key, count_path, dtype_path in checks:
        if full and key == "adapter":  # no adapters: ledger.adapter holds the model's weights, each in its own dtype
            continue
        figure = ctx.get("ledger", key).size()
        count = ctx.get(*count_path).integer()
        dtype = ctx.get(*dtype_path).text()
        size = dtypes.itemsize(dtype) if dtype else None
        if figure is None or count is None or size is None:
            continue
        if figure != count * size:
            yield Hit(
                ptr("ledger", key),
                f"ledger.{key} = {figure:,} B but {dotted(count_path)} {count:,} x "
                f"{size} B ({dtype}) = {count * size:,} B ({format_size(count * size)})",
            )


@rule(
    "LS030",
    ERROR,
    "QLoRA described only by bits: quant type (and, for bitsandbytes 4-bit, double quant / compute dtype / "
    "storage dtype) missing",
    f"give base_model.quantization.type (nf4, fp4, int8, {', '.join(C.OTHER_SCHEMES)}); for a bitsandbytes 4-bit "
    "base (nf4, fp4) also double_quant, compute_dtype and storage_dtype (or write UNKNOWN to say you know they are "
    "missing)",
    example="method: {kind: QLoRA}\nbase_model: {quantization: {bits: 4}}",
)
def ls030_qlora_only_bits(ctx: Context) -> Iterator[Hit]:
    cfg = C.read(ctx.doc)
    if cfg.full:  # a quantized base cannot be fully fine-tuned: LS032 says so, whatever its fields
        return
    q = cfg.quantization
    # the minimum intake's own list: a GPTQ/AWQ/... or LLM.int8 base needs its type only (issue 26)
    missing = [k for k in quantization_fields(q) if not ctx.get("base_model", "quantization", k).present]
    if missing:
        where = (
            ptr("base_model", "quantization")
            if ctx.doc.section("base_model").get("quantization") is not None
            else ptr("method", "kind")
        )
        said = q.type or (f"{q.bits}-bit" if q.bits else "QLoRA")
        yield Hit(
            where,
            "QLoRA without "
            + ", ".join(f"quantization.{k}" for k in missing)
            + f": '{said}' alone does not determine the base storage",
        )


@rule(
    "LS032",
    ERROR,
    "method.kind and base_model.quantized disagree (QLoRA on a base declared unquantized, or full fine-tuning of a "
    "quantized base)",
    "QLoRA adapts a quantized base: set base_model.quantized to true (and give quantization), or method.kind to "
    "LoRA for a floating-point base; full fine-tuning trains floating-point weights: load the base unquantized "
    "(base_model.quantized: false) or choose QLoRA",
    example="method: {kind: QLoRA}\nbase_model: {quantized: false}",
)
def ls032_kind_and_quantized_disagree(ctx: Context) -> Iterator[Hit]:
    for conflict in C.read(ctx.doc).conflicts:
        yield Hit(ptr(*conflict.path), conflict.message)


@rule(
    "LS031",
    ERROR,
    "activations or temporary CALCULATED/ASSUMPTION while the status claims VALIDATED",
    "a VALIDATED ledger takes activations and temporary memory from the measurement",
    example="status: VALIDATED\nledger: {activations: {value: 1GB, source: CALCULATED, method: estimate}}",
)
def ls031_validated_needs_measured(ctx: Context) -> Iterator[Hit]:
    if ctx.get("status").text() != "VALIDATED":
        return
    for key in ("activations", "temporary"):
        v = ctx.get("ledger", key)
        src = v.effective_source(True) if v.present else None
        if src in ("CALCULATED", "ASSUMPTION"):
            yield Hit(ptr("ledger", key), f"ledger.{key} is {src} but the status claims VALIDATED")


@rule(
    "LS040",
    ERROR,
    "peak_reserved below peak_allocated (impossible)",
    "reserved memory includes allocated memory; check which figure went where",
    example="metrics: {peak_allocated: {value: 10GB, source: MEASURED}, peak_reserved: {value: 9GB, source: MEASURED}}",
)
def ls040_reserved_below_allocated(ctx: Context) -> Iterator[Hit]:
    alloc = ctx.get("metrics", "peak_allocated").size()
    reserved = ctx.get("metrics", "peak_reserved").size()
    if alloc is not None and reserved is not None and reserved < alloc:
        yield Hit(
            ptr("metrics", "peak_reserved"),
            f"peak_reserved {format_size(reserved)} < peak_allocated {format_size(alloc)}",
        )


def _offload_or_sharding(ctx: Context) -> bool:
    sharding = ctx.get("memory_options", "sharding").text()
    return bool(
        ctx.switch("memory_options", "cpu_offload")
        or ctx.switch("memory_options", "activation_offload")
        or ctx.switch("parallelism", "cpu_offload")
        or (sharding not in (None, "none"))
    )


@rule(
    "LS041",
    WARNING,
    "calculated subtotal above the measured peak without offload or sharding",
    "a resident component cannot exceed the peak: recheck the calculation (dtype? counted twice?) or the measurement",
    example="comparison: {calculated_subtotal: {value: 20GB, source: CALCULATED, method: x}, "
    "measured_peak: {value: 15GB, source: MEASURED}}",
)
def ls041_subtotal_above_measured(ctx: Context) -> Iterator[Hit]:
    calc = ctx.get("comparison", "calculated_subtotal").size()
    meas = ctx.get("comparison", "measured_peak").size()
    if calc is not None and meas is not None and calc > meas and not _offload_or_sharding(ctx):
        yield Hit(
            ptr("comparison", "calculated_subtotal"),
            f"calculated_subtotal {format_size(calc)} > measured_peak {format_size(meas)} with no offload or sharding",
        )


@rule(
    "LS042",
    WARNING,
    "comparison difference without known_explanation",
    "say what explains the difference (activations, temporaries, allocator, context)",
    example="comparison: {difference: {value: 3GB, source: CALCULATED, method: x}}",
)
def ls042_difference_unexplained(ctx: Context) -> Iterator[Hit]:
    if ctx.get("comparison", "difference").known and ctx.get("comparison", "known_explanation").unknown:
        yield Hit(ptr("comparison", "difference"), "comparison.difference without comparison.known_explanation")


@rule(
    "LS050",
    "error when measured, else info",
    "activation offload ON without host_peak, offload_mode, step_time_s",
    "record metrics.host_peak, memory_options.offload_mode and metrics.step_time_s: offload "
    "moves memory to the host and costs time",
    example="memory_options: {activation_offload: ON}",
)
def ls050_offload_evidence(ctx: Context) -> Iterator[Hit]:
    if ctx.switch("memory_options", "activation_offload") is not True:
        return
    missing = [
        p
        for p in (("metrics", "host_peak"), ("memory_options", "offload_mode"), ("metrics", "step_time_s"))
        if ctx.get(*p).unknown
    ]
    if missing:
        yield Hit(
            ptr("memory_options", "activation_offload"),
            "activation offload is ON without " + ", ".join(dotted(p) for p in missing),
            ERROR if ctx.measured() else INFO,
        )


@rule(
    "LS060",
    "error when measured, else warning",
    "several GPUs without placements and one per-rank peak per rank (or a single total summed across GPUs)",
    "give parameter/gradient/optimizer placement and "
    "parallelism.per_rank_peak as a list with one figure per rank; N GPUs are not one device of N x memory",
    example="parallelism: {gpu_count: 2, per_rank_peak: {value: 96GB, source: ASSUMPTION, note: total}}",
)
def ls060_multi_gpu(ctx: Context) -> Iterator[Hit]:
    gpus = ctx.get("parallelism", "gpu_count").integer()
    if gpus is None or gpus <= 1:
        return
    sev = ERROR if ctx.measured() else WARNING
    missing = [
        k
        for k in ("parameter_placement", "gradient_placement", "optimizer_placement")
        if ctx.get("parallelism", k).unknown
    ]
    if missing:
        yield Hit(
            ptr("parallelism", "gpu_count"),
            f"gpu_count {gpus} without " + ", ".join(f"parallelism.{k}" for k in missing),
            sev,
        )
    peaks = ctx.get("parallelism", "per_rank_peak")
    if peaks.form == "plain" and isinstance(peaks.raw, list):
        if len(peaks.raw) != gpus:
            yield Hit(
                ptr("parallelism", "per_rank_peak"), f"per_rank_peak has {len(peaks.raw)} figures for {gpus} ranks", sev
            )
        ranks = [Value.of(item).size() for item in peaks.raw]
        known = [r for r in ranks if r is not None]
        if known and len(known) == len(ranks):
            worst = max(known)
            for key in ("peak_allocated", "peak_reserved", "device_peak"):
                total = ctx.get("metrics", key).size()
                if total is not None and total > worst:
                    yield Hit(
                        ptr("metrics", key),
                        f"metrics.{key} ({format_size(total)}) exceeds every per-rank "
                        f"peak (worst rank {format_size(worst)}): a total summed across GPUs is not a "
                        "device figure; metrics holds the worst rank",
                        sev,
                    )
    elif peaks.present and peaks.known:
        yield Hit(
            ptr("parallelism", "per_rank_peak"),
            "per_rank_peak is a single figure: memory is per rank, a total summed across GPUs is not a per-rank peak",
            sev,
        )
    else:
        yield Hit(
            ptr("parallelism", "gpu_count"),
            f"gpu_count {gpus} without parallelism.per_rank_peak (one figure per rank)",
            sev,
        )


@rule(
    "LS061",
    ERROR,
    "FSDP1 MixedPrecision without autocast over adapters in another dtype: the first forward fails",
    "add training.mixed_precision: bf16 (autocast, as accelerate runs the policy), or declare adapter.dtype equal to "
    "param_dtype, or use strategy fsdp2 (docs/multi-gpu.md gives the torch and PEFT source lines)",
    example="parallelism:\n  strategy: fsdp1\n  mixed_precision_policy: {param_dtype: bfloat16}",
)
def ls061_fsdp1_mixed_precision_without_autocast(ctx: Context) -> Iterator[Hit]:
    conflict = lora_input_dtype_conflict(ctx.doc)
    if conflict is not None:
        yield Hit(ptr(*conflict.path), conflict.message)


@rule(
    "LS062",
    WARNING,
    "a checkpoint or a host wait declared where it changes nothing",
    "parallelism.activation_checkpointing places the checkpoint that memory_options.gradient_checkpointing: true "
    "declares, under FSDP (fsdp2, or FSDP1 by any of its names); training.loss_item_each_step describes a custom "
    "loop (the Trainer reads its loss anyway)",
    example="memory_options: {gradient_checkpointing: false}\n"
    "parallelism: {strategy: fsdp1, activation_checkpointing: true}",
)
def ls062_setting_without_effect(ctx: Context) -> Iterator[Hit]:
    cfg = C.read(ctx.doc)
    if ctx.get("parallelism", "activation_checkpointing").switch() is True:
        strategy = C.declared_strategy(ctx.doc)
        if cfg.gradient_checkpointing is not True:
            yield Hit(
                ptr("parallelism", "activation_checkpointing"),
                "activation_checkpointing places a checkpoint that memory_options.gradient_checkpointing does not "
                "declare: nothing is checkpointed",
            )
        elif strategy not in (*C.FSDP1_NAMES, "fsdp", "fsdp2"):
            yield Hit(
                ptr("parallelism", "activation_checkpointing"),
                f"activation_checkpointing is FSDP's (strategy {strategy or 'absent'}): transformers' own "
                "checkpointing is simulated",
            )
    if cfg.training.loss_item_each_step and cfg.training.loop == "trainer":
        yield Hit(
            ptr("training", "loss_item_each_step"),
            "loss_item_each_step describes a custom loop: the Trainer reads each micro-step's loss anyway",
            INFO,
        )


@rule(
    "LS063",
    WARNING,
    "workload.dp_world_size is not parallelism.gpu_count under a data-parallel strategy",
    "under DDP, FSDP and DeepSpeed ZeRO every rank is a data-parallel replica with its own microbatch "
    "(sharding splits the model state, not the batch): dp_world_size is the number of ranks, which the global "
    "batch (LS010) and the per-GPU figures read",
    example="parallelism: {gpu_count: 2, strategy: fsdp2}\nworkload: {dp_world_size: 1}",
)
def ls063_replicas_are_the_ranks(ctx: Context) -> Iterator[Hit]:
    gpus = ctx.get("parallelism", "gpu_count").integer()
    replicas = ctx.get("workload", "dp_world_size").integer()
    strategy = C.declared_strategy(ctx.doc)
    if gpus is None or replicas is None or gpus == replicas:
        return
    if strategy not in (*C.SHARDED_STRATEGIES, "ddp"):  # device_map across GPUs, or not declared: one replica may be
        return
    yield Hit(
        ptr("workload", "dp_world_size"),
        f"dp_world_size {replicas} with gpu_count {gpus} under {strategy}: each of the {gpus} ranks is a "
        f"data-parallel replica, so dp_world_size is {gpus}",
    )


@rule(
    "LS070",
    ERROR,
    "MEASURED figures with no software versions or no measurement.device",
    "record software.torch/transformers/peft (and cuda) and measurement.device: a measurement is only "
    "reproducible on its stack",
    example="metrics: {peak_allocated: {value: 10GB, source: MEASURED}}",
)
def ls070_measured_without_stack(ctx: Context) -> Iterator[Hit]:
    measured = [path for path, _f, v in ctx.fields() if v.source == "MEASURED"]
    if not measured:
        return
    first = ptr(*measured[0])
    if not any(ctx.get("software", k).known for k in ("torch", "transformers", "peft", "cuda", "rocm")):
        yield Hit(first, f"{len(measured)} MEASURED figure(s) but no software versions")
    if ctx.kind == "ledger" and ctx.get("measurement", "device").unknown:  # an intake has no measurement
        yield Hit(first, f"{len(measured)} MEASURED figure(s) but no measurement.device")


@rule(
    "LS080",
    ERROR,
    "result.oom true without oom_phase",
    "record the phase where OOM happened (load, forward, backward, optimizer_step, ...): it points at the "
    "component to fix",
    example="result: {oom: true}",
)
def ls080_oom_without_phase(ctx: Context) -> Iterator[Hit]:
    if ctx.switch("result", "oom") is True and ctx.get("result", "oom_phase").unknown:
        yield Hit(ptr("result", "oom"), "result.oom is true but result.oom_phase is not given")


@rule(
    "LS005",
    WARNING,
    "CALCULATED figure without a `method`",
    "say how the figure was derived (formula, tool, command) in `method`: a calculation nobody can repeat is an "
    "assumption",
    example="ledger:\n  adapter: {value: 16777216, source: CALCULATED}",
)
def ls005_calculated_without_method(ctx: Context) -> Iterator[Hit]:
    for path, field, v in ctx.fields():
        if field.figure and v.form == "long" and v.source == "CALCULATED" and not v.method:
            yield Hit(ptr(*path), f"{dotted(path)} is CALCULATED without a method")


#: the universal shortcuts of the method article (spec: "Why the ledger exists"), as (pattern, what, why)
_OVERHEAD_WORD = r"(?:subtotal|sum|total|overhead|headroom|margin|safety|запас\w*|накладн\w*|сумм\w*)"
_SHORTCUTS = (
    (
        rf"{_OVERHEAD_WORD}[^.;]*(?:\bx|\*|×)\s*1[.,]\d+|\b1[.,]\d+\s*(?:x|×)\s*(?:the\s+)?{_OVERHEAD_WORD}"
        rf"|\+\s*\d+\s*%[^.;]*{_OVERHEAD_WORD}|{_OVERHEAD_WORD}[^.;]*\+\s*\d+\s*%",
        "a flat overhead factor (subtotal x 1.1)",
        "no universal factor turns a subtotal into a peak: activations and temporaries are measured or estimated",
    ),
    (
        r"0[.,]5\s*(?:bytes?|B|байт\w*)(?!\w)|(?:\bx|\*|×)\s*0[.,]5\b|half a byte|полбайта|param\w*\s*/\s*2\b"
        r"|параметр\w*\s*/\s*2\b",
        "params x 0.5 byte",
        "4-bit x parameters is only the packed payload: absmax constants, unquantized layers, adapters, gradients, "
        "optimizer and activations come on top",
    ),
    (
        r"\b(?:rank|r)\s*(?:x|\*|×)\s*alpha\b",
        "rank x alpha",
        "lora_alpha scales the update; it is not a memory multiplier",
    ),
    (
        r"/\s*(?:n|\d+)\s*(?:gpus?|гпу|видеокарт\w*)\b|divided by (?:the number of )?gpus|\b\d+\s*[GT]i?B\s*/\s*\d+\b",
        "VRAM / N GPUs",
        "memory is per rank and depends on placement: single-GPU memory / N is not a sharding formula",
    ),
    (
        r"25\s*%[^.;]*adam|adam[^.;]*25\s*%|quarter[^.;]*adam|adam[^.;]*quarter|четверт\w*[^.;]*adam|adam[^.;]*четверт",
        "8-bit Adam = 25 % of Adam",
        "tensors under min_8bit_size keep 32-bit state and blockwise absmax adds bytes: compute it per tensor",
    ),
    (
        r"(?:checkpointing|чекпоинт\w*)[^.;]*(?:[-−]\s*\d+\s*%|(?:saves?|reduces?|cuts?|эконом\w*|сниж\w*)[^.;]*\d+\s*%)"
        r"|[-−]\s*\d+\s*%[^.;]*(?:checkpointing|чекпоинт)",
        "checkpointing = -N %",
        "what checkpointing saves depends on the model and workload: estimate or measure it",
    ),
    (
        r"accumulat\w*[^.;]*(?:=|equals?|as)\s*(?:an?\s+)?activation batch",
        "accumulation = activation batch",
        "gradient accumulation runs micro-steps one after another: the activation batch is the microbatch",
    ),
)
SHORTCUTS: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), what, why) for p, what, why in _SHORTCUTS
)


@rule(
    "LS006",
    ERROR,
    "figures computed from inputs that were edited since (resolve, estimate, shard --estimate or measure)",
    "run the command again: `ledgerspec resolve FILE` (exact figures), `ledgerspec estimate FILE` (activations, "
    "x-estimate), `ledgerspec shard FILE --nproc N --estimate` (the per-rank estimate); measure again for a "
    "measurement",
    example="method:\n  rank: 64  # was 16 when resolve ran\nx-resolve:\n  inputs: {method: 0123456789abcdef}",
)
def ls006_stale_inputs(ctx: Context) -> Iterator[Hit]:
    """``x-resolve`` / ``x-estimate`` / ``x-measure`` / ``parallelism.x-per-rank.estimate`` store a fingerprint of the
    inputs they read; an edit shows."""
    wrote = {
        "resolve": "the exact figures (ledger.frozen_base, adapter, gradients, optimizer, parameter counts)",
        "estimate": "ledger.activations and x-estimate",
        "measure": "phases, metrics and x-measure",
        "shard": "the per-rank estimate (parallelism.x-per-rank.estimate)",
    }
    extension = {command: ext for ext, _, command in STAMPS}
    for command, sections in stale(ctx.doc).items():
        where = ptr(sections[0]) if ctx.doc.section(sections[0]) else ptr(*extension[command].split("."), "inputs")
        yield Hit(where, f"{wrote[command]} describe other inputs: {edited_since(command, sections)}")


@rule(
    "LS090",
    WARNING,
    "a figure derived with one of the article's universal shortcuts",
    "derive the figure from the exact configuration (`ledgerspec resolve`, `estimate`, `measure`) instead of "
    "a rule of thumb",
    example="ledger:\n  temporary: {value: 2GB, source: ASSUMPTION, note: subtotal x 1.10}",
)
def ls090_universal_shortcut(ctx: Context) -> Iterator[Hit]:
    for path, _field, v in ctx.fields():
        text = " ".join(t for t in (v.method, v.note) if t)
        for pattern, what, why in SHORTCUTS:
            if text and pattern.search(text):
                yield Hit(ptr(*path), f"{dotted(path)} uses the shortcut '{what}': {why}")
                break


@rule(
    "LS007",
    INFO,
    "declared status below the status the evidence supports",
    "raise `status` to the supported one: `ledgerspec validate --fix` does it, and so does every command that writes "
    "a ledger (unless it is given --keep-status)",
    example="status: INSUFFICIENT DATA   # the evidence below supports CALCULATED\n"
    "identity: {model_id: m/x, revision: abc}\nmethod: {kind: LoRA, rank: 8, target_modules: [q_proj]}\n"
    "base_model: {loaded_dtype: bfloat16}\nadapter: {dtype: float32}\n"
    "workload: {microbatch: 1, max_length: 512, sequence_p95: 400, packing: true}\noptimizer: {name: adamw_torch}\n"
    "memory_options: {gradient_checkpointing: false}\nledger:\n"
    "  frozen_base: {value: 1000000, source: CALCULATED, method: n x 2}\n"
    "  adapter: {value: 4000, source: CALCULATED, method: n x 4}\n"
    "  gradients: {value: 4000, source: CALCULATED, method: n x 4}\n"
    "  optimizer: {value: 8000, source: CALCULATED, method: 2 x n x 4}",
)
def ls007_status_below_supported(ctx: Context) -> Iterator[Hit]:
    declared = ctx.get("status").text()
    supported = ctx.status.status
    if declared in RANK and RANK[declared] < RANK[supported]:
        yield Hit(
            ptr("status"),
            f"declared status {declared} is below the supported status {supported}: it can be raised "
            "(`ledgerspec validate --fix`)",
        )


@rule(
    "LS008",
    ERROR,
    "identity.config_path names no config.json",
    "config_path is relative to the document: point it at the model's config.json or the folder that holds it",
    example="identity:\n  config_path: configs/no-such-model/config.json",
)
def ls008_config_path_missing(ctx: Context) -> Iterator[Hit]:
    """Reads the fact the loader recorded (:mod:`ledgerspec.contract.files`): the checks do no I/O."""
    seen = ctx.doc.facts.get(CONFIG_PATH)
    if not isinstance(seen, ConfigFile) or seen.exists or seen.text != ctx.get("identity", "config_path").text():
        return
    where = "a folder without one" if seen.folder_without_config else "no such file"
    message = f"identity.config_path {seen.text!r} names no config.json ({where}; it is relative to the document)"
    yield Hit(ptr("identity", "config_path"), message)


#: memory and size fields that hold a device's memory (one device, possibly declared in several places)
_DEVICE_MEMORY = (
    ("result", "target_device", "memory"),
    ("x-estimate", "device_memory"),
    ("measurement", "device_memory"),
)


@rule(
    "LS009",
    INFO,
    "a memory field written in decimal units (GB): its binary value",
    'sizes in GB are 10^9 bytes; a GPU sold as "24 GB" holds about 24 GiB: write GiB (or the exact bytes '
    "nvidia-smi shows) when you mean such a card",
    example="result:\n  target_device: {name: RTX 4090, memory: 24 GB}",
)
def ls009_decimal_units(ctx: Context) -> Iterator[Hit]:
    for path, field, v in ctx.fields():
        if field.kind not in (F.MEMORY, F.SIZE) or not isinstance(v.value, str):
            continue
        if device_field(path):
            note = decimal_note(v.value, dotted(path))
        else:
            parts = decimal_unit(v.value)
            size = v.size()
            note = (
                f"{dotted(path)} {v.value.strip()} is {size:,} B = {format_size(size)} (decimal units)"
                if parts is not None and size is not None
                else None
            )
        if note:
            yield Hit(ptr(*path), note)


def device_field(path: tuple[str, ...]) -> bool:
    return tuple(path) in _DEVICE_MEMORY


@rule(
    "LS023",
    "error / warning",
    "optimizer.name is not an optimizer ledgerspec knows (error with a did-you-mean when it is a near miss)",
    "use transformers' TrainingArguments.optim spelling (e.g. adamw_torch, paged_adamw_8bit); resolve, estimate "
    "and measure cannot build an optimizer they do not know",
    example="optimizer:\n  name: paged_adamw8bit",
)
def ls023_unknown_optimizer(ctx: Context) -> Iterator[Hit]:
    name = ctx.get("optimizer", "name").text()
    if not name or optimizer_spec(name) is not None:
        return
    guess = suggest(name)
    if guess:
        yield Hit(
            ptr("optimizer", "name"),
            f"unknown optimizer {name!r}: did you mean {guess!r}? (known: {', '.join(sorted(OPTIMIZERS))})",
            ERROR,
        )
    else:
        yield Hit(
            ptr("optimizer", "name"),
            f"unknown optimizer {name!r}: resolve, estimate and measure cannot size its state (known: "
            f"{', '.join(sorted(OPTIMIZERS))})",
            WARNING,
        )


@rule(
    "LS043",
    WARNING,
    "the device memory is declared twice with different values",
    "keep one figure for one device: result.target_device.memory is the target; re-run `ledgerspec estimate` after "
    "changing it (x-estimate.device_memory is the device the estimate judged); a measurement on the same device "
    "records its memory as nvidia-smi reports it",
    example="result:\n  target_device: {memory: 24 GB}\nx-estimate:\n  device_memory: 25769803776",
)
def ls043_device_memory_twice(ctx: Context) -> Iterator[Hit]:
    target = ctx.get("result", "target_device", "memory").size()
    if target is None:
        return
    estimated = ctx.get("x-estimate", "device_memory").size()
    if estimated is not None and estimated != target:
        yield Hit(
            ptr("x-estimate", "device_memory"),
            f"x-estimate.device_memory {format_size(estimated)} ({estimated:,} B) is not "
            f"result.target_device.memory {format_size(target)} ({target:,} B): the estimate's fit verdict is for "
            "another device (run `ledgerspec estimate FILE` again)",
        )
    measured = ctx.get("measurement", "device_memory").size()
    if measured is None or measured == target:
        return
    name = ctx.get("result", "target_device", "name").text()
    same_device = name is not None and name == ctx.get("measurement", "device_name").text()
    if same_device or _decimal_binary_pair(measured, target):
        yield Hit(
            ptr("measurement", "device_memory"),
            f"measurement.device_memory {format_size(measured)} is not result.target_device.memory "
            f"{format_size(target)}"
            + (f" although both name {name!r}" if same_device else ": one looks like GB, the other like GiB"),
        )


def _decimal_binary_pair(a: int, b: int) -> bool:
    """``a`` and ``b`` are N GB and N GiB (or N TB and N TiB): the same card read in two units."""
    for dec, binary in ((10**9, 2**30), (10**12, 2**40)):
        for x, y in ((a, b), (b, a)):
            if x % dec == 0 and y == x // dec * binary:
                return True
    return False
