"""Which device: the estimate against a catalogue of accelerators and GPU counts (``estimate --devices``).

The catalogue (:mod:`.catalogue`: ``devices.yaml``, and a user file of the same shape that adds or replaces devices
by name) gives each accelerator's memory as the vendor states it and as PyTorch reports it, and what a training
process cannot give to tensors (the CUDA context, the cuBLAS workspace): the predicted peak is compared with
``usable = total - reserve``. For each device and GPU count the answer is: fits or not, the headroom, and the
largest microbatch that fits (from :class:`~ledgerspec.derivations.estimate.fitmodel.BatchModel`, so the whole
table costs two or three traced estimates, plus one simulated FSDP2 step per GPU count when the ledger declares
``memory_options.sharding: fsdp2``).

GPU counts follow the declared sharding: with none (data parallel) every GPU holds the whole model and its own
microbatch, so more GPUs do not lower the peak of one (the table says so once instead of repeating rows); with
``fsdp2`` each count's worst rank comes from :func:`ledgerspec.derivations.shard.fsdp.simulate.estimate_per_rank`, and
its other microbatches from the same bytes per row as one GPU (activations are per rank and do not shard).
ZeRO stages are calculated by ``ledgerspec shard`` (model state only) and are not simulated here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.devices.catalogue import Catalogue, Device, usable_note
from ledgerspec.derivations.estimate.fitmodel import BatchModel
from ledgerspec.derivations.estimate.search import EstimateFn, batch_model, padded
from ledgerspec.errors import LedgerspecError

COUNTS = (1, 2, 4, 8)
#: what a ZeRO row's device verdict takes for DeepSpeed's streams (zero.simulate.ONE_STREAM, in the table's words)
ONE_STREAM_NOTE = (
    "each rank's allocations replayed on one stream (DeepSpeed's side streams would keep pools of their own on a GPU)"
)
EXTENSION = "x-devices"
#: how a ``--devices`` table decided on the device reads (issue 23): what "usable" is there, and the largest microbatch
ON_DEVICE_NOTE = (
    "decided on the device: usable = what the caching allocator can get there (the device's CUDA total, what "
    "cudaMemGetInfo reports, below nvidia-smi's total, less what lies outside the allocator: the CUDA context and "
    "modules, NCCL's buffers); fits and headroom at the declared microbatch: the step's allocation stream replayed "
    "through the caching-allocator model against it, headroom = CUDA total - device peak; the largest microbatch is "
    "at most (<=) the largest whose allocated tensors and cuBLAS workspaces fit the usable memory (the allocator holds "
    "at least those; fragmentation may leave less: `estimate --fit microbatch --device-memory SIZE` checks it on the "
    "device)"
)


@dataclass
class Row:
    device: Device
    gpus: int
    peak: int | None  # predicted peak of one GPU (the worst rank) at the declared microbatch
    fits: bool | None
    headroom: int | None
    largest_microbatch: int | None
    note: str = ""
    #: decided on the device (``on_device``): the worst rank's device-level peak (the allocator model's reserved
    #: bytes + what lies outside the allocator on that device), then ``fits``/``headroom`` are that verdict's
    device_peak: int | None = None
    decided_by: str | None = None
    #: at the edge, so ``fits`` is false: it completes with the outside-allocator catalogue's typical figure, not with
    #: its high one (:attr:`~ledgerspec.derivations.devices.prediction.DevicePrediction.uncertain`)
    uncertain: bool = False
    #: decided by fragmentation: the reserved bytes free but in blocks that could not serve the request that failed
    fragmentation: int | None = None
    #: decided on the device: what the caching allocator can get there (the device's CUDA total less what lies outside
    #: the allocator), the memory the row's figures are judged against; None: the catalogue's usable memory
    usable: int | None = None
    #: decided on the device: ``largest_microbatch`` is an upper bound, the largest whose allocated tensors (and the
    #: cuBLAS workspaces) fit what the allocator can get; the allocator holds at least those, so no larger one fits,
    #: and fragmentation may leave a smaller one (``estimate --fit microbatch`` checks it on the device)
    largest_at_most: bool = False

    @property
    def memory(self) -> int:
        """The memory the row is judged against: :attr:`usable` on the device, else the catalogue's usable memory."""
        return self.usable if self.usable is not None else self.device.usable

    def to_extension(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.device.name,
            "gpus": self.gpus,
            "vendor_memory": self.device.vendor_memory,
            "total": self.device.total,
            "capacity": self.device.capacity,
            "memory": self.memory,
            "peak": self.peak,
            "fits": self.fits,
            "headroom": self.headroom,
            "largest_microbatch": self.largest_microbatch,
            "largest_at_most": self.largest_at_most or None,
            "device_peak": self.device_peak,
            "decided_by": self.decided_by,
            "uncertain": self.uncertain or None,
            "fragmentation": self.fragmentation if self.decided_by == "fragmentation" else None,
        }
        if self.note:
            out["note"] = self.note
        return {k: v for k, v in out.items() if v is not None}


