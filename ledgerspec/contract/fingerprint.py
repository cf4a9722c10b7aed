"""Input fingerprints: which inputs a tool's figures were computed from, so that a later edit shows.

``resolve``, ``estimate`` and ``measure`` each store, in their ``x-`` extension, a fingerprint of exactly the
input fields they read (``x-resolve.inputs``, ``x-estimate.inputs``, ``x-measure.inputs``): per input section,
the first 16 hex digits of the SHA-256 of a canonical JSON of the values of those fields. ``validate`` (rule
LS006 and the status ladder) recomputes them with the same function: a section whose digest differs was edited
after the tool ran, so the figures the tool wrote describe another configuration.

What goes in (and what does not):

- the *value* of each field, not its form: ``rank: 16`` and ``rank: {value: 16, source: VERIFIED}`` are the same
  input, and editing a ``note`` or a comment changes nothing; ``UNKNOWN`` counts as its word; absent fields are
  left out (so adding one is a change), except those a tool fills in itself (:data:`DEFAULTS`);
- only fields the tool reads. ``method.alpha`` and ``alpha_pattern`` scale the update and create no tensor
  (``rank x alpha`` is one of the article's traps), ``method.dropout`` creates none either (it matters to
  activations, so ``estimate`` and ``measure`` read it); the figures a tool writes itself (``gradients.dtype``,
  ``optimizer.state_format``...) are outputs, not inputs;
- nothing outside the document: the ``config.json`` named by ``identity.config_path`` is pinned by
  ``identity.config_sha256`` (``resolve`` writes that pin and checks it when it runs; ``validate`` reads no
  file). The pin is in the fingerprint, ``config_path`` is not: ``-o OUT`` rewrites that path so it still
  names the same file from the new place, which is no change of input.

A document without a stored fingerprint (hand-written, or written by an older ledgerspec) is not checked. The
digest is for noticing edits, not a security control: 64 bits are far beyond what accidental edits can collide.
Pure and light: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ledgerspec.contract import dtypes
from ledgerspec.contract import fields as F
from ledgerspec.contract.config import GENERATING
from ledgerspec.contract.differences import KNOWN, OLDER
from ledgerspec.contract.document import Document
from ledgerspec.contract.values import Value

Inputs = dict[str, tuple[tuple[str, ...], ...]]

_QUANTIZATION = tuple(
    ("quantization", k)
    for k in (
        "type",
        "bits",
        "storage_dtype",
        "double_quant",
        "compute_dtype",
        "blocksize",
        "skip_modules",
        "desc_act",
        "dequantized",
    )
)

#: what ``resolve`` reads (build.py, census.py, resolve.optimizer_of), per section
RESOLVE_INPUTS: Inputs = {
    "identity": (("model_id",), ("revision",), ("config_sha256",)),  # config_path: see the module docstring
    "method": (
        ("kind",),
        ("rank",),
        ("rank_pattern",),
        ("target_modules",),
        ("target_parameters",),
        ("exclude_modules",),
        ("bias",),
        ("modules_to_save",),
        ("use_dora",),
    ),
    "base_model": (
        ("loaded_dtype",),
        ("quantized",),
        ("prepare_for_kbit_training",),
        ("module_dtypes",),
        *_QUANTIZATION,
    ),
    "adapter": (("dtype",), ("x-lora-dtype",)),
    "optimizer": (("name",), ("min_8bit_size",)),
    # the reward model's sequence classifier (stack/build.py) and DPO/KTO's separate reference model, a second copy
    # of the frozen base (resolve/resolver.py); stamps written before have no such section, so it is not checked
    # for them, and sft and adapter_disabled are left out of the digest (LEFT_OUT_WHEN)
    "training": (("objective",), ("objective_settings", "reference")),
}

#: what ``estimate`` and ``measure`` read: the resolver's inputs plus the workload (workload.WorkloadSpec)
WORKLOAD_INPUTS: Inputs = {
    **RESOLVE_INPUTS,
    "method": (*RESOLVE_INPUTS["method"], ("dropout",)),
    # the GPTQ kernel the step runs (absent: not in the digest, so no earlier stamp changes)
    "base_model": (*RESOLVE_INPUTS["base_model"], ("quantization", "kernel")),
    "software": (
        ("attention_implementation",),
        *(("kernels", op) for op in ("cross_entropy", "norm", "mlp_activation", "rope", "lora_projections")),
    ),
    "workload": (
        ("max_length",),
        ("sequence_p50",),
        ("sequence_p95",),
        ("packing",),
        ("padding_free",),
        ("microbatch",),
        ("gradient_accumulation",),
    ),
    "memory_options": (("gradient_checkpointing",), ("checkpointing_kind",), ("activation_offload",)),
    "training": (
        ("loop",),
        ("mixed_precision",),
        ("use_cache",),
        ("max_grad_norm",),
        # the FSDP device-level stream reads it (absent: not in the digest, so no earlier stamp changes)
        ("loss_item_each_step",),
        ("objective",),
        # the DPO and reward steps read them (absent: not in the digest, so no earlier stamp changes)
        ("objective_settings", "reference"),
        ("objective_settings", "max_completion_length"),
        ("objective_settings", "disable_dropout"),
        ("objective_settings", "center_rewards_coefficient"),
        # the GRPO/RLOO step reads them (hashed for those objectives only: no earlier stamp changes)
        ("objective_settings", "num_generations"),
        ("objective_settings", "steps_per_generation"),
        ("objective_settings", "generation_batch_size"),
        ("objective_settings", "use_vllm"),
        ("objective_settings", "vllm_mode"),
        ("objective_settings", "vllm_gpu_memory_utilization"),
        ("objective_settings", "vllm_enable_sleep_mode"),
    ),
}

#: the declared versions of the packages with a known memory-relevant difference (:mod:`.differences`), read as the
#: side of each difference they fall on: ``shard --estimate`` models the declared side and records no differences of
#: its own (``estimate`` does, for rule LS012), so its stamp holds them (``0.43.0`` to ``0.43.1`` is no edit,
#: ``0.43.0`` to ``0.50.0`` is one)
VERSION_INPUTS: tuple[tuple[str, ...], ...] = tuple((package,) for package in sorted({d.package for d in KNOWN}))
#: inputs that stamps written before they were read leave out: such a stamp is checked on the others
LATER_INPUTS = frozenset(("software", *path) for path in VERSION_INPUTS)

#: what ``shard --estimate`` reads: the workload's inputs, the declared versions (:data:`VERSION_INPUTS`), and how the
#: ranks share the model (every input field of ``parallelism``; its figures, ``per_rank_peak``, are none)
SHARD_INPUTS: Inputs = {
    **WORKLOAD_INPUTS,
    "software": (*WORKLOAD_INPUTS["software"], *VERSION_INPUTS),
    "memory_options": (*WORKLOAD_INPUTS["memory_options"], ("sharding",)),
    "parallelism": tuple(
        path for path, f in F.walk(F.PARALLELISM.children) if f.kind not in (F.OBJECT, *F.FIGURE_KINDS)
    ),
}
#: where ``shard --estimate`` writes its per-rank figures and their stamp
SHARD_ESTIMATE = "parallelism.x-per-rank.estimate"

#: each stamp: the extension that holds it (a dotted path for one inside a section), the inputs it covers, the
#: command that refreshes it
STAMPS: tuple[tuple[str, Inputs, str], ...] = (
    ("x-resolve", RESOLVE_INPUTS, "resolve"),
    ("x-estimate", WORKLOAD_INPUTS, "estimate"),
    ("x-measure", WORKLOAD_INPUTS, "measure"),
    (SHARD_ESTIMATE, SHARD_INPUTS, "shard"),
)
DIGITS = 16

#: what an absent input means to the tools, where a tool later writes it in: ``measure`` records the attention
#: implementation it ran with, which for a document that named none is the default the estimate used
DEFAULTS: dict[tuple[str, ...], Any] = {
    ("software", "attention_implementation"): "sdpa",
    # transformers.Trainer's defaults (contract.config.TRAINER_DEFAULTS): writing them out is no edit
    ("training", "loop"): "trainer",
    ("training", "mixed_precision"): "no",
    ("training", "max_grad_norm"): 1.0,
}


#: inputs read as dtype names (``bf16`` and ``bfloat16`` are one input)
DTYPE_INPUTS = {
    ("base_model", "loaded_dtype"),
    ("adapter", "dtype"),
    ("base_model", "quantization", "compute_dtype"),
    ("base_model", "quantization", "storage_dtype"),
}
#: inputs the tools read case-insensitively, whose canonical spelling is lower case
CASELESS_INPUTS = {
    ("optimizer", "name"),
    ("base_model", "quantization", "type"),
    ("base_model", "quantization", "kernel"),
    ("identity", "config_sha256"),
    ("training", "loop"),
    ("training", "mixed_precision"),
    ("training", "objective_settings", "reference"),
    *(("software", "kernels", op) for op in ("cross_entropy", "norm", "mlp_activation", "rope")),
}
#: numbers read as floats (``1`` and ``1.0`` are one input); added after the first stamps, so no stamp changes
FLOAT_INPUTS = {("training", "max_grad_norm"), ("training", "objective_settings", "center_rewards_coefficient")}
#: lists whose order the tools ignore (PEFT matches each module against the set)
SET_INPUTS = {
    ("method", "target_modules"),
    ("method", "target_parameters"),
    ("method", "exclude_modules"),
    ("method", "modules_to_save"),
    ("base_model", "quantization", "skip_modules"),
    ("software", "kernels", "lora_projections"),
}


#: inputs added after documents were stamped, left out of the digest when they hold the value an absent one means
#: (importers always wrote ``activation_offload: false``), so that the stamps of those documents still hold
LEFT_OUT_WHEN = {
    ("memory_options", "activation_offload"): False,
    ("training", "objective"): "sft",
    # read by the DPO step since it is simulated; TRL's defaults left out (the importers wrote the reference)
    ("training", "objective_settings", "reference"): "adapter_disabled",
    ("training", "objective_settings", "disable_dropout"): True,
}
#: the objectives that generate (GRPO, RLOO: :data:`~ledgerspec.contract.config.GENERATING`) are simulated since
#: after the first stamps, so their documents have no earlier stamps and nothing of theirs is left out
GENERATION_SETTINGS = (
    "num_generations",
    "steps_per_generation",
    "generation_batch_size",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
)
#: inputs only some objectives' steps read -> those objectives: hashed for their documents only (the other objectives'
#: stamps never read them)
OBJECTIVE_ONLY: dict[tuple[str, ...], tuple[str, ...]] = {
    ("training", "objective_settings", "reference"): ("dpo", "kto", *GENERATING),
    ("training", "objective_settings", "max_completion_length"): ("dpo", "kto", *GENERATING),
    ("training", "objective_settings", "disable_dropout"): ("dpo", "reward", "kto", "orpo", "cpo", *GENERATING),
    ("training", "objective_settings", "center_rewards_coefficient"): ("reward",),
    **{("training", "objective_settings", key): GENERATING for key in GENERATION_SETTINGS},
}
#: resolve reads the reference only where it is a second copy of the base (DPO's and KTO's ``model``)
RESOLVE_OBJECTIVE_ONLY: dict[tuple[str, ...], tuple[str, ...]] = {
    **OBJECTIVE_ONLY,
    ("training", "objective_settings", "reference"): ("dpo", "kto"),
}
#: inputs only the DPO step reads
DPO_ONLY = {path for path, objectives in OBJECTIVE_ONLY.items() if "dpo" in objectives and "reward" not in objectives}


def _value(
    doc: Document,
    path: tuple[str, ...],
    verbatim: bool = False,
    only: dict[tuple[str, ...], tuple[str, ...]] | None = None,
) -> tuple[bool, Any]:
    v = doc.get(*path)
    if not v.present:
        return (True, DEFAULTS[path]) if path in DEFAULTS else (False, None)
    objective = str(doc.get("training", "objective").value).strip().lower()
    table = OBJECTIVE_ONLY if only is None else only
    if path in table and objective not in table[path]:
        return False, None
    if path in LEFT_OUT_WHEN and not v.unknown and objective not in GENERATING:
        default = LEFT_OUT_WHEN[path]
        if isinstance(default, bool):
            same = v.switch() is default
        else:
            same = str(v.value).strip().lower() == default
        if same:
            return False, None
    if v.unknown:
        return True, v.source or "UNKNOWN"
    return True, v.value if verbatim else _meaning(doc, path, v.value)


#: the known differences a declared version's digest names whichever side it is on: those known when the digest took
#: this form. One added since is named only where the version is on its older side, and only if a derivation models
#: it (one that is not modelled changes no figure: the record beside the figures and LS012 say it), so that adding it
#: leaves every stamp of a version it does not concern valid, and makes those of a version whose figures it changes
#: stale (they were computed before anyone knew of it)
DIGEST_EVERY_SIDE = frozenset(
    (
        "bitsandbytes-4bit-matmul-input",
        "transformers-moe-fused-experts",
        "transformers-causal-lm-loss-shift-copy",
        "transformers-causal-lm-float-logits-in-model",
        "transformers-checkpoint-outside-fsdp-unit",
        "peft-gptq-lora-input-cast",
    )
)


def version_meaning(package: str, version: str) -> dict[str, str | None]:
    """A declared version as the tools read it: the side of each known difference of ``package`` it is on (so that
    0.43.0 and 0.50.0 of bitsandbytes are one input), by :data:`DIGEST_EVERY_SIDE`'s rule."""
    out: dict[str, str | None] = {}
    for d in KNOWN:
        if d.package != package:
            continue
        side = d.side(version)
        if d.id in DIGEST_EVERY_SIDE or (side == OLDER and d.modelled):
            out[d.id] = side
    return out


