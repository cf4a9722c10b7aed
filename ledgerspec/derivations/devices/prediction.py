"""What the device holds during the step, and whether the step fits it: the estimate's verdict on the device.

The estimate predicts the bytes PyTorch tensors hold, phase by phase, exactly. A device runs out of memory when the
caching allocator cannot get another segment: what it has *reserved* (tensors, the blocks it keeps cached, the parts
of split blocks no request fits) plus what lies *outside* it (the CUDA context and the kernel modules, NCCL's buffers)
reaches the device's total. :func:`estimate_on_device` answers both questions from one set of traces:

1. the step's allocation stream at full depth (:func:`ledgerspec.derivations.allocator.step.full_depth_from`: the
   estimate's two probes plus a third, built event by event; its probes give the plain estimate's figures unchanged);
2. what lies outside the allocator on the target device (:func:`.target.outside_of`): the ledger's
   ``outside_allocator.total`` when it holds one (MEASURED by ``measure --device cuda``, or declared), else the
   catalogue (``outside.yaml``) for the device's architecture, the device named by :func:`.target.target_of`;
3. the stream replayed through the allocator model (:mod:`ledgerspec.derivations.allocator.replay`, the ledger's
   ``software.pytorch_cuda_alloc_conf`` or PyTorch's defaults) twice: without a limit, for the reserved bytes per
   phase, and against the capacity the allocator can get (the device's total minus what lies outside), for the
   verdict (the device's total is CUDA's own, ``cudaMemGetInfo``'s, when the declared memory is a named catalogue
   card's nominal one: :func:`.target.cuda_total_of`; the allocator can never hold more): it **completes** when that
   replay ends without an out-of-memory, the allocator's free-and-retry path included. When the tensors alone fit but
   the replay runs out (fragmentation decides), the replay is run again with ``expandable_segments:True`` and with
   ``max_split_size_mb`` values (:data:`SPLIT_TRIES`), and the one that makes it fit by the most is named.
4. when the bytes outside the allocator are the catalogue's (a range, not a figure the ledger holds) and the replay
   completes, once more against the device's total minus the high end of that range: the step **fits** only when
   that replay completes too. One that completes only with the typical figure is **at the edge** and does not fit
   (:attr:`DevicePrediction.uncertain`, ``decided_by: outside``): its margin is inside the catalogue's own
   uncertainty, so "fits" would be a coin's toss; both published runs in that place ran out of memory
   (``benchmarks/results/device-fsdp.md``, ``device-gptq.md``), and no published run that trained was there.

The device-level peak is the peak reserved plus the bytes outside the allocator (the whole step long: modules loaded
during the step are counted from the first phase on, an upper bound for the early phases). ``completes`` holds
exactly when that peak is at most the device's (CUDA) total: a replay against the capacity takes the same decisions
as the one without a limit until a ``cudaMalloc`` would pass the capacity, so a replay that runs out reserves more
than the capacity without a limit, and one that completes never reserves more than the capacity.

Nothing here was measured on a GPU: the allocator model follows PyTorch 2.13's source and is checked against recorded
streams; the bytes outside the allocator are an ASSUMPTION unless the ledger holds a measured figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.contract.fields import AT_THE_EDGE, EDGE_WHY
from ledgerspec.contract.units import format_size
from ledgerspec.derivations.devices import outside
from ledgerspec.derivations.devices.target import (
    Target,
    high_of,
    outside_of,
    stated,
    target_of,
)

MiB = 2**20
#: ``max_split_size_mb`` values a fragmentation-decided verdict tries (each one replay of the stream)
SPLIT_TRIES = (20, 64, 128, 256, 512)
EXPANDABLE = "expandable_segments:True"
#: bump when the cached form of a device prediction changes (4: a setting tried is checked at the range's high end;
#: 5: an out-of-memory keeps the reserve's peak before it; 6: a step at the edge tries the settings at the high end;
#: 7: the replay adds the cuBLAS workspaces)
FORMAT = 7
#: the cuBLAS workspaces of the Python thread's handle and of the autograd thread's, bytes each
Workspaces = tuple[tuple[int, ...], tuple[int, ...]]

_err = ErrorAt("estimate")


# -- the prediction ------------------------------------------------------------------------------------------------


@dataclass
class PhaseDevice:
    """One protocol phase on the device (held bytes for ``after_*``, else the peak during the phase)."""

    allocated: int  # as the estimate counts: each live request rounded up to 512 B
    allocator_allocated: int  # as ``torch.cuda.memory_allocated`` counts: whole blocks
    reserved: int  # the allocator's segments
    device: int  # reserved + outside the allocator


@dataclass
class Tried:
    """The replay against the capacity again, with one allocator setting more."""

    setting: str  # added to the ledger's PYTORCH_CUDA_ALLOC_CONF
    conf: str  # the whole setting replayed
    fits: bool
    peak_reserved: int  # on the device: the replay's peak (up to its out-of-memory when it runs out)
    margin: int  # fits: capacity - peak reserved; else minus what the failing allocation lacked
    oom_phase: str | None = None
    #: it completes against the capacity, not against the one beside the high end of the outside-allocator
    #: catalogue's range: at the edge, so this setting does not make it fit (never named as the setting to set)
    edge: bool = False
    #: replayed against what the allocator can get beside the high end of that range (the step itself is at the edge:
    #: it completes only with the typical figure); ``fits``: it completes there too, ``margin`` is against that
    at_high: bool = False


@dataclass
class DeviceOOM:
    """The first out-of-memory of the replay against the capacity, after the allocator's free-and-retry."""

    phase: str  # the protocol phase (``backward_peak``)
    requested: int  # bytes the tensor asked for
    alloc_size: int  # bytes the allocator asked cudaMalloc for
    allocated: int  # held by tensors then (whole blocks)
    reserved: int  # reserved then, after releasing what it could
    fragmentation: int  # reserved - allocated then: free, but in blocks that could not serve the request
    short: int  # reserved + alloc_size - capacity: what the allocation lacked
    #: the highest reserve before it ran out (what ``torch.cuda.max_memory_reserved`` reads after the error): a run
    #: at the top of its card reserves up to where its cudaMalloc fails, whether or not the retry that follows serves
    #: the request (0: a cached prediction of a format before it)
    peak_reserved: int = 0


