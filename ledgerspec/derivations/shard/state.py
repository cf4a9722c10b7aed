"""Per-rank model state under FSDP2 and DeepSpeed ZeRO: pure arithmetic over parameter descriptors.

FSDP2 (``torch.distributed.fsdp.fully_shard``, read in ``_fully_shard/_fsdp_param.py`` and
``_fsdp_collectives.py``):

* every parameter is sharded on dim 0 with ``torch.chunk`` semantics: chunk size ``c = ceil(d0 / W)``; rank
  ``r`` holds ``max(0, min(c, d0 - r*c))`` rows; ``torch.chunk`` may return fewer than ``W`` chunks, the
  missing ones are empty;
* each rank allocates its shard PADDED to ``c`` rows (``padded_sharded_param_size = chunks[0].size()``), so
  every rank holds ``c * prod(shape[1:])`` elements of every parameter, frozen or trainable;
* gradients come out of the reduce-scatter as views of one buffer per unit, sized by the padded shards:
  ``c * prod(shape[1:])`` elements of every parameter with a gradient, in the parameter's dtype;
* optimizer state is created with ``zeros_like`` of the UNPADDED local shard (rows of this rank only);
* buffers are not sharded: every rank holds all of them;
* during compute a unit is all-gathered into ``W * c * prod(shape[1:])`` elements per parameter; the root
  unit stays gathered from forward through backward; with ``reshard_after_forward=False`` every unit stays
  gathered from its forward until its backward.

ZeRO (DeepSpeed) per-rank model states for comparison: stage 1 partitions optimizer state, stage 2 also
gradients, stage 3 also parameters; CPU offload moves the optimizer state (and the partitioned fp32
gradients) to the host, stage 3 parameter offload the parameters too. DeepSpeed's alignment padding of its
flat partitions (a few elements) is not modelled: the ZeRO figures use ``ceil(N / W)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import ceil, prod

from ledgerspec.contract import dtypes
from ledgerspec.derivations.stack.optimizer_state import (
    OPTIMIZERS,
    OptimizerSpec,
    TensorShape,
    optimizer_spec,
    state_bytes,
)

ROOT = "<root>"
CALCULATED_BY = "ledgerspec.derivations.shard.state"


@dataclass(frozen=True)
class ParamDesc:
    """One parameter (or buffer) of the model: what FSDP2 needs to shard it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    unit: str = ROOT
    kind: str = "param"  # param | buffer

    @property
    def itemsize(self) -> int:
        size = dtypes.itemsize(self.dtype)
        if size is None:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")
        return size

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def row_numel(self) -> int:
        return prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def fsdp2_optimizer(name: str) -> OptimizerSpec:
    """The spec of a torch optimizer FSDP2 can drive: its state follows the DTensor shards element-wise."""
    spec = optimizer_spec(name)
    if spec is None or spec.family not in ("adam", "sgd"):
        known = sorted(k for k, v in OPTIMIZERS.items() if v.family in ("adam", "sgd"))
        raise ValueError(
            f"optimizer {name!r}: per-rank FSDP2 state is known for torch optimizers "
            f"({', '.join(known)}); bitsandbytes and Adafactor states are not element-wise on "
            "DTensor shards"
        )
    return spec


# -- FSDP2 ---------------------------------------------------------------------------------------------


def chunk_rows(dim0: int, world: int) -> list[int]:
    """Rows of dim 0 each rank holds: ``torch.chunk(t, world, 0)`` padded with empty chunks to ``world``."""
    if world < 1:
        raise ValueError("world size must be >= 1")
    c = ceil(dim0 / world)
    return [max(0, min(c, dim0 - r * c)) for r in range(world)]


def padded_rows(dim0: int, world: int) -> int:
    """Rows every rank allocates: the first chunk's size (FSDP2 pads every shard to it)."""
    return ceil(dim0 / world)


def _check_shardable(p: ParamDesc) -> None:
    if p.kind == "param" and len(p.shape) == 0:
        raise ValueError(f"{p.name}: FSDP2 shards dim 0 and cannot shard a 0-dim parameter")