def _meaning(doc: Document, path: tuple[str, ...], value: Any) -> Any:
    """The value as the tools read it, so that spelling an input differently is no edit: ON/yes/true are one
    switch, ``bf16`` is ``bfloat16``, ``2048.0`` and ``'2048'`` are 2048, optimizer names ignore case, and the
    order of a target-module list does not matter."""
    if path in LATER_INPUTS and not isinstance(value, bool) and isinstance(value, str | int | float):
        return version_meaning(path[1], str(value))
    field = doc.field(*path)
    kind = field.kind if field is not None else None
    if kind == F.SWITCH:
        switch = Value.of(value).switch()
        return value if switch is None else switch
    if path in FLOAT_INPUTS and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind in (F.INT, F.COUNT) and not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
    if isinstance(value, str):
        if path in DTYPE_INPUTS:
            return dtypes.canonical(value) or value
        if path in CASELESS_INPUTS:
            return value.strip().lower()
    if path in SET_INPUTS and isinstance(value, list) and all(isinstance(x, str) for x in value):
        return sorted(set(value))
    return value


#: inputs the first version of the stamp did not read (its ``verbatim`` digests leave them out)
FIRST_VERSION_LEFT_OUT = {("workload", "padding_free"), ("base_model", "quantization", "kernel")}