@dataclass
class Comparison:
    rows: list[Row]
    microbatch: int
    sharding: str
    notes: list[str] = field(default_factory=list)
    catalogue: Catalogue | None = None
    traced: list[int] = field(default_factory=list)

    def to_extension(self) -> dict[str, Any]:
        assert self.catalogue is not None
        return {
            "source": "CALCULATED",
            "microbatch": self.microbatch,
            "sharding": self.sharding,
            "usable_memory": ON_DEVICE_NOTE
            if any(r.usable is not None for r in self.rows)
            else usable_note(self.catalogue),
            "rows": [r.to_extension() for r in self.rows],
            "notes": list(self.notes),
            "catalogue": self.catalogue.files,
        }


#: bump when the cached form of a comparison changes (2: rows say whether the verdict is uncertain; 3: a row at the
#: edge does not fit; 4: DeepSpeed ZeRO's GPU counts simulated, where one GPU was shown; 5: a row decided by
#: fragmentation keeps how much; 6: the replays add the cuBLAS workspaces; 7: a row decided on the device is judged
#: against what the allocator can get there, and its largest microbatch is an upper bound against that)
FORMAT = 7


def cached_compare(
    doc: Document,
    catalogue: Catalogue,
    store: Any,
    question: dict[str, Any],
    compute: Any,
) -> Comparison:
    """``compute()`` (a :class:`Comparison` of ``doc`` against ``catalogue``), or its answer from the estimate cache
    ``store`` (:mod:`ledgerspec.derivations.estimate.cache`) under a key that holds the estimate's inputs, the
    ``question`` (target, layers, whether decided on the device) and every figure of the catalogue's devices: a
    repeated ``--devices`` costs no trace (its device verdicts come from streams that are not cached themselves)."""
    from dataclasses import asdict

    from ledgerspec.derivations.estimate.cache import cached

    devices = [asdict(d) for d in catalogue.devices]
    from ledgerspec.derivations.devices import outside

    # the cuBLAS workspaces' sizes come from the outside catalogue (a YAML file, which the code digest does not cover)
    workspaces = outside.load().cublas
    full_question = {**question, "devices": {"format": FORMAT, "catalogue": devices, "cublas": workspaces}}
    by_name = {d.name: d for d in catalogue.devices}

    def encode(c: Comparison) -> dict[str, Any]:
        rows = [{**asdict(r), "device": r.device.name} for r in c.rows]
        return {"rows": rows, "microbatch": c.microbatch, "sharding": c.sharding, "notes": c.notes, "traced": c.traced}

    def decode(data: dict[str, Any], seconds: float) -> Comparison:
        rows = [Row(**{**r, "device": by_name[r["device"]]}) for r in data["rows"]]
        return Comparison(rows, data["microbatch"], data["sharding"], list(data["notes"]), catalogue, data["traced"])

    result: Comparison = cached(store, doc, full_question, compute, encode, decode)
    return result


def _design(declared: int, pads: bool) -> list[int]:
    """Microbatches to trace: the declared one and another of its regime (and two padded ones for a declared 1)."""
    if pads and declared == 1:
        return [1, 2, 4]
    return [declared, 2 * declared]