@dataclass(frozen=True)
class ParamShard:
    """One parameter on one rank, in bytes."""

    rows: int  # rows of dim 0 this rank owns (unpadded)
    storage: int  # the padded local shard every rank allocates
    gradient: int  # padded gradient shard (0 when frozen)
    optimizer: int  # optimizer state on the device: shaped like the UNPADDED local shard (+ fused step)
    optimizer_host: int  # optimizer scalars torch keeps on the host (non-fused Adam's step)


def param_shard(p: ParamDesc, world: int, rank: int, optimizer: str = "adamw_torch") -> ParamShard:
    """What rank ``rank`` of ``world`` holds of parameter ``p`` under FSDP2."""
    _check_shardable(p)
    spec = fsdp2_optimizer(optimizer)
    rows = chunk_rows(p.shape[0], world)[rank]
    storage = padded_rows(p.shape[0], world) * p.row_numel * p.itemsize
    if not p.trainable:
        return ParamShard(rows, storage, 0, 0, 0)
    state = state_bytes(spec, [TensorShape((rows, *p.shape[1:]), p.itemsize)])
    return ParamShard(rows, storage, storage, state.device, state.host)


@dataclass
class RankState:
    """What one rank holds under FSDP2, in bytes."""

    rank: int
    frozen_base: int = 0  # padded local shards of frozen parameters + every buffer (buffers are replicated)
    adapter: int = 0  # padded local shards of trainable parameters
    gradients: int = 0  # padded local gradient shards (reduce-scatter output)
    optimizer: int = 0  # optimizer state on the device (unpadded local shards)
    optimizer_host: int = 0  # optimizer scalars torch keeps on the host (non-fused Adam's step)
    gathered: int = 0  # unsharded parameters held during compute (the peak set of gathered units)

    @property
    def model_state(self) -> int:
        return self.frozen_base + self.adapter + self.gradients + self.optimizer

    @property
    def with_gathered(self) -> int:
        return self.model_state + self.gathered


@dataclass
class Fsdp2Plan:
    world_size: int
    reshard_after_forward: bool
    ranks: list[RankState]
    unit_unsharded: dict[str, int]  # bytes of each unit when gathered (padded)
    gathered_units: list[str]  # the units held gathered at the peak
    notes: list[str] = field(default_factory=list)
    param_dtype: str | None = None  # MixedPrecisionPolicy.param_dtype: the gathered units' floating dtype


def _floating(dtype: str) -> bool:
    name = dtypes.canonical(dtype) or dtype
    return name.startswith(("float", "bfloat"))


def gathered_itemsize(p: ParamDesc, param_dtype: str | None = None) -> int:
    """Bytes per element of ``p`` once all-gathered: ``MixedPrecisionPolicy.param_dtype`` for a floating parameter
    (``FSDPParam.init_dtype_attrs`` keeps non-floating parameters in their own dtype), else its own dtype."""
    if param_dtype is None or not _floating(p.dtype):
        return p.itemsize
    size = dtypes.itemsize(param_dtype)
    if size is None:
        raise ValueError(f"unknown param_dtype {param_dtype!r}")
    return size


def unit_unsharded_bytes(params: list[ParamDesc], world: int, param_dtype: str | None = None) -> dict[str, int]:
    """Bytes of each FSDP unit when all-gathered: ``W * padded_rows * row_numel`` per parameter, in
    ``param_dtype`` under a ``MixedPrecisionPolicy`` (the all-gather input is the shard cast to it)."""
    out: dict[str, int] = {}
    for p in params:
        if p.kind != "param":
            continue
        _check_shardable(p)
        size = gathered_itemsize(p, param_dtype)
        out[p.unit] = out.get(p.unit, 0) + world * padded_rows(p.shape[0], world) * p.row_numel * size
    return out


def kept_after_forward(units: dict[str, int], reshard_after_forward: bool | None) -> int:
    """Gathered parameter bytes FSDP2 still holds when the forward returns (counted in a rank's "held after the
    forward", but parameters, not activations): every unit with ``reshard_after_forward=False``; the root alone
    with FSDP2's default (None: the root is not resharded after forward, backward starts with it); nothing with an
    explicit True (the root reshards too)."""
    if reshard_after_forward is False:
        return sum(units.values())
    return units.get(ROOT, 0) if reshard_after_forward is None else 0