def section_digest(
    doc: Document,
    section: str,
    keys: tuple[tuple[str, ...], ...],
    verbatim: bool = False,
    only: dict[tuple[str, ...], tuple[str, ...]] | None = None,
    earlier: bool = False,
) -> str:
    """The digest of one section's input fields (their values as the tools read them, canonical JSON, SHA-256,
    first 16 hex digits). ``verbatim``: as the first version of the stamp hashed them: the values as written, and
    only the fields it read. ``earlier``: as stamps written before :data:`LATER_INPUTS` were read hashed them."""
    values: dict[str, Any] = {}
    for key in keys:
        if verbatim and (section, *key) in FIRST_VERSION_LEFT_OUT:
            continue
        if earlier and (section, *key) in LATER_INPUTS:
            continue
        present, value = _value(doc, (section, *key), verbatim, only)
        if present:
            values[".".join(key)] = value
        elif (section, *key) in LATER_INPUTS and not (verbatim or earlier):
            # undeclared is the installed side: explicit, so that a stamp written with none declared is not the
            # earlier form's (which would let a version declared since pass unseen)
            values[".".join(key)] = None
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGITS]


def digests(doc: Document, inputs: Inputs) -> dict[str, str]:
    """The fingerprint of ``doc`` for a tool reading ``inputs``: section -> digest (what a tool stores)."""
    only = _objective_only(inputs)
    return {section: section_digest(doc, section, keys, only=only) for section, keys in inputs.items()}