def compare(
    doc: Document,
    catalogue: Catalogue,
    estimate_fn: EstimateFn,
    counts: Sequence[int] = COUNTS,
    per_rank: Any = None,
    on_device: bool = False,
    single_step: Any = None,
) -> Comparison:
    """Every device of ``catalogue`` for every GPU count the declared sharding supports.

    ``per_rank(world) -> worst rank's peak at the declared microbatch`` simulates the sharded ranks (None: the
    real simulation: FSDP2, FSDP1, or DeepSpeed's own engine for ZeRO).
    ``on_device`` (issue 23): each device's verdict at the declared microbatch is decided on the device: the step's
    allocation stream at full depth (per simulated rank for a sharded count) replayed through the caching-allocator
    model against what that device's allocator can get (its total minus what lies outside the allocator there:
    :func:`ledgerspec.derivations.devices.target.outside_of`), as ``estimate`` decides for one device; the usable
    memory is then what the allocator can get there, and the largest microbatch an upper bound against it (the
    allocated tensors and the cuBLAS workspaces; :attr:`Row.largest_at_most`). ``single_step() -> (estimate,
    StepEvents)``: one GPU's estimate and stream (default: the stream traced here, no estimate; the command passes
    :func:`ledgerspec.derivations.devices.prediction.step_and_estimate`'s, which leaves the declared microbatch's
    estimate in the cache for the microbatch model), called before the microbatch model traces."""
    from ledgerspec.contract import config

    declared = config.read(doc).workload.microbatch or 1
    steps: dict[int, list[Any]] = {}
    #: id of a step -> its estimate's optimizer state (a paged optimizer's, for the catalogue's high end)
    states: dict[int, int | None] = {}
    if on_device:
        from ledgerspec.derivations.allocator.step import full_depth_events

        if single_step is not None:
            one, step = single_step()
            states[id(step)] = one.components.get("optimizer")
        else:
            step = full_depth_events(doc, "cuda")
        steps[1] = [step]
    pads = padded(doc)
    model = batch_model(doc, _design(declared, pads), estimate_fn)
    single = model.peak(declared)
    per_row = model.slope()
    sharding = _sharding(doc)
    notes: list[str] = []
    peaks: dict[int, int] = {1: single}
    wanted = [n for n in counts if n >= 1]
    from ledgerspec.derivations.shard.options import zero_stage

    if sharding in ("fsdp1", "fsdp2") or zero_stage(doc) is not None:
        if zero_stage(doc) is not None and on_device:
            notes.append(f"{sharding}: {ONE_STREAM_NOTE}")
        simulated: dict[int, Any] = {}

        def sharded(world: int) -> int:
            from ledgerspec.derivations.shard.options import no_shard

            if not on_device:
                return _sharded_worst(doc, world)
            ranks = 1 if no_shard(doc, world) else world  # NO_SHARD: one simulation for every GPU count
            if ranks not in simulated:
                simulated[ranks] = _sharded_estimate(doc, world, streams=True)
            est = simulated[ranks]
            steps[world] = list({id(r.step): r.step for r in est.ranks}.values())
            states.update((id(r.step), r.components.get("optimizer")) for r in est.ranks)
            return int(est.worst)

        rank_peak = per_rank or sharded
        for n in wanted:
            if n > 1:
                try:
                    peaks[n] = rank_peak(n)
                except LedgerspecError as exc:
                    notes.append(f"{n} GPUs: not simulated ({exc.message})")
        notes.append(
            f"{sharding}: each GPU count's worst rank simulated at the declared microbatch; other microbatches add the "
            "same bytes per row as one GPU (activations do not shard)"
        )
    elif sharding in ("none", "ddp"):
        notes.append(
            "memory_options.sharding is none (data parallel): every GPU holds the whole model and its own "
            "microbatch, so more GPUs do not lower the peak of one; declare fsdp2 to shard the model"
        )
    else:
        notes.append(
            f"memory_options.sharding {sharding}: not simulated here (`ledgerspec shard` calculates the model state "
            "per rank); one GPU shown"
        )
    rows: list[Row] = []
    verdict = _on_device(doc, steps, states) if on_device else None
    for device in catalogue.devices:
        for n in sorted(peaks):
            peak = peaks[n]
            row = Row(
                device,
                n,
                peak,
                peak <= device.usable,
                device.usable - peak,
                _largest(model, n, peak, single, per_row, declared, device.usable),
            )
            if verdict is not None and n in steps:
                v = verdict(device, n)
                row.fits, row.headroom, row.device_peak = v.fits, v.headroom, v.device_peak
                row.decided_by, row.uncertain, row.fragmentation = v.decided_by, v.uncertain, v.fragmentation
                row.usable, row.largest_at_most = v.can_get, True
                row.largest_microbatch = _largest(model, n, peak, single, per_row, declared, v.can_get - v.workspaces)
            rows.append(row)
    if verdict is not None:
        notes.append(ON_DEVICE_NOTE)
    return Comparison(rows, declared, sharding, notes, catalogue, sorted(s.microbatch for s in model.samples))


@dataclass(frozen=True)
class DeviceVerdict:
    """One row's verdict on the device: the worst rank's, as :class:`Row` shows it."""

    fits: bool
    headroom: int  # the device's CUDA total less the device-level peak (the margin)
    device_peak: int
    decided_by: str
    uncertain: bool  # at the edge
    fragmentation: int | None  # decided by fragmentation: the reserved bytes free in blocks that could not serve
    can_get: int  # the most any rank's allocator can get on that device
    workspaces: int  # the cuBLAS workspaces' bytes the replay added