def fsdp2(
    params: list[ParamDesc],
    world: int,
    optimizer: str = "adamw_torch",
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
) -> Fsdp2Plan:
    """Per-rank state of ``fully_shard`` per decoder layer + root on ``world`` ranks.

    ``param_dtype``: ``MixedPrecisionPolicy.param_dtype``. It changes only the gathered units: the shards, the
    sharded gradients (``foreach_reduce`` casts the reduce-scatter output back to the parameter's dtype,
    ``_fsdp_collectives.py``) and the optimizer state (on the sharded parameters) keep the parameters' dtypes.
    """
    ranks = [RankState(r) for r in range(world)]
    for p in params:
        if p.kind == "buffer":
            for rs in ranks:
                rs.frozen_base += p.nbytes
            continue
        for rs in ranks:
            s = param_shard(p, world, rs.rank, optimizer)
            if p.trainable:
                rs.adapter += s.storage
                rs.gradients += s.gradient
                rs.optimizer += s.optimizer
                rs.optimizer_host += s.optimizer_host
            else:
                rs.frozen_base += s.storage
    units = unit_unsharded_bytes(params, world, param_dtype)
    gathered_units = _gathered_units(units, reshard_after_forward)
    held = sum(units[u] for u in gathered_units)
    for rs in ranks:
        rs.gathered = held
    notes = [
        f"{world} ranks; a unit's all-gather briefly holds a second copy of that unit (flat buffer + "
        "per-parameter outputs)"
    ]
    if param_dtype is not None:
        notes.append(f"MixedPrecisionPolicy: floating parameters all-gathered in {param_dtype}")
    return Fsdp2Plan(world, reshard_after_forward, ranks, units, gathered_units, notes, param_dtype)


#: the name of DPO/KTO's separate reference model among a plan's gathered units (it is one unit: its root)
REFERENCE = "<reference model>"


def fsdp1_kept_after_forward(plan: Fsdp1Plan, reshard_after_forward: bool | None) -> int:
    """Gathered parameter bytes an FSDP1 rank still holds when the policy's forward returns (the reference model's
    units aside): the root under FULL_SHARD (FSDP1 does not free the root's unsharded flat parameter in its
    post-forward), every unit under SHARD_GRAD_OP (``reshard_after_forward`` False). Nothing on one rank (NO_SHARD):
    nothing is gathered, and FSDP1 frees every unit's MixedPrecision copy after its forward, the root's too
    (``_post_forward_reshard`` -> ``post_reshard``: ``_free_low_precision_sharded_param`` without a sharded strategy;
    torch 2.13 ``_runtime_utils.py``, ``_flat_param.py``)."""
    if plan.world_size == 1:
        return 0
    units = {u: b for u, b in plan.unit_unsharded.items() if not u.startswith(REFERENCE)}
    return units.get(ROOT, 0) if reshard_after_forward is not False else sum(units.values())


def with_reference(
    plan: Fsdp2Plan, params: list[ParamDesc], world: int, reshard_after_forward: bool = True
) -> Fsdp2Plan:
    """``plan`` beside DPO/KTO's separate reference model as TRL's ``prepare_fsdp`` shards it under FSDP2
    (trl/models/utils.py 313-341, TRL 1.16): ONE ``fully_shard`` of its root. Its weights are the base's (``params``'
    frozen parameters, no adapter), sharded on dim 0 as the policy's, its buffers whole on every rank; its forward
    gathers the whole of it at once (one unit), beside what the policy keeps gathered after its own forward
    (:func:`kept_after_forward`); with ``reshard_after_forward`` false it stays gathered."""
    base = [replace(p, unit=ROOT) for p in params if not p.trainable]
    ref = fsdp2(base, world, reshard_after_forward=True, param_dtype=plan.param_dtype)
    whole = ref.unit_unsharded.get(ROOT, 0)
    at_its_forward = whole + kept_after_forward(plan.unit_unsharded, plan.reshard_after_forward)
    ranks = []
    for rs, r in zip(plan.ranks, ref.ranks, strict=True):
        # resharded after its forward: the larger of the policy's peak set and the reference at its forward; kept
        # gathered: the whole reference beside whatever the policy holds
        gathered = max(rs.gathered, at_its_forward) if reshard_after_forward else rs.gathered + whole
        ranks.append(replace(rs, frozen_base=rs.frozen_base + r.frozen_base, gathered=gathered))
    units = {**plan.unit_unsharded, REFERENCE: whole}
    if not reshard_after_forward:
        held = [*plan.gathered_units, REFERENCE]
    else:
        held = plan.gathered_units if max(r.gathered for r in plan.ranks) >= at_its_forward else [REFERENCE]
    note = (
        "DPO/KTO's reference model: one fully_shard of its root (TRL's prepare_fsdp), its shards beside the policy's, "
        "the whole of it gathered for its forward"
    )
    return replace(plan, ranks=ranks, unit_unsharded=units, gathered_units=held, notes=[*plan.notes, note])