def _objective_only(inputs: Inputs) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Which objectives read each objective-only input, for the tool reading ``inputs`` (resolve reads fewer)."""
    return RESOLVE_OBJECTIVE_ONLY if inputs is RESOLVE_INPUTS else OBJECTIVE_ONLY


def input_digest(doc: Document) -> str:
    """SHA-256 of every input section of ``doc`` exactly as written (canonical JSON of the values, provenance and
    notes included): a cache key that any edit of an input section changes. Stricter than :func:`digests` (which
    ignores spellings and fields no tool reads), so a cache keyed on it can only miss, never answer for another
    configuration. The output sections (``ledger``, ``phases``, ``result``, ``x-estimate``...) are left out: writing
    an answer back does not change the question."""
    values = {name: doc.plain[name] for name in sorted(F.INPUT_SECTION_NAMES) if name in doc.plain}
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stored(doc: Document, extension: str) -> dict[str, str] | None:
    """The fingerprint stored in ``extension`` (``x-resolve``..., or a dotted path such as
    :data:`SHARD_ESTIMATE`), or None when there is none (not checked)."""
    block: Any = doc.plain
    for key in extension.split("."):
        block = block.get(key) if isinstance(block, dict) else None
    inputs = block.get("inputs") if isinstance(block, dict) else None
    if not isinstance(inputs, dict) or not inputs:
        return None
    return {str(k): str(v) for k, v in inputs.items()}


def changed_sections(doc: Document, extension: str, inputs: Inputs) -> list[str] | None:
    """The input sections edited since the fingerprint in ``extension`` was stored (None: nothing stored).

    Only the sections the stored fingerprint has are compared: a stamp written by a version that read fewer
    sections is checked on those it covers."""
    before = stored(doc, extension)
    if before is None:
        return None
    now = digests(doc, inputs)
    # a section it did not store is not checked; a stamp hashed from the values as written (the first version of
    # this stamp), or before the declared versions were read, still matches them
    only = _objective_only(inputs)
    return [
        s
        for s in now
        if (
            s in before
            and now[s] != before[s]
            and section_digest(doc, s, inputs[s], verbatim=True, only=only) != before[s]
            and section_digest(doc, s, inputs[s], only=only, earlier=True) != before[s]
        )
    ]


def stale(doc: Document) -> dict[str, list[str]]:
    """Command -> the input sections edited since it wrote its figures (only the stale commands)."""
    out: dict[str, list[str]] = {}
    for extension, inputs, command in STAMPS:
        changed = changed_sections(doc, extension, inputs)
        if changed:
            out[command] = changed
    return out


__all__ = [
    "DEFAULTS",
    "DIGITS",
    "LATER_INPUTS",
    "RESOLVE_INPUTS",
    "SHARD_ESTIMATE",
    "SHARD_INPUTS",
    "STAMPS",
    "VERSION_INPUTS",
    "WORKLOAD_INPUTS",
    "changed_sections",
    "digests",
    "input_digest",
    "section_digest",
    "stale",
    "stored",
]