@dataclass
class Replayed:
    """What the replays found (the part of a :class:`DevicePrediction` the estimate cache keeps)."""

    total: int
    outside: int
    capacity: int
    alloc_conf: str
    phases: dict[str, PhaseDevice]
    fits: bool
    #: the peak reserved without a limit (the step's own; equal to the phases' when it fits without a retry)
    free_peak_reserved: int
    oom: DeviceOOM | None = None
    tried: list[Tried] = field(default_factory=list)
    stream: str = ""  # how the full-depth stream was obtained
    fallback: str | None = None  # why it was traced in full
    events: int = 0
    seconds: float = 0.0  # the third probe's share is in the estimate's time; this: building and replaying
    #: the device total replayed against (CUDA's, :func:`.target.cuda_total_of`); ``total`` is the memory asked about
    cuda_total: int = 0
    #: the high end of the outside-allocator catalogue's range for this rank (0: no range, a figure the ledger holds)
    outside_high: int = 0
    #: whether the replay also completes against ``cuda_total - outside_high`` (None: not asked, no range)
    high_fits: bool | None = None
    #: the cuBLAS workspaces the replay added to the stream, bytes in all (:func:`workspaces_of`)
    workspaces: int = 0

    def __post_init__(self) -> None:
        if self.cuda_total <= 0:
            self.cuda_total = self.total

    def to_cache(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_cache(cls, data: dict[str, Any]) -> Replayed:
        data = dict(data)
        data["phases"] = {k: PhaseDevice(**v) for k, v in data["phases"].items()}
        data["oom"] = DeviceOOM(**data["oom"]) if data.get("oom") else None
        data["tried"] = [Tried(**t) for t in data.get("tried") or []]
        return cls(**data)


@dataclass
class DevicePrediction:
    """The estimate's step on a device: per phase allocated, reserved and device-level bytes, and the verdict."""

    target: Target
    outside_figure: outside.Figure
    replayed: Replayed
    #: answered from the estimate cache (the seconds the replays took then)
    cached: bool = False
    #: the declared torch's allocator against the model's (torch 2.13's), in one phrase ("": the same version, or
    #: none declared): :func:`allocator_note`
    version_note: str = ""

    # -- figures
    @property
    def total(self) -> int:
        """The device memory asked about (declared, or ``--device-memory``)."""
        return self.replayed.total

    @property
    def cuda_total(self) -> int:
        """The device total the replay decided against: CUDA's own (:func:`.target.cuda_total_of`), ``total`` unless the
        declared memory is a catalogue device's nominal one."""
        return self.replayed.cuda_total

    @property
    def cuda_note(self) -> str:
        return self.target.cuda_note if self.target.cuda_total == self.cuda_total else ""

    @property
    def capacity(self) -> int:
        return self.replayed.capacity

    @property
    def outside(self) -> int:
        return self.replayed.outside

    @property
    def phases(self) -> dict[str, PhaseDevice]:
        return self.replayed.phases

    @property
    def completes(self) -> bool:
        """The replay against what the allocator can get beside the typical bytes outside it ends without an
        out-of-memory (the free-and-retry path included)."""
        return self.replayed.fits

    @property
    def fits(self) -> bool:
        """The verdict: it :attr:`completes`, and it is not at the edge (:attr:`uncertain`)."""
        return self.completes and not self.uncertain

    @property
    def oom(self) -> DeviceOOM | None:
        return self.replayed.oom

    @property
    def peak_allocated(self) -> int:
        return max(p.allocated for p in self.phases.values())

    @property
    def peak_allocator_allocated(self) -> int:
        return max(p.allocator_allocated for p in self.phases.values())

    @property
    def needed(self) -> int:
        """What the allocator must hold at least: the allocated peak and the cuBLAS workspaces the replay added."""
        return self.peak_allocated + self.replayed.workspaces

    def _needed_words(self) -> str:
        return f"the allocated peak {format_size(self.needed)}" + (
            " (the cuBLAS workspaces included)" if self.replayed.workspaces else ""
        )

    @property
    def peak_reserved(self) -> int:
        return max(p.reserved for p in self.phases.values())

    @property
    def device_peak(self) -> int:
        return self.peak_reserved + self.outside

    @property
    def margin(self) -> int:
        """The device's total (CUDA's, :attr:`cuda_total`) minus the device-level peak: negative when it does not
        fit."""
        return self.cuda_total - self.device_peak

    @property
    def fragmentation(self) -> int:
        """At the out-of-memory: the reserve that was free but could not serve the request; when it fits: the reserve
        above the allocated peak (peak reserved - peak allocated, whole blocks)."""
        if self.oom is not None:
            return self.oom.fragmentation
        return self.peak_reserved - self.peak_allocator_allocated

    @property
    def decided_by(self) -> str:
        """``fragmentation`` when the tensors alone fit the capacity but the replay runs out; ``allocated`` when the
        tensors alone do not; ``outside`` when it completes only with the typical bytes outside the allocator (at the
        edge: :attr:`uncertain`); ``none`` when it fits."""
        if self.fits:
            return "none"
        if self.completes:
            return "outside"
        return "fragmentation" if self.needed <= self.capacity else "allocated"

    @property
    def best_try(self) -> Tried | None:
        """The setting that makes it fit by the most (None: none tried does; one at the edge does not)."""
        fitting = [t for t in self.replayed.tried if t.fits and not t.edge]
        return max(fitting, key=lambda t: t.margin) if fitting else None

    @property
    def uncertain(self) -> bool:
        """At the edge: it completes with the outside-allocator catalogue's typical figure, but not with the high end
        of its range; the margin is inside the catalogue's own uncertainty (never for a figure the ledger holds), and
        the verdict is that it does not fit (:attr:`fits`)."""
        return self.completes and self.replayed.high_fits is False

    @property
    def outside_provenance(self) -> str:
        return self.outside_figure.source

    @property
    def device_provenance(self) -> str:
        """CALCULATED when the bytes outside the allocator are measured or calculated, else ASSUMPTION."""
        return "CALCULATED" if self.outside_provenance in ("MEASURED", "VERIFIED", "CALCULATED") else "ASSUMPTION"

    @property
    def oom_word(self) -> str | None:
        from ledgerspec.derivations.estimate.fit import OOM_PHASE

        return OOM_PHASE.get(self.oom.phase, self.oom.phase) if self.oom is not None else None

    # -- words
    def conf_text(self) -> str:
        conf = self.replayed.alloc_conf
        text = f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's defaults)"
        return f"{text}; {self.version_note}" if self.version_note else text

    def device_text(self) -> str:
        est = self.outside_figure.estimate
        arch = "" if est is None else " (architecture unknown)" if est.arch == "unknown" else f" ({est.arch})"
        return f"{self.target.name}{arch}" if self.target.name else f"an unnamed device{arch}"

    def outside_text(self) -> str:
        f = self.outside_figure
        if f.estimate is None:
            return f"{f.method}, as the ledger holds it"
        parts = " + ".join(
            f"{p.name} {format_size(p.typical)}" + (" (the ledger's)" if p.declared else "")
            for p in f.estimate.counted
            if p.typical or p.declared
        )
        vllm = f" + colocated vLLM's share {format_size(f.vllm)}" if f.vllm else ""
        elsewhere = f.elsewhere
        return (
            f"{self.device_text()}, named by {self.target.how}: {parts or 'nothing'} from the outside-allocator "
            f"catalogue, range {format_size(f.estimate.low)} to {format_size(f.estimate.high)}{vllm}"
            + (f" ({elsewhere})" if elsewhere else "")
        )

    def reserved_method(self) -> str:
        r = self.replayed
        how = (
            "the replay against the device"
            if self.completes
            else "the replay without a limit (the one against the device stopped at its out-of-memory)"
        )
        return (
            f"the step's allocation stream at full depth ({r.stream})"
            + (f" with the cuBLAS handles' workspaces ({format_size(r.workspaces)})" if r.workspaces else "")
            + f" replayed through ledgerspec's model of PyTorch 2.13's CUDA caching allocator, {self.conf_text()}; "
            f"per phase from {how}; a model, not a measurement"
        )

    def sentence(self) -> str:
        """The verdict in one line: which figure, the margin, the fragmentation."""
        dev = format_size(self.device_peak)
        total = format_size(self.cuda_total)
        note = f"; {self.cuda_note}" if self.cuda_note else ""
        split = f"reserved {format_size(self.peak_reserved)} + {format_size(self.outside)} outside the allocator"
        if self.uncertain:
            high = self.replayed.outside_high
            return (
                f"does NOT fit on the device, {AT_THE_EDGE}: {EDGE_WHY} (device peak {dev} of {total}, {split}, "
                f"margin {format_size(self.margin)}); with the high "
                f"end of the outside-allocator catalogue's range ({format_size(high)} outside instead of "
                f"{format_size(self.outside)}) the allocator model runs out of memory: the margin is inside the "
                f"catalogue's uncertainty; measure it (`ledgerspec measure --device cuda` writes outside_allocator) or "
                f"leave more headroom{self._edge_setting()}{note}"
            )
        if self.fits:
            return (
                f"fits on the device: device peak {dev} of {total} ({split}), margin {format_size(self.margin)}; "
                f"the allocator model's replay against the {format_size(self.capacity)} it can get completes{note}"
            )
        oom = self.oom
        assert oom is not None
        return (
            f"does NOT fit on the device: the allocator model runs out of memory in phase {self.oom_word} "
            f"({oom.phase}) asking for {format_size(oom.requested)} with {format_size(oom.reserved)} reserved of the "
            f"{format_size(self.capacity)} it can get, after freeing its cache; device peak without a limit {dev} of "
            f"{total} ({split}), {format_size(-self.margin)} over{note}"
        )

    def _edge_setting(self) -> str:
        """At the edge: the allocator setting with which the step completes with the high end of the range too."""
        best = self.best_try
        if best is None or not best.at_high:
            return ""
        return (
            f", or set PYTORCH_CUDA_ALLOC_CONF={best.conf}: with it the replay completes with the high end too "
            f"(peak reserved {format_size(best.peak_reserved)}, margin {format_size(best.margin)} there)"
        )

    def lines(self) -> list[str]:
        """What ``estimate`` prints under the verdict: the fragmentation, what decided it, what would change it."""
        out: list[str] = []
        if self.completes:
            out.append(
                f"reserve above the allocated peak: {format_size(self.fragmentation)} (peak reserved "
                f"{format_size(self.peak_reserved)} - peak allocated {format_size(self.peak_allocator_allocated)} "
                "in whole blocks, as the allocator counts it, a request served by a larger cached block counting that "
                "block: cached blocks and split remainders)"
            )
            if self.uncertain and self.replayed.tried:
                out.append(
                    "at the edge, and with the high end of the range fragmentation decides: "
                    f"{self._needed_words()} fits what the allocator can get there, its blocks do not"
                )
                for t in self.replayed.tried:
                    out.append(
                        f"with {t.setting}: completes with the high end too, peak reserved "
                        f"{format_size(t.peak_reserved)}, margin {format_size(t.margin)} there"
                        if t.fits
                        else f"with {t.setting}: still runs out with the high end, in phase {t.oom_phase}, lacking "
                        f"{format_size(-t.margin)}"
                    )
                best = self.best_try
                out.append(
                    f"set PYTORCH_CUDA_ALLOC_CONF={best.conf} (software.pytorch_cuda_alloc_conf) to fit with either "
                    "figure outside the allocator"
                    if best is not None
                    else "no allocator setting tried completes with the high end"
                )
        else:
            oom = self.oom
            assert oom is not None
            out.append(
                f"fragmentation at the out-of-memory: {format_size(oom.fragmentation)} of the "
                f"{format_size(oom.reserved)} reserved was free but in blocks that could not serve the request; it "
                f"lacked {format_size(oom.short)}"
                + (
                    f" (the reserve peaked at {format_size(oom.peak_reserved)} before it: what "
                    "torch.cuda.max_memory_reserved would read)"
                    if oom.peak_reserved
                    else ""
                )
            )
            if self.decided_by == "fragmentation":
                out.append(
                    f"decided by fragmentation: {self._needed_words()} fits the "
                    f"{format_size(self.capacity)} the allocator can get, the allocator's blocks do not"
                )
                for t in self.replayed.tried:
                    if t.fits and t.edge:
                        out.append(
                            f"with {t.setting}: at the edge, does not fit (it completes with the typical bytes "
                            "outside the allocator, not with the high end of the catalogue's range)"
                        )
                    elif t.fits:
                        gain = self.replayed.free_peak_reserved - t.peak_reserved
                        out.append(
                            f"with {t.setting}: fits, peak reserved {format_size(t.peak_reserved)} "
                            f"({format_size(gain)} less than without a limit and the declared setting), margin "
                            f"{format_size(t.margin)}"
                        )
                    else:
                        out.append(
                            f"with {t.setting}: still runs out in phase {t.oom_phase}, lacking {format_size(-t.margin)}"
                        )
                best = self.best_try
                out.append(
                    f"set PYTORCH_CUDA_ALLOC_CONF={best.conf} (software.pytorch_cuda_alloc_conf) to fit"
                    if best is not None
                    else "no allocator setting tried makes it fit"
                )
            else:
                out.append(
                    f"decided by the tensors: {self._needed_words()} alone is more "
                    f"than the {format_size(self.capacity)} the allocator can get; no allocator setting changes that"
                )
        return out

    # -- the ledger
    def extension(self) -> dict[str, Any]:
        """The device-level entries of ``x-estimate`` (merged into the block :func:`write_back` writes)."""
        r = self.replayed
        device_source = self.device_provenance
        device_note = (
            f"peak reserved (allocator model) + outside the allocator, {self.outside_provenance}: "
            f"{self.outside_text()}; no GPU measured this prediction"
        )
        device_peak: dict[str, Any] = {"value": self.device_peak, "source": device_source}
        device_peak["note" if device_source == "ASSUMPTION" else "method"] = device_note
        outside_entry: dict[str, Any] = {"value": self.outside, "source": self.outside_provenance}
        outside_entry["note" if self.outside_provenance == "ASSUMPTION" else "method"] = self.outside_text()
        verdict: dict[str, Any] = {
            "compared": "x-estimate.device_peak",
            "device_memory": self.total,
            "cuda_total": self.cuda_total,
            "device": self.target.name if self.target.name else "unnamed",
            "capacity": self.capacity,
            "fits": self.fits,
            "margin": self.margin,
            "fragmentation": self.fragmentation,
            "decided_by": self.decided_by,
            "alloc_conf": r.alloc_conf,
            "named_by": self.target.named_by,
            "outside_from": "catalogue" if self.outside_figure.estimate is not None else "outside_allocator.total",
            # the parts of outside_allocator the figure took from the ledger (the status ladder's check that they are
            # still what the ledger holds)
            "outside_held": {
                p.name: p.typical
                for p in (self.outside_figure.estimate.counted if self.outside_figure.estimate else ())
                if p.declared
            },
            "allocated": {
                "peak": self.peak_allocated,
                "fits": self.peak_allocated <= self.total,
                "headroom": self.total - self.peak_allocated,
            },
        }
        if self.cuda_note:
            verdict["cuda_total_note"] = self.cuda_note
        if r.high_fits is not None:
            verdict["uncertain"] = self.uncertain
            verdict["outside_high"] = r.outside_high
        if self.oom is not None:
            verdict["oom"] = asdict(self.oom)
        if r.tried:
            verdict["tried"] = [
                {
                    "setting": t.setting,
                    "fits": t.fits and not t.edge,
                    "peak_reserved": t.peak_reserved,
                    "margin": t.margin,
                }
                | ({"oom_phase": t.oom_phase} if t.oom_phase else {})
                | ({"uncertain": True} if t.edge else {})
                | ({"at_high": True} if t.at_high else {})
                for t in r.tried
            ]
            best = self.best_try
            if best is not None:
                verdict["setting"] = {
                    "conf": best.conf,
                    "peak_reserved": best.peak_reserved,
                    "margin": best.margin,
                    "reserved_less": r.free_peak_reserved - best.peak_reserved,
                } | ({"at_high": True} if best.at_high else {})
        return {
            "peak_reserved": {"value": self.peak_reserved, "source": "CALCULATED", "method": self.reserved_method()},
            "reserved_phases": {k: p.reserved for k, p in self.phases.items()},
            "outside_allocator": outside_entry,
            "device_peak": device_peak,
            "device_phases": {k: p.device for k, p in self.phases.items()},
            "verdict": verdict,
        }


# -- computing it ----------------------------------------------------------------------------------------------------


def allocator_note(doc: Document) -> str:
    """:func:`ledgerspec.derivations.allocator.versions.version_note` for the document's declared torch
    (``software.torch``) and allocator settings."""
    from ledgerspec.derivations.allocator.versions import version_note

    conf = (doc.get("software", "pytorch_cuda_alloc_conf").text() or "").strip()
    return version_note(doc.get("software", "torch").text(), conf)


def _config(doc: Document, text: str) -> Any:
    from ledgerspec.derivations.allocator.config import AllocatorConfig, AllocatorConfigError

    try:
        return AllocatorConfig.parse(text)
    except AllocatorConfigError as exc:
        raise _err(
            doc,
            ("software", "pytorch_cuda_alloc_conf"),
            f"PyTorch would refuse this allocator setting: {exc.message}",
            "write PYTORCH_CUDA_ALLOC_CONF as set for the run (e.g. expandable_segments:True)",
        ) from None


def _tries(config: Any, conf: str) -> list[tuple[str, str]]:
    """(setting, whole conf) to replay again when fragmentation decides: expandable segments, then split limits."""
    out: list[tuple[str, str]] = []
    joined = (lambda s: f"{conf},{s}") if conf else (lambda s: s)
    if not config.expandable_segments:
        out.append((EXPANDABLE, joined(EXPANDABLE)))
    for mb in SPLIT_TRIES:
        if mb * MiB >= config.large_segment_size and mb * MiB != config.max_split_size:
            setting = f"max_split_size_mb:{mb}"
            out.append((setting, joined(setting)))
    return out


def replay_on_device(
    doc: Document,
    step: Any,
    total: int,
    outside_bytes: int,
    conf: str,
    target: str = "cuda",
    free: Any = None,
    tries: bool = True,
    cuda_total: int | None = None,
    outside_high: int | None = None,
    helper: Any = None,
    workspaces: Workspaces | None = None,
) -> Replayed:
    """Replay ``step`` (a full-depth :class:`~ledgerspec.derivations.allocator.step.StepEvents`) for a device of
    ``total`` bytes with ``outside_bytes`` outside the allocator (see the module docstring). ``free``: the replay
    without a limit when the caller has it already (:func:`free_replay`: the same for every device unless the
    settings depend on the device's total); ``tries``: replay the allocator settings that could make a
    fragmentation-decided verdict fit; ``cuda_total``: the total the allocator can get when it is not ``total``
    (:func:`.target.cuda_total_of`): the capacity is ``cuda_total - outside_bytes``; ``outside_high``: the high end of
    the outside-allocator catalogue's range for ``outside_bytes``: when the step fits, whether it still fits with that
    much outside the allocator (:attr:`DevicePrediction.uncertain`; replayed again only when the margin is smaller
    than the range above the typical figure); ``helper``: a :class:`~ledgerspec.derivations.engine.beside.Helper`
    that replays half of the settings tried (the same answers as here); ``workspaces``: the cuBLAS workspaces to add
    to the stream (:func:`workspaces_of`; ``free`` must have them too)."""
    from ledgerspec.derivations.allocator.step import replay_step

    started = time.perf_counter()
    config = _config(doc, conf)
    device_total = cuda_total or total
    capacity = max(0, device_total - outside_bytes)

    def against(limit: int | None) -> Any:
        """The stream replayed with these settings when cudaMalloc can get ``limit`` bytes (None: no limit)."""
        return replay_step(
            doc,
            config=config,
            capacity=limit,
            device_total=device_total,
            target=target,
            step=step,
            workspaces=workspaces,
        )

    if free is None or depends_on_total(config):
        free = against(None)
    free_peak = max((p.reserved for p in free.phases.values()), default=0)
    if free.oom is None and free_peak <= capacity:
        on = free  # no cudaMalloc passes the capacity: the replay against it takes the same decisions
    else:
        on = against(capacity)
    shown = on if on.oom is None else free
    phases = {
        k: PhaseDevice(p.allocated, p.allocator_allocated, p.reserved, p.reserved + outside_bytes)
        for k, p in shown.phases.items()
    }
    oom = None
    if on.oom is not None:
        o = on.oom
        lacked = o.reserved + o.alloc_size - capacity
        peak = on.replay.peak_reserved
        oom = DeviceOOM(o.phase, o.requested, o.alloc_size, o.allocated, o.reserved, o.free_unusable, lacked, peak)
    result = Replayed(
        total,
        outside_bytes,
        capacity,
        conf,
        phases,
        on.oom is None,
        free_peak,
        oom,
        stream=step.method,
        fallback=step.fallback,
        events=len(step.events),
        cuda_total=device_total,
        workspaces=sum(sum(w) for w in workspaces) if workspaces else 0,
    )
    # what the allocator can get beside the high end of the catalogue's range (None: no range, a figure the ledger
    # holds): the step and each setting tried are at the edge when they complete against the capacity, not against it
    capacity_high = None
    if outside_high is not None and outside_high > outside_bytes:
        capacity_high = max(0, device_total - outside_high)
        if result.fits:
            result.outside_high = outside_high
            if free.oom is None and free_peak <= capacity_high:
                result.high_fits = True  # no cudaMalloc passes the lower capacity either: the same decisions
            else:
                result.high_fits = against(capacity_high).oom is None
    # what the allocator must hold at least: the tensors' peak and the cuBLAS workspaces
    peak_allocated = max((p.allocated for p in phases.values()), default=0) + result.workspaces

    def tried(against: int, edge_at: int | None) -> list[Tried]:
        settings = _tries(config, conf)
        # with a helper process, its half of the settings are replayed there while this process replays the rest
        half = len(settings) // 2 if helper is not None and helper.running else 0
        rest = settings[len(settings) - half :]
        args = (against, device_total, target, step, edge_at, workspaces)
        there = helper.submit(try_settings, doc, rest, *args) if half else None
        out = try_settings(doc, settings[: len(settings) - half], *args)
        return out + (there() if there is not None else [])

    if tries and oom is not None and peak_allocated <= capacity:  # fragmentation decides: would a setting change it?
        result.tried = tried(capacity, capacity_high)
    elif tries and result.high_fits is False and capacity_high is not None and peak_allocated <= capacity_high:
        # at the edge, and with the high end of the range fragmentation decides: a setting that completes there too
        # makes the step fit whatever the range holds
        result.tried = [replace(t, at_high=True) for t in tried(capacity_high, None)]
    result.seconds = time.perf_counter() - started
    return result


def try_settings(
    doc: Document,
    settings: list[tuple[str, str]],
    capacity: int,
    device_total: int,
    target: str,
    step: Any,
    capacity_high: int | None = None,
    workspaces: Workspaces | None = None,
) -> list[Tried]:
    """``step`` replayed against ``capacity`` with each of ``settings`` (setting, whole conf: :func:`_tries`), in
    order (a task a helper process can run: its arguments pickle). ``capacity_high``: what the allocator can get
    beside the high end of the outside-allocator catalogue's range; a setting whose replay completes is replayed
    against it too, and one that runs out there is at the edge (:attr:`Tried.edge`); ``workspaces``: as
    :func:`replay_on_device`'s."""
    from ledgerspec.derivations.allocator.config import AllocatorConfig
    from ledgerspec.derivations.allocator.step import replay_step
    from ledgerspec.derivations.estimate.fit import OOM_PHASE

    out = []
    for setting, whole in settings:
        config = AllocatorConfig.parse(whole)
        again = replay_step(doc, None, config, capacity, device_total, target, step, workspaces)
        reserved = max((p.reserved for p in again.phases.values()), default=0)
        if again.oom is None:
            edge = False
            if capacity_high is not None and capacity_high < capacity:
                edge = (
                    replay_step(doc, None, config, capacity_high, device_total, target, step, workspaces).oom
                    is not None
                )
            out.append(Tried(setting, whole, True, reserved, capacity - reserved, edge=edge))
        else:
            a = again.oom
            lacked = a.reserved + a.alloc_size - capacity
            out.append(Tried(setting, whole, False, a.reserved, -lacked, OOM_PHASE.get(a.phase, a.phase)))
    return out


def step_and_estimate(
    doc: Document,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    store: Any = None,
    parallel: bool = False,
    progress: Any = None,
    probes: dict[int | None, Any] | None = None,
    elsewhere: Any = None,
    pattern: Any = None,
    defer: bool = False,
    idle: Callable[[], None] | None = None,
) -> tuple[Any, Any]:
    """The estimate of ``doc`` and its step's allocation stream at full depth, from one set of traces (the
    estimate's probes and a third); with ``store`` the plain estimate is kept in the cache, so that a later
    ``estimate`` of the same question (a plain one, or a microbatch model's) is read back, not traced. ``probes``:
    filled with the probes' streams by depth; ``elsewhere``: where the third probe runs; ``pattern``: the depth pattern
    of a step of the same structure; ``defer``, ``idle``: the stream built later, work to do while a probe runs
    elsewhere (:func:`ledgerspec.derivations.allocator.step.full_depth`)."""
    from ledgerspec.derivations.allocator import stream_cache
    from ledgerspec.derivations.allocator.step import full_depth_from
    from ledgerspec.derivations.estimate import estimator
    from ledgerspec.derivations.estimate.cache import key as cache_key
    from ledgerspec.derivations.estimate.extrapolate import extend_all

    plain_question = {"target": target, "layers": layers, "offline": offline}
    # the stream depends on the question, never on the device: a device asked about first replays the stream kept
    # for another (a caller that wants the probes, or builds the stream its own way, traces)
    reuse = probes is None and elsewhere is None and pattern is None and not defer
    plain_key = cache_key(doc, plain_question) if store is not None else None
    stream_key = cache_key(doc, {**plain_question, "stream": stream_cache.FORMAT}) if reuse and plain_key else None
    if stream_key is not None and plain_key is not None:
        started = time.perf_counter()
        kept, plain = store.get(stream_key), store.get(plain_key)
        if kept is not None and plain is not None:
            try:
                step = stream_cache.decode(kept)
                return estimator.Estimate.from_cache(plain, time.perf_counter() - started), step
            except Exception:  # any entry this version cannot read: traced again and overwritten
                pass
    p = estimator.prepare(doc, target, layers, progress, offline)
    step = full_depth_from(p, parallel, probes, elsewhere, pattern, defer, idle)
    figures = step.estimate_figures
    if figures is None:  # a stack too shallow for a third probe was traced in full: the estimate's own probes
        assert p.plan.probes is not None
        n1, n2 = p.plan.probes
        figures = extend_all(p.trace(n1), p.trace(n2), n1, n2, p.plan.layers)
    est = estimator.assemble(p, figures)
    if store is not None and plain_key is not None:
        store.put(plain_key, est.to_cache())  # the plain question is answered by these traces too
        if stream_key is not None and (kept := stream_cache.encode(step)) is not None:
            store.put(stream_key, kept)
    return est, step


def depends_on_total(config: Any) -> bool:
    """Whether a replay without a limit depends on the device's total: expandable segments reserve address space
    relative to it, ``per_process_memory_fraction`` caps the allocator by it."""
    return bool(config.expandable_segments) or config.per_process_memory_fraction < 1.0


def free_replay(doc: Document, step: Any, conf: str, target: str = "cuda", workspaces: Workspaces | None = None) -> Any:
    """``step`` replayed without a limit (for :func:`replay_on_device`'s ``free``), with ``workspaces``."""
    from ledgerspec.derivations.allocator.step import replay_step

    return replay_step(doc, config=_config(doc, conf), target=target, step=step, workspaces=workspaces)


def workspaces_of(doc: Document, target: Target) -> Workspaces:
    """The cuBLAS workspaces of ``doc``'s step on ``target``, the Python thread's handle's and the autograd thread's
    (the outside-allocator catalogue's sizes for its GPU architecture): blocks of the caching allocator that the
    traced tensor stream lacks (:mod:`ledgerspec.derivations.allocator.workspaces`)."""
    return outside.cublas_workspaces(replace(outside.stack_of(doc), gpu_name=target.name))


def device_question(
    doc: Document,
    device_memory: int,
    from_flag: bool = False,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    catalogue: Any = None,
) -> tuple[Target, outside.Figure, str, dict[str, Any]]:
    """What a verdict on a device of ``device_memory`` bytes depends on besides the estimate's inputs: the named
    device, the bytes outside the allocator, the allocator's settings, and the cache question that holds them all
    (see :func:`estimate_on_device`). Checks the document and the settings first (one line at the field)."""
    from ledgerspec.derivations.estimate import estimator

    if target != "cuda":
        raise ValueError("the device verdict models the CUDA caching allocator: target cuda only")
    estimator.check_document(doc)
    named = target_of(doc, device_memory, from_flag, catalogue)
    figure = outside_of(doc, named)
    conf = (doc.get("software", "pytorch_cuda_alloc_conf").text() or "").strip()
    _config(doc, conf)  # a setting PyTorch refuses: one line at the field, before anything is traced
    question = {
        "target": target,
        "layers": layers,
        "offline": offline,
        "device": {
            "format": FORMAT,
            "total": device_memory,
            "cuda_total": named.cuda_total,
            "outside": figure.bytes,
            "outside_high": high_of(figure),
            "alloc_conf": conf,
            # from the outside catalogue (a YAML file, which the code digest does not cover)
            "workspaces": [list(w) for w in workspaces_of(doc, named)],
        },
    }
    return named, figure, conf, question


def estimate_on_device(
    doc: Document,
    device_memory: int,
    from_flag: bool = False,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    store: Any = None,
    parallel: bool = False,
    progress: Any = None,
    catalogue: Any = None,
    step_fn: Any = None,
    helper: Any = None,
) -> tuple[Any, DevicePrediction]:
    """The estimate of ``doc`` (its figures exactly as :func:`ledgerspec.derivations.estimate.estimate` gives them)
    and its :class:`DevicePrediction` for a device of ``device_memory`` bytes (``from_flag``: asked with
    ``--device-memory``, see :func:`target_of`). One set of traces: the estimate's probes and a third. With ``store``
    (an :class:`~ledgerspec.derivations.estimate.cache.EstimateCache`) the answer is kept and read back under a key
    that holds everything the replay depends on besides the estimate's inputs: the device's total, the bytes outside
    the allocator and the allocator's settings. ``catalogue``: the device catalogue that names the device and gives
    its CUDA total (:func:`target_of`; the built-in one when None). ``step_fn``: ``() -> (estimate, step)`` when the
    caller has traced them already (:func:`step_and_estimate`'s answer), called only on a cache miss; ``helper``: see
    :func:`replay_on_device`."""
    from ledgerspec.derivations.estimate import estimator
    from ledgerspec.derivations.estimate.cache import cached

    named, figure, conf, question = device_question(doc, device_memory, from_flag, target, layers, offline, catalogue)

    def compute() -> tuple[Any, Replayed]:
        if step_fn is not None:
            est, step = step_fn()
        else:
            est, step = step_and_estimate(doc, target, layers, offline, store, parallel, progress)
        now = stated(doc, named, figure, est.components.get("optimizer"))
        return est, replay_on_device(
            doc,
            step,
            device_memory,
            now.bytes,
            conf,
            target,
            cuda_total=named.cuda_total,
            outside_high=high_of(now),
            helper=helper,
            workspaces=workspaces_of(doc, named),
        )

    def encode(answer: tuple[Any, Replayed]) -> dict[str, Any]:
        return {"estimate": answer[0].to_cache(), "device": answer[1].to_cache()}

    def decode(data: dict[str, Any], seconds: float) -> tuple[Any, Replayed, bool]:
        return estimator.Estimate.from_cache(data["estimate"], seconds), Replayed.from_cache(data["device"]), True

    answer = cached(store, doc, question, lambda: (*compute(), False), lambda a: encode((a[0], a[1])), decode)
    est, replayed, from_cache = answer
    figure = stated(doc, named, figure, est.components.get("optimizer"))
    return est, DevicePrediction(named, figure, replayed, cached=from_cache, version_note=allocator_note(doc))


#: the cache question's mark of a verdict whose stream was synthesised (:func:`stream_on_device`)
SYNTHESISED = "synthesised"


def stream_on_device(
    doc: Document,
    device_memory: int,
    step_fn: Any,
    from_flag: bool = False,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    store: Any = None,
    catalogue: Any = None,
    helper: Any = None,
    optimizer_state: int | None = None,
) -> DevicePrediction:
    """The :class:`DevicePrediction` of ``doc`` from a full-depth stream ``step_fn()`` gives without an estimate of
    its own (one synthesised from streams traced at other values: :mod:`ledgerspec.derivations.devices.along`),
    kept in the cache apart from :func:`estimate_on_device`'s answers (which hold a traced estimate too; without
    ``store`` it is not kept: :func:`keep_synthesised` keeps it later). Only a cache miss calls ``step_fn``;
    ``helper``: see :func:`replay_on_device`; ``optimizer_state``: the optimizer state of the estimates the stream
    was written from (:func:`stated`)."""
    from ledgerspec.derivations.estimate.cache import cached

    named, figure, conf, question = device_question(doc, device_memory, from_flag, target, layers, offline, catalogue)
    figure = stated(doc, named, figure, optimizer_state)

    def compute() -> tuple[Replayed, bool]:
        step = step_fn()
        replayed = replay_on_device(
            doc,
            step,
            device_memory,
            figure.bytes,
            conf,
            target,
            cuda_total=named.cuda_total,
            outside_high=high_of(figure),
            helper=helper,
            workspaces=workspaces_of(doc, named),
        )
        return replayed, False

    answer = cached(
        store,
        doc,
        {**question, "stream": SYNTHESISED},
        compute,
        lambda a: a[0].to_cache(),
        lambda data, _: (Replayed.from_cache(data), True),
    )
    return DevicePrediction(named, figure, answer[0], cached=answer[1], version_note=allocator_note(doc))


def keep_synthesised(
    doc: Document,
    device_memory: int,
    prediction: DevicePrediction,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    store: Any = None,
    catalogue: Any = None,
    from_flag: bool = False,
) -> None:
    """Keep in ``store`` the verdict :func:`stream_on_device` computed without one (under the key it would have
    used), once the stream it was replayed from has passed its last check."""
    from ledgerspec.derivations.estimate.cache import key

    if store is None:
        return
    _, _, _, question = device_question(doc, device_memory, from_flag, target, layers, offline, catalogue)
    name = key(doc, {**question, "stream": SYNTHESISED})
    if name is not None:
        store.put(name, prediction.replayed.to_cache())


def cached_on_device(
    doc: Document,
    device_memory: int,
    from_flag: bool = False,
    target: str = "cuda",
    layers: str = "auto",
    offline: bool = True,
    store: Any = None,
    catalogue: Any = None,
    optimizer_state: int | None = None,
) -> DevicePrediction | None:
    """The verdict the cache holds for ``doc`` on this device, traced or synthesised (None: not there);
    ``optimizer_state``: as :func:`stream_on_device` takes it."""
    from ledgerspec.derivations.estimate.cache import key

    if store is None:
        return None
    named, figure, _, question = device_question(doc, device_memory, from_flag, target, layers, offline, catalogue)
    figure = stated(doc, named, figure, optimizer_state)
    for q, synthesised in (({**question, "stream": SYNTHESISED}, True), (question, False)):
        name = key(doc, q)
        data = store.get(name) if name is not None else None
        if data is None:
            continue
        try:
            replayed = Replayed.from_cache(data if synthesised else data["device"])
        except (KeyError, TypeError, ValueError):
            continue
        return DevicePrediction(named, figure, replayed, cached=True, version_note=allocator_note(doc))
    return None


__all__ = [
    "EXPANDABLE",
    "SPLIT_TRIES",
    "SYNTHESISED",
    "DeviceOOM",
    "DevicePrediction",
    "PhaseDevice",
    "Replayed",
    "Tried",
    "cached_on_device",
    "depends_on_total",
    "device_question",
    "estimate_on_device",
    "free_replay",
    "replay_on_device",
    "step_and_estimate",
    "stream_on_device",
    "try_settings",
]