def _gathered_units(units: dict[str, int], reshard_after_forward: bool) -> list[str]:
    """Units gathered together at the compute peak.

    FSDP2 does not reshard the root after forward (backward starts with it), so the root and the largest
    layer unit are gathered together; with ``reshard_after_forward=False`` every unit is.
    """
    if not reshard_after_forward:
        return sorted(units)
    layers = {u: b for u, b in units.items() if u != ROOT}
    held = [ROOT] if ROOT in units else []
    if layers:
        held.append(max(sorted(layers), key=lambda u: layers[u]))
    return held


# -- FSDP1 (FullyShardedDataParallel, flat parameters) ------------------------------------------------


def peft_fsdp1_units(params: list[ParamDesc]) -> list[ParamDesc]:
    """The units of FSDP1 as transformers' Trainer wraps a PEFT model: each trainable parameter in its own
    module's unit, the rest as :func:`ledgerspec.derivations.shard.model` assigned them (decoder layers + root).

    transformers 5 ``Trainer`` calls ``update_fsdp_plugin_peft`` (``transformers/distributed/fsdp.py``), which sets
    accelerate's ``auto_wrap_policy`` to PEFT's ``fsdp_auto_wrap_policy`` (``peft/utils/other.py``, PEFT 0.21):
    ``_or_policy`` of ``transformer_auto_wrap_policy`` (the ``_no_split_modules`` classes) and a
    ``lambda_auto_wrap_policy`` wrapping every leaf module whose ``weight`` requires grad (each ``lora_A``/``lora_B``
    Linear, a ``modules_to_save`` copy ...). So no flat parameter mixes frozen and trainable tensors (or the
    float32 adapter dtype with a bf16 base, which FSDP1 refuses: "Must flatten tensors with uniform dtype").
    """
    out = []
    for p in params:
        if p.kind == "param" and p.trainable and "." in p.name:
            out.append(replace(p, unit=p.name.rsplit(".", 1)[0]))
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class FlatUnit:
    """One FSDP1 ``FlatParameter``: its parameters' offsets in the flat tensor, padded and sharded."""

    name: str
    dtype: str
    trainable: bool  # flat_param.requires_grad: any of its parameters
    numel: int  # padded unsharded numel: alignment padding + padding to a multiple of the world size
    offsets: tuple[tuple[ParamDesc, int], ...]  # (parameter, start in the flat tensor)
    world: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world

    @property
    def itemsize(self) -> int:
        return self.offsets[0][0].itemsize

    def local_numel(self, p: ParamDesc, start: int, rank: int) -> int:
        """Elements of ``p`` (at ``start``) inside rank ``rank``'s shard ``[rank * S, (rank + 1) * S)``."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        return max(0, min(hi, start + p.numel) - max(lo, start))


def flat_units(
    params: list[ParamDesc], world: int, use_orig_params: bool = True, param_dtype: str | None = None
) -> dict[str, FlatUnit]:
    """Every unit's ``FlatParameter`` as ``FlatParamHandle._init_flat_param_and_metadata`` lays it out (torch 2.13
    ``distributed/fsdp/_flat_param.py``).

    The parameters of a unit are flattened in module order (``named_parameters``); with ``use_orig_params`` every
    parameter starts at a multiple of ``16 // itemsize(compute dtype)`` elements (``_get_aligned_numel``,
    "alignment constraint comes from TorchInductor": zero padding before it), and the total is padded to a
    multiple of the world size. Without ``use_orig_params`` there is no alignment padding and ``_get_shard`` pads
    the last chunk to ``ceil(numel / W)``. A unit's parameters must share one dtype (``_validate_tensors_to_flatten``).
    """
    groups: dict[str, list[ParamDesc]] = {}
    for p in params:
        if p.kind == "param":
            groups.setdefault(p.unit, []).append(p)
    out: dict[str, FlatUnit] = {}
    for unit, members in groups.items():
        kinds = {p.dtype for p in members}
        if len(kinds) > 1:
            raise ValueError(
                f"FSDP1 unit {unit}: parameters of dtypes {sorted(kinds)} in one flat parameter (FSDP1 refuses it: "
                "'Must flatten tensors with uniform dtype')"
            )
        dtype = members[0].dtype
        aligned = 16 // gathered_itemsize(members[0], param_dtype) if use_orig_params else 0
        total = 0
        offsets = []
        for p in members:
            if aligned and total % aligned:
                total += aligned - total % aligned
            offsets.append((p, total))
            total += p.numel
        total = ceil(total / world) * world
        out[unit] = FlatUnit(unit, dtype, any(p.trainable for p in members), total, tuple(offsets), world)
    return out


@dataclass
class Fsdp1Plan:
    world_size: int
    reshard_after_forward: bool  # FULL_SHARD (True) or SHARD_GRAD_OP (False)
    ranks: list[RankState]
    units: dict[str, FlatUnit]
    unit_unsharded: dict[str, int]  # bytes of each unit when gathered (padded flat parameter)
    gathered_units: list[str]
    notes: list[str] = field(default_factory=list)
    param_dtype: str | None = None


def with_fsdp1_reference(plan: Fsdp1Plan, reference: Fsdp1Plan) -> Fsdp1Plan:
    """``plan`` beside DPO/KTO's separate reference model as TRL's ``prepare_fsdp`` wraps it under FSDP1
    (trl/models/utils.py 292-312, TRL 1.16): ``reference`` is its own plan (the base's frozen parameters, one unit per
    decoder layer and the root: accelerate's transformer-based wrap). Each rank holds its flat shards beside the
    policy's; its forward runs without grad, so no backward reshards its root after it: FULL_SHARD keeps the root
    gathered from its first forward on (SHARD_GRAD_OP every unit), beside what the policy gathers."""
    units = reference.unit_unsharded
    kept = units.get(ROOT, 0) if reference.reshard_after_forward else sum(units.values())
    ranks = [
        replace(rs, frozen_base=rs.frozen_base + r.frozen_base, gathered=rs.gathered + kept)
        for rs, r in zip(plan.ranks, reference.ranks, strict=True)
    ]
    note = (
        "DPO/KTO's reference model: FSDP1 units per decoder layer and the root (TRL's prepare_fsdp), its flat shards "
        "beside the policy's, its root kept gathered after its forward (no backward reshards it)"
    )
    merged = {**plan.unit_unsharded, **{REFERENCE if u == ROOT else f"{REFERENCE}.{u}": b for u, b in units.items()}}
    held = [*plan.gathered_units, REFERENCE if reference.reshard_after_forward else f"{REFERENCE} (every unit)"]
    return replace(plan, ranks=ranks, unit_unsharded=merged, gathered_units=held, notes=[*plan.notes, note])


def _buffer_bytes(p: ParamDesc, buffer_dtype: str | None) -> int:
    """A buffer's bytes once FSDP1 has cast it to ``buffer_dtype`` (floating buffers only,
    ``_runtime_utils._get_buffers_and_dtypes_for_computation``)."""
    if buffer_dtype is None or not p.dtype.startswith(("float", "bfloat")):
        return p.nbytes
    size = dtypes.itemsize(buffer_dtype)
    return p.numel * (size if size is not None else p.itemsize)


def fsdp1(
    params: list[ParamDesc],
    world: int,
    optimizer: str = "adamw_torch",
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
    use_orig_params: bool = True,
    buffer_dtype: str | None = None,
) -> Fsdp1Plan:
    """Per-rank state of FSDP1 ``FULL_SHARD`` (``reshard_after_forward``) or ``SHARD_GRAD_OP`` over the units of
    ``params`` (give them :func:`peft_fsdp1_units` for the Trainer's wrapping); on one rank (``world`` 1) FSDP1's
    ``NO_SHARD``, every flat parameter whole and nothing gathered.

    Each rank holds ``numel / W`` elements of every flat parameter (``FlatParamHandle.shard``: ``_local_shard``),
    frozen or trainable; the sharded gradient of a trainable flat parameter has the same size (the
    reduce-scatter output); buffers are whole on every rank. With ``use_orig_params`` the optimizer sees the
    original parameters as views of this rank's part of the shard: its state covers the elements of each
    trainable parameter that fall in this rank's range (no padding), and a parameter with none there gets no
    state. ``MixedPrecision.param_dtype`` (``param_dtype``) changes only the gathered units;
    ``MixedPrecision.buffer_dtype`` (``buffer_dtype``) the floating buffers, as FSDP1 casts them at the first forward
    (the figures are those of the training steps).
    """
    spec = fsdp2_optimizer(optimizer)
    units = flat_units(params, world, use_orig_params, param_dtype)
    ranks = [RankState(r) for r in range(world)]
    buffers = sum(_buffer_bytes(p, buffer_dtype) for p in params if p.kind == "buffer")
    for rs in ranks:
        rs.frozen_base += buffers
        for u in units.values():
            shard = u.shard_numel * u.itemsize
            if not u.trainable:
                rs.frozen_base += shard
                continue
            rs.adapter += shard
            rs.gradients += shard
            local = [
                TensorShape((n,), p.itemsize)
                for p, start in u.offsets
                if p.trainable and (n := u.local_numel(p, start, rs.rank))
            ]
            state = state_bytes(spec, local)
            rs.optimizer += state.device
            rs.optimizer_host += state.host
    unsharded = {name: u.numel * gathered_itemsize(u.offsets[0][0], param_dtype) for name, u in units.items()}
    layers = {k: v for k, v in unsharded.items() if k != ROOT and not units[k].trainable}
    if not layers:  # full fine-tuning: the decoder layers are the trainable units (LoRA's are its adapter leaves)
        layers = {k: v for k, v in unsharded.items() if k != ROOT}
    if reshard_after_forward:
        gathered = [ROOT] if ROOT in unsharded else []
        if layers:
            gathered.append(max(sorted(layers), key=lambda u: layers[u]))
    else:  # SHARD_GRAD_OP: no unit reshards after forward, all are gathered when backward begins
        gathered = sorted(unsharded)
    if world == 1:  # FSDP1 runs NO_SHARD on one rank (and for ``shard.options.no_shard``): each flat parameter
        # computes in place, nothing is gathered; only a MixedPrecision copy in another dtype is made (_mp_shard)
        gathered = [u for u in gathered if unsharded[u] != units[u].numel * units[u].itemsize]
    held = sum(unsharded[u] for u in gathered)
    for rs in ranks:
        rs.gathered = held
    notes = [
        f"{world} ranks, {len(units)} flat parameters ({sum(u.trainable for u in units.values())} trainable); "
        "use_orig_params" + ("" if use_orig_params else " off")
    ]
    return Fsdp1Plan(world, reshard_after_forward, ranks, units, unsharded, gathered, notes, param_dtype)


# -- QLoRA under FSDP2 ---------------------------------------------------------------------------------


def qlora_shardable(quant_storage: str | None, float_dtype: str | None) -> str | None:
    """None when FSDP can shard the 4-bit weights, else the reason (one line).

    FSDP flattens and all-gathers a unit's parameters together; the packed 4-bit weights can only join
    them when bitsandbytes stores them in the same float dtype (``bnb_4bit_quant_storage``) as the other
    parameters, which is how transformers' and PEFT's FSDP-QLoRA recipes configure it.
    """
    storage = dtypes.canonical(quant_storage) if quant_storage else None
    want = dtypes.canonical(float_dtype) if float_dtype else None
    if storage is None:
        return (
            "QLoRA under FSDP (1 or 2) needs base_model.quantization.storage_dtype (bnb_4bit_quant_storage) set to "
            f"the float dtype{' ' + want if want else ''}"
        )
    if want is not None and storage != want:
        return (
            f"QLoRA under FSDP (1 or 2) needs bnb_4bit_quant_storage = {want} (the loaded float dtype), not {storage}: "
            "FSDP cannot shard packed 4-bit weights stored in another dtype together with the float "
            "parameters"
        )
    return None


def packed_4bit_shape(numel: int, storage_dtype: str) -> tuple[int, int]:
    """Shape of a bitsandbytes 4-bit weight: ``((numel + 1) // (2 * itemsize), 1)`` in the storage dtype."""
    size = dtypes.itemsize(storage_dtype)
    if size is None:
        raise ValueError(f"unknown storage dtype {storage_dtype!r}")
    return ((numel + 1) // (2 * size), 1)


# -- ZeRO (DeepSpeed) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroState:
    stage: int
    offload: bool
    parameters: int  # device bytes of parameters (frozen + trainable)
    gradients: int
    optimizer: int
    host: int  # bytes moved to the host by offload
    #: offload only (DeepSpeed 0.19.8's copies, :func:`zero_offload_traffic`): device -> host per optimizer step
    to_host: int = 0
    #: offload only: host -> device per optimizer step (gradients brought back to accumulate, updated parameters)
    to_device_per_step: int = 0
    #: ZeRO-3 with offload_param: host -> device per micro-step at most, every partition fetched before its
    #: all-gather (forward, backward, and the recompute under gradient checkpointing)
    to_device_per_micro_step: int = 0
    #: the fp32 master partition of the trainable parameters, part of ``optimizer`` (or of ``host`` with offload)
    master: int = 0

    @property
    def device_total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def zero(
    stage: int,
    world: int,
    frozen_bytes: int,
    trainable_bytes: int,
    gradient_bytes: int,
    optimizer_bytes: int,
    offload: bool = False,
    replicated_bytes: int = 0,
    master_bytes: int = 0,
    accumulation: int = 1,
    recompute: bool = False,
    persistent_frozen: int = 0,
    persistent_trainable: int = 0,
) -> ZeroState:
    """Per-rank model state of ZeRO stage 1/2/3 (``ceil(bytes / world)`` per partitioned component).

    Stage 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters (frozen and
    trainable). ``offload`` = ``offload_optimizer`` (the optimizer state and, from stage 2 on, the
    partitioned gradients go to the host) plus, for stage 3, ``offload_param``. ``replicated_bytes`` (buffers,
    quantization constants) stay whole on every rank's device. With offload, ``master_bytes`` (the trainable
    parameters in fp32), ``accumulation`` (micro-steps per optimizer step) and ``recompute`` (gradient
    checkpointing) give what moves each step (:func:`zero_offload_traffic`). ``master_bytes`` is also held: DeepSpeed
    keeps an fp32 copy of the rank's partition of the trainable parameters, whatever their dtype (stage 1/2:
    ``single_partition_of_fp32_groups``, stage 3: ``fp32_partitioned_groups_flat``), and its optimizer steps it:
    ``optimizer_bytes`` is then the state of fp32 parameters; the master partition is part of ``optimizer`` (of
    ``host`` with offload).
    ``persistent_frozen``/``persistent_trainable``: ZeRO-3's persistent parameters, the bytes (part of
    ``frozen_bytes``/``trainable_bytes``) of those of at most ``stage3_param_persistence_threshold`` elements:
    once gathered they are not released through the micro-steps, whole on every rank's device beside their
    partitions (DeepSpeed 0.19.8 ``parameter_offload.py`` ``mark_persistent_parameters``, ``ds_persist``). Their
    partitions are where the others' are: the parameters are partitioned before they are marked
    (``_convert_to_zero_parameters`` runs first, and ``Init.apply_param_persistence`` stays False:
    ``_update_persist_config`` has no caller), so under ``offload_param`` on the host; the whole copies are released
    with the rest at the optimizer step (``_partition_all_parameters``) and gathered again in the next forward.
    """
    if stage not in (1, 2, 3):
        raise ValueError("ZeRO stage must be 1, 2 or 3")

    def part(n: int) -> int:
        return ceil(n / world)

    persistent = persistent_frozen + persistent_trainable if stage == 3 else 0
    params = frozen_bytes + trainable_bytes if stage < 3 else part(frozen_bytes) + part(trainable_bytes) + persistent
    grads = gradient_bytes if stage == 1 else part(gradient_bytes)
    master = part(master_bytes) if master_bytes else 0
    opt = part(optimizer_bytes) + master
    host = 0
    moves: dict[str, int] = {}
    if offload:
        moves = zero_offload_traffic(
            stage,
            part(gradient_bytes),
            part(master_bytes),
            part(frozen_bytes) + part(trainable_bytes),
            accumulation,
            recompute,
        )
        host += opt
        opt = 0
        if stage >= 2:
            host += grads
            grads = 0
        if stage == 3:  # every partition goes to the host; the persistent parameters' whole copies stay on the device
            host += params - persistent
            params = persistent
    return ZeroState(stage, offload, params + replicated_bytes, grads, opt, host, **moves, master=master)


def with_zero_reference(z: ZeroState, world: int, frozen_bytes: int, replicated_bytes: int) -> ZeroState:
    """``z`` beside DPO/KTO's separate reference model as TRL's ``prepare_deepspeed`` holds it (trl/models/utils.py
    246-289, TRL 1.16): under ZeRO-3 loaded partitioned (``zero.Init``) and kept so by an engine of its own (on the
    host with ``offload_param``, which TRL keeps), under ZeRO-1/2 with ZeRO off (stage 0): whole on every rank.
    ``frozen_bytes``: the base's parameters; ``replicated_bytes``: its buffers (whole on every rank)."""
    if z.stage < 3:
        return replace(z, parameters=z.parameters + frozen_bytes + replicated_bytes)
    if z.offload:
        return replace(z, parameters=z.parameters + replicated_bytes, host=z.host + ceil(frozen_bytes / world))
    return replace(z, parameters=z.parameters + ceil(frozen_bytes / world) + replicated_bytes)


def zero_offload_traffic(
    stage: int, grads: int, master: int, params: int, accumulation: int, recompute: bool
) -> dict[str, int]:
    """What DeepSpeed 0.19.8 copies between host and device per optimizer step of ``accumulation`` micro-steps
    under ZeRO-Offload, for one rank: ``grads`` its gradient partition in the gradients' dtype (DeepSpeed's
    ``grad_accum_dtype``, by default the model's), ``master`` the same partition in fp32, ``params`` its parameter
    partitions (ZeRO-3 with ``offload_param``).

    ZeRO-1/2 (``stage_1_and_2.py``): with accumulation, every micro-step copies the rank's gradients to the host and,
    from the second on, brings the accumulated ones back to add to (``async_accumulate_grad_in_cpu_via_gpu``,
    1809-1856: whole parameters of the partition, counted here as the partition); the last micro-step copies the
    partition into the fp32 gradient on the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``, 1887-1897);
    after the step the updated partition goes back to the device in the parameters' dtype, then is all-gathered.
    ZeRO-3 (``stage3.py`` ``partition_grads``): every micro-step copies the reduced partition to the host and back
    to the device to accumulate (2025-2036), the last one also into the fp32 gradient (1457); with
    ``offload_param`` the update stays on the host and every non-persistent partition is fetched to the device
    before its all-gather: once in forward, again in backward when it was released (``stage3_max_reuse_distance``
    may keep it; an upper bound), once more for the recompute under gradient checkpointing.
    """
    k = max(1, accumulation)
    if stage == 3:
        fetches = 3 if recompute else 2
        return {
            "to_host": k * grads + master,
            "to_device_per_step": k * grads,
            "to_device_per_micro_step": fetches * params,
        }
    to_host = (k * grads if k > 1 else 0) + master
    return {"to_host": to_host, "to_device_per_step": (k - 1) * grads + grads}


def totals(params: list[ParamDesc], optimizer: str = "adamw_torch") -> dict[str, int]:
    """Unsharded totals (one device): frozen parameters, replicated buffers, trainable, gradients, optimizer."""
    spec = optimizer_spec(optimizer)
    if spec is None:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    train = [p for p in params if p.trainable and p.kind == "param"]
    trainable = sum(p.nbytes for p in train)
    state = state_bytes(spec, [TensorShape(p.shape, p.itemsize) for p in train])
    return {
        "frozen": sum(p.nbytes for p in params if not p.trainable and p.kind == "param"),
        "replicated": sum(p.nbytes for p in params if p.kind == "buffer"),
        "trainable": trainable,
        "gradients": trainable,
        "optimizer": state.device,
    }