def _on_device(
    doc: Document, steps: dict[int, list[Any]], states: dict[int, int | None] | None = None
) -> Callable[[Device, int], DeviceVerdict]:
    """``verdict(device, gpus) ->`` :class:`DeviceVerdict` for the worst rank of
    ``gpus``, each distinct stream replayed without a limit once and against a device only when its peak passes that
    device's capacity (a replay against a capacity takes the same decisions until then). ``states``: each stream's
    optimizer state from its estimate (a paged optimizer's for the catalogue's high end: the rank's own share, not
    the ledger's ``ledger.optimizer``, which an intake lacks; None: the ledger's)."""
    from ledgerspec.derivations.devices.prediction import DevicePrediction, free_replay, replay_on_device, workspaces_of
    from ledgerspec.derivations.devices.target import Target, high_of, outside_of, stated

    conf = (doc.get("software", "pytorch_cuda_alloc_conf").text() or "").strip()
    # each step's replay without a limit, once per set of cuBLAS workspaces (they differ by GPU architecture)
    free: dict[tuple[int, Any], Any] = {}

    def free_of(step: Any, workspaces: Any) -> Any:
        key = (id(step), workspaces)
        if key not in free:
            free[key] = free_replay(doc, step, conf, workspaces=workspaces)
        return free[key]

    def verdict(device: Device, gpus: int) -> DeviceVerdict:
        target = Target(device.total, device.name, "catalogue", "the device catalogue's entry", device.capacity)
        figure = outside_of(doc, target, gpus)
        workspaces = workspaces_of(doc, target)
        worst: DevicePrediction | None = None
        most = 0
        for step in steps[gpus]:
            mine = stated(doc, target, figure, (states or {}).get(id(step)), gpus)
            replayed = replay_on_device(
                doc,
                step,
                device.total,
                mine.bytes,
                conf,
                free=free_of(step, workspaces),
                tries=False,
                cuda_total=device.capacity,
                outside_high=high_of(mine),
                workspaces=workspaces,
            )
            p = DevicePrediction(target, mine, replayed)
            most = max(most, replayed.capacity)
            if worst is None or (p.fits, p.completes, p.margin) < (worst.fits, worst.completes, worst.margin):
                worst = p
        assert worst is not None
        frag = worst.fragmentation if worst.decided_by == "fragmentation" else None
        # the most any rank's allocator can get (ranks differ in what lies outside it: a paged optimizer's share), so
        # that the largest microbatch against it stays an upper bound for the rank whose peak the row shows
        return DeviceVerdict(
            worst.fits,
            worst.margin,
            worst.device_peak,
            worst.decided_by,
            worst.uncertain,
            frag,
            most,
            worst.replayed.workspaces,
        )

    return verdict


def _largest(
    model: BatchModel, gpus: int, peak: int, single: int, per_row: Fraction | None, declared: int, usable: int
) -> int | None:
    """The largest microbatch that fits ``usable`` on one GPU of ``gpus``: the model itself for one GPU; for
    sharded counts, that GPU's simulated peak shifted by the single-GPU bytes per row."""
    if gpus == 1:
        return model.largest_fitting(usable)
    if per_row is None or per_row <= 0:
        return None
    offset = peak - single  # what sharding saves (or costs) at every microbatch
    best = model.largest_fitting(usable - offset)
    return best


def _sharding(doc: Document) -> str:
    """The declared sharding in the table's words, read as the other commands read it
    (:func:`~ledgerspec.contract.config.declared_strategy`: an FSDP1 name: fsdp1; fsdp: fsdp2; a ZeRO stage; anything
    else as written), else none."""
    from ledgerspec.contract.config import FSDP1_NAMES, declared_strategy

    declared = declared_strategy(doc)
    if declared in FSDP1_NAMES:
        return "fsdp1"
    if declared == "fsdp":
        return "fsdp2"
    return declared or "none"


def _sharded_worst(doc: Document, world: int) -> int:
    """The worst rank's predicted peak on ``world`` FSDP2, FSDP1 or DeepSpeed ZeRO ranks (a simulated step per
    distinct rank layout)."""
    return int(_sharded_estimate(doc, world).worst)


def _sharded_estimate(doc: Document, world: int, streams: bool = False) -> Any:
    """The per-rank estimate on ``world`` FSDP2, FSDP1 or DeepSpeed ZeRO ranks (``streams``: with each rank's
    allocation stream)."""
    from ledgerspec.derivations.shard.fsdp.simulate import estimate_per_rank
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import check_qlora, no_shard, zero_stage

    if zero_stage(doc) is not None:  # DeepSpeed's own engine per rank (shard --estimate's)
        from ledgerspec.derivations.shard.zero import estimate_zero_per_rank

        return estimate_zero_per_rank(doc, world, streams=streams)
    check_qlora(doc, rule="devices")
    descs = document_descriptors(doc)
    # FSDP1's NO_SHARD: every rank holds what one rank of one holds (shard.options.no_shard)
    return estimate_per_rank(doc, 1 if no_shard(doc, world) else world, descs, streams=streams)


__all__ = ["COUNTS", "EXTENSION", "Comparison", "Row", "cached_compare", "compare"]
