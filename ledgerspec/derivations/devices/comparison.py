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

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.derivations.devices.catalogue import Catalogue, Device, usable_note
from ledgerspec.derivations.estimate.fitmodel import BatchModel
from ledgerspec.derivations.estimate.search import EstimateFn, batch_model, padded
from ledgerspec.errors import LedgerspecError

COUNTS = (1, 2, 4, 8)
EXTENSION = "x-devices"


@dataclass
class Row:
    device: Device
    gpus: int
    peak: int | None  # predicted peak of one GPU (the worst rank) at the declared microbatch
    fits: bool | None
    headroom: int | None
    largest_microbatch: int | None
    note: str = ""

    def to_extension(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.device.name,
            "gpus": self.gpus,
            "vendor_memory": self.device.vendor_memory,
            "total": self.device.total,
            "memory": self.device.usable,
            "peak": self.peak,
            "fits": self.fits,
            "headroom": self.headroom,
            "largest_microbatch": self.largest_microbatch,
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
            "usable_memory": usable_note(self.catalogue),
            "rows": [r.to_extension() for r in self.rows],
            "notes": list(self.notes),
            "catalogue": self.catalogue.files,
        }


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
) -> Comparison:
    """Every device of ``catalogue`` for every GPU count the declared sharding supports.

    ``per_rank(world) -> worst rank's peak at the declared microbatch`` simulates FSDP2 (None: the real one)."""
    from ledgerspec.contract import config

    declared = config.read(doc).workload.microbatch or 1
    pads = padded(doc)
    model = batch_model(doc, _design(declared, pads), estimate_fn)
    single = model.peak(declared)
    per_row = model.slope()
    sharding = (doc.get("memory_options", "sharding").text() or "none").lower()
    notes: list[str] = []
    peaks: dict[int, int] = {1: single}
    wanted = [n for n in counts if n >= 1]
    if sharding in ("fsdp1", "fsdp2"):
        rank_peak = per_rank or (lambda world: _fsdp2_worst(doc, world))
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
            f"memory_options.sharding {sharding}: not simulated here (`ledgerspec shard` calculates the ZeRO model "
            "state per rank); one GPU shown"
        )
    rows: list[Row] = []
    for device in catalogue.devices:
        for n in sorted(peaks):
            peak = peaks[n]
            fits = peak <= device.usable
            rows.append(
                Row(
                    device,
                    n,
                    peak,
                    fits,
                    device.usable - peak,
                    _largest(model, n, peak, single, per_row, declared, device.usable),
                )
            )
    return Comparison(rows, declared, sharding, notes, catalogue, sorted(s.microbatch for s in model.samples))


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


def _fsdp2_worst(doc: Document, world: int) -> int:
    """The worst rank's predicted peak on ``world`` FSDP2 (or FSDP1) ranks (a simulated step per distinct rank
    layout)."""
    from ledgerspec.derivations.shard.fsdp.simulate import estimate_per_rank
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import check_qlora

    check_qlora(doc, rule="devices")
    descs = document_descriptors(doc)
    return estimate_per_rank(doc, world, descs).worst


__all__ = ["COUNTS", "EXTENSION", "Comparison", "Row", "compare"]
