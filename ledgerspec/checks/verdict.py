"""The answer a user came for, first: does it fit the target device, by how much, and what the next status needs.

:func:`verdict` reads the ladder's best peak (measured, then predicted; never a sum of components) against
``result.target_device.memory``: FITS, DOES NOT FIT or UNKNOWN, with the peak's provenance, the headroom and the
phase a prediction runs out of memory in. :func:`next_steps` folds the ladder's reasons into one line per kind of
missing evidence, with the command that supplies it. Both are pure functions of a document (no I/O).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ledgerspec.checks.ladder import (
    DEVICE_PEAK,
    LADDER,
    RANK,
    RANK_DEVICE_PEAK,
    StatusResult,
    at_the_edge,
    compared_total,
    cpu_estimate,
    device_prediction,
    entry_of,
    pilot_section,
    rank_prediction,
    rank_rows,
    worst_rank,
)
from ledgerspec.checks.stale import shard_again, stale_evidence
from ledgerspec.contract.config import sharded_ranks
from ledgerspec.contract.document import Document
from ledgerspec.contract.fields import AT_THE_EDGE, EDGE_WHY, PHASE_OOM_WORDS
from ledgerspec.contract.fingerprint import SHARD_ESTIMATE
from ledgerspec.contract.units import format_size
from ledgerspec.contract.values import Value

FITS = "FITS"
DOES_NOT_FIT = "DOES NOT FIT"
UNKNOWN = "UNKNOWN"
#: the protocol's phase keys in run order, with the ``oom_phase`` word of each
_PHASE_WORDS = PHASE_OOM_WORDS


@dataclass(frozen=True)
class Verdict:
    """FITS / DOES NOT FIT / UNKNOWN on the target device, and the figures behind it."""

    answer: str
    device_memory: int | None = None
    device_name: str | None = None
    peak: int | None = None
    peak_field: str | None = None  # where the peak figure is (x-estimate.peak_allocated, metrics.device_peak ...)
    provenance: str | None = None  # measured | predicted | pilot
    headroom: int | None = None  # negative when it does not fit
    oom_phase: str | None = None  # the phase a prediction (or a run) runs out of memory in
    why: str = ""  # UNKNOWN: what is missing; else a qualifier (stale, allocated tensors only ...)
    notes: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        size = format_size(self.device_memory) if self.device_memory is not None else "?"
        return f"{self.device_name} ({size})" if self.device_name else f"the target device ({size})"

    def sentence(self) -> str:
        """One line: the answer, the peak and where it comes from, the headroom, the OOM phase (and the qualifier)."""
        head = self.headline()
        if self.answer == UNKNOWN or not self.why:
            return head
        return f"{head} ({self.why})"

    def headline(self) -> str:
        """:meth:`sentence` without the qualifier in parentheses."""
        if self.answer == UNKNOWN:
            return f"{UNKNOWN}: {self.why}"
        if self.peak is None or self.headroom is None:
            text = f"{self.answer} on {self.device}"
        elif self.answer == FITS:
            where = f"{self.provenance} peak {format_size(self.peak)} ({self.peak_field})"
            text = f"{FITS} on {self.device}: {where}, headroom {format_size(self.headroom)}"
        else:
            where = f"{self.provenance} peak {format_size(self.peak)} ({self.peak_field})"
            over = (
                f"{format_size(-self.headroom)} over" if self.headroom < 0 else f"headroom {format_size(self.headroom)}"
            )
            text = f"{DOES_NOT_FIT} on {self.device}: {where}, {over}"
        if self.oom_phase:
            verb = "ran" if self.provenance == "measured" else "predicted to run"
            text += f"; {verb} out of memory in phase {self.oom_phase}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "device_memory": self.device_memory,
            "device_name": self.device_name,
            "peak": self.peak,
            "peak_field": self.peak_field,
            "provenance": self.provenance,
            "headroom": self.headroom,
            "oom_phase": self.oom_phase,
            "sentence": self.sentence(),
        }


def _provenance(peak_from: str) -> str:
    if peak_from.startswith(("x-pilot.", "pilot.")):
        return "pilot"
    if peak_from.startswith(("x-estimate.", SHARD_ESTIMATE)):
        return "predicted"
    return "measured"


def _field(peak_from: str) -> str:
    return peak_from.split(" ")[0]


def _predicted_oom_phase(doc: Document, device: int, device_level: bool) -> str | None:
    """The phase a prediction runs out of memory in: the estimate's own ``oom_phase`` when written for this device
    at the level compared (``device_level``: the allocator replay's; else the allocated peaks'), else the first phase
    of ``x-estimate.phases`` above ``device``."""
    recorded = doc.get("x-estimate", "oom_phase").text()
    at_device_level = doc.get("x-estimate", "verdict").present
    if recorded and doc.get("x-estimate", "device_memory").integer() == device and device_level == at_device_level:
        return recorded
    for key, word in _PHASE_WORDS.items():
        size = doc.get("x-estimate", "phases", key).integer()
        if size is not None and size > device:
            return word
    return None


def named(text: str, path: str | None) -> str:
    """``text`` with the command placeholder ``FILE`` replaced by the document's path (kept for a path with spaces
    or a stream, where a copied command would not run as written)."""
    if not path or path.startswith("<") or any(c.isspace() for c in path):
        return text
    return re.sub(r"\bFILE\b", lambda _m: path, text)


def verdict(doc: Document, status: StatusResult) -> Verdict:
    """The verdict of ``doc`` (its ladder result ``status`` gives the best peak)."""
    v = _verdict(doc, status)
    return replace(v, why=named(v.why, doc.path)) if v.why else v


def _verdict(doc: Document, status: StatusResult) -> Verdict:
    device = doc.get("result", "target_device", "memory").size()
    name = doc.get("result", "target_device", "name").text()
    if doc.get("result", "oom").switch() is True:
        return _measured_oom(doc, status, device, name, doc.get("result", "oom_phase").text())
    if device is None:
        hint = "no target device: set result.target_device.memory (or `ledgerspec estimate FILE --device-memory 24GiB`)"
        return Verdict(UNKNOWN, None, name, status.best_peak, why=hint)
    if status.best_peak is None or status.best_peak_from is None:
        if cpu_estimate(doc):
            why = (
                "x-estimate models the CPU's kernels (estimate --target cpu); `ledgerspec estimate FILE` predicts the "
                "GPU's peak"
            )
        else:
            why = "no peak figure yet: `ledgerspec estimate FILE` predicts one, `ledgerspec measure FILE` measures one"
            why_not = rank_prediction(doc)[1]
            if why_not:
                why += f"; {why_not}"
        return Verdict(UNKNOWN, device, name, why=why)
    peak, peak_from = status.best_peak, status.best_peak_from
    provenance = _provenance(peak_from)
    if provenance == "predicted" and stale_evidence(doc, "CANDIDATE", peak_from):
        # a prediction of other inputs answers nothing about these: the ladder stops counting it (LS006), and so does
        # the verdict (its figure named, so the reader sees what is out of date)
        again = shard_again(sharded_ranks(doc)) if peak_from == RANK_DEVICE_PEAK else "ledgerspec estimate FILE"
        why = (
            f"the predicted peak {format_size(peak)} ({_field(peak_from)}) is of inputs edited since: run "
            f"`{again}` again"
        )
        return Verdict(UNKNOWN, device, name, peak, _field(peak_from), provenance, why=why)
    limit = compared_total(doc, device, peak_from)  # the card's CUDA total for a device-level prediction
    cuda_note = ""
    if limit != device:
        held = doc.get("x-estimate", "verdict", "cuda_total_note").text() if peak_from == DEVICE_PEAK else None
        cuda_note = held or (f"its CUDA total is {format_size(limit)}, not the declared {format_size(device)}")
    headroom = limit - peak
    fits = headroom >= 0 and not at_the_edge(doc, peak_from)  # at the edge: the headroom is the typical figure's
    oom = None
    notes: list[str] = []
    if not fits and peak_from == RANK_DEVICE_PEAK:
        worst = worst_rank(doc)
        key = worst.get("oom_phase") if worst is not None else None
        oom = _PHASE_WORDS.get(key, key) if isinstance(key, str) else None
    elif not fits and provenance == "predicted":
        oom = _predicted_oom_phase(doc, device, peak_from == DEVICE_PEAK)
    pilot_oom = doc.get(pilot_section(doc), "oom_phase").text()
    if provenance == "pilot" and pilot_oom:
        fits, oom = False, pilot_oom
    qualifier = ""
    if provenance == "predicted":
        if peak_from in (RANK_DEVICE_PEAK, DEVICE_PEAK):
            qualifier = (_rank_qualifier if peak_from == RANK_DEVICE_PEAK else _device_qualifier)(doc)
            if cuda_note:
                qualifier = f"{cuda_note}; {qualifier}"
        else:
            qualifier = "allocated tensors only: keep room for the CUDA context and the allocator's cache"
            why_not = device_prediction(doc)[1]
            if why_not:
                qualifier += f"; {why_not}"
        if peak_from.startswith("x-estimate."):
            one = _one_gpu_note(doc)
            if one:
                qualifier += f"; {one}"
    elif provenance == "measured" and doc.get("measurement", "device").text() == "cpu":
        qualifier = "measured on the CPU (tensor tracking): a GPU run allocates more (kernels, workspaces)"
    elif peak_from.startswith("metrics.peak_allocated") or peak_from.startswith("phases."):
        qualifier = "allocated by PyTorch; the device peak is higher"
    return Verdict(
        FITS if fits else DOES_NOT_FIT,
        device,
        name,
        peak,
        _field(peak_from),
        provenance,
        headroom,
        oom,
        qualifier,
        notes,
    )


def _one_gpu_note(doc: Document) -> str:
    """For a document of several GPUs whose model state is sharded, compared by ``x-estimate`` (one GPU holding
    the whole model): what it is, and what predicts a rank (with why the per-rank estimate there does not hold)."""
    gpus = sharded_ranks(doc)
    if gpus is None:
        return ""
    note = (
        f"x-estimate is one GPU holding the whole model, not one of the {gpus} sharded ranks: "
        f"`{shard_again(gpus)}` predicts each rank"
    )
    why_not = rank_prediction(doc)[1]
    return f"{note} ({why_not})" if why_not else note


def _rank_qualifier(doc: Document) -> str:
    """What the per-rank device-level prediction is made of (its worst rank's), in :func:`_device_parts`' words."""
    worst = worst_rank(doc)
    assert worst is not None
    rank, listed = worst.get("rank"), len(rank_rows(doc))
    which = f"rank {rank}, the worst" if isinstance(rank, int) else "the worst rank"
    parts = _device_parts(
        lambda *keys: entry_of(worst, *keys),
        at_the_edge(doc, RANK_DEVICE_PEAK),
        f"ledgerspec measure --device cuda --nproc {sharded_ranks(doc) or listed}",
    )
    return "; ".join([f"{which} of {listed} (`ledgerspec shard --estimate`)", *parts])


def _device_qualifier(doc: Document) -> str:
    """What the estimate's device-level prediction is made of (``x-estimate``), in :func:`_device_parts`' words."""
    parts = _device_parts(
        lambda *keys: doc.get("x-estimate", *keys), at_the_edge(doc, DEVICE_PEAK), "ledgerspec measure --device cuda"
    )
    return "; ".join(parts)


def _device_parts(get: Callable[..., Value], edge: bool, measure: str) -> list[str]:
    """What a device-level prediction is made of, and what decided it: the allocator model's reserved bytes, the
    bytes outside the allocator (with their provenance), the allocated peak; the fragmentation and the setting that
    would change the outcome when fragmentation decides; at the edge (``edge``), what would decide it (``measure``:
    the command that measures the bytes outside the allocator). ``get(*keys)`` reads the prediction's block (the
    estimate's ``x-estimate``, a rank's row of the per-rank estimate)."""
    reserved = get("peak_reserved").size()
    out = get("outside_allocator")
    allocated = get("peak_allocated").size()
    parts = []
    if reserved is not None and out.size() is not None:
        parts.append(
            f"device-level: reserved {format_size(reserved)} (allocator model) + {format_size(out.size() or 0)} "
            f"outside the allocator ({out.effective_source(True)})"
        )
    if allocated is not None:
        parts.append(f"allocated {format_size(allocated)}")
    fragmentation = get("verdict", "fragmentation").size()
    conf = get("verdict", "setting", "conf").text()
    margin = get("verdict", "setting", "margin").size()
    if get("verdict", "decided_by").text() == "fragmentation" and fragmentation is not None:
        parts.append(f"decided by fragmentation ({format_size(fragmentation)} free but unusable at the out-of-memory)")
        if conf and margin is not None:
            parts.append(f"with PYTORCH_CUDA_ALLOC_CONF={conf} it fits, margin {format_size(margin)}")
    high = get("verdict", "outside_high").size()
    if edge:
        figure = f" ({format_size(high)})" if high is not None else ""
        parts.append(
            f"{AT_THE_EDGE}: {EDGE_WHY}; with the catalogue's high "
            f"end{figure} the allocator model runs out of memory: measure outside_allocator "
            f"(`{measure}`) or leave more headroom"
        )
        if conf and margin is not None and get("verdict", "setting", "at_high").value is True:
            parts.append(
                f"with PYTORCH_CUDA_ALLOC_CONF={conf} it completes with the high end too, margin {format_size(margin)} "
                "there"
            )
    parts.append("a model, not measured")
    return parts


def _measured_oom(
    doc: Document, status: StatusResult, device: int | None, name: str | None, phase: str | None
) -> Verdict:
    """A run that ran out of memory (``result.oom: true``): it does not fit the device it ran on."""
    measured = doc.get("measurement", "device_memory").size() or device
    peak = status.best_peak
    return Verdict(
        DOES_NOT_FIT,
        measured,
        doc.get("measurement", "device_name").text() or name,
        peak,
        _field(status.best_peak_from) if status.best_peak_from else "result.oom",
        "measured",
        None if peak is None or measured is None else measured - peak,
        phase or "(result.oom_phase not recorded)",
        why="the run ran out of memory" if peak is None else "",
    )


# -- the next status --------------------------------------------------------------------------------
#: (pattern over a ladder reason, the kind of evidence it asks for, the command that supplies it)
_KINDS: tuple[tuple[str, str, str], ...] = (
    (r"^minimum intake: (?P<item>\S+)", "fill the minimum intake", "`ledgerspec validate -v FILE` lists it"),
    (r"^an intake holds no ledger figures", "turn the intake into a ledger", "`ledgerspec resolve FILE -o LEDGER`"),
    (
        r"^CALCULATED needs exact figures: (?P<item>ledger\.\w+)",
        "exact figures for the resident components",
        "`ledgerspec resolve FILE`",
    ),
    (
        r"^CANDIDATE needs result\.target_device\.memory",
        "a target device",
        "result.target_device.memory, or `ledgerspec estimate FILE --device-memory 24GiB`",
    ),
    (
        r"^CANDIDATE needs an? (activation|peak) figure",
        "an activation figure and a predicted or measured peak",
        "`ledgerspec estimate FILE`",
    ),
    (
        r"^best peak .* does not fit",
        "a peak that fits the target device",
        "`ledgerspec estimate FILE --fit "
        "microbatch` finds the largest microbatch that fits; `--devices` compares devices",
    ),
    (
        rf"^the device verdict is {AT_THE_EDGE}",
        "the bytes outside the allocator, measured (or more headroom)",
        "`ledgerspec measure FILE --device cuda` writes outside_allocator; `ledgerspec estimate FILE --fit microbatch`",
    ),
    (r"^result\.fits is false", "a configuration that fits", "`ledgerspec estimate FILE --fit microbatch`"),
    (r"^the pilot run ran out of memory", "a run that did not run out of memory", "`ledgerspec measure FILE`"),
    (r"^result\.oom is true", "a configuration that does not run out of memory", "`ledgerspec triage FILE`"),
    (
        r"(?P<item>\S+) is \w+ from other inputs|from other inputs|is of other inputs",
        "figures of the current inputs (some were edited since)",
        "run the command again (rule LS006 names it)",
    ),
    (
        r"^ASSUMPTION in an intake field caps .*: (?P<item>\S+)",
        "no ASSUMPTION in the intake",
        "replace each with a declared, VERIFIED or MEASURED value",
    ),
    (r"^VALIDATED needs no UNKNOWN in the intake: (?P<item>\S+)", "no UNKNOWN in the intake", "fill each field"),
    (
        r"^VALIDATED needs software\.(?P<item>\w+)|software\.cuda or software\.rocm",
        "the software stack",
        "`ledgerspec measure` records it",
    ),
    (
        r"^VALIDATED needs comparison",
        "the comparison with its known_explanation",
        "`ledgerspec measure` fills it; say what explains the difference",
    ),
    (
        r"measurement\.device is cpu|^VALIDATED needs (?P<item>phases\.\w+|metrics\.\w+|measurement\.\w+|result\.oom)"
        r"|^activation offload: VALIDATED needs (?P<item2>metrics\.\w+)|per_rank_peak per rank",
        "a full measurement on the GPU",
        "`ledgerspec measure FILE --device cuda` (`--nproc N` for several GPUs)",
    ),
)
_COMPILED = tuple((re.compile(p), kind, how) for p, kind, how in _KINDS)


@dataclass(frozen=True)
class Step:
    """One kind of missing evidence: what it is, the command that supplies it, the fields it concerns."""

    kind: str
    how: str
    items: tuple[str, ...]
    reasons: tuple[str, ...]

    def line(self, max_items: int = 4) -> str:
        shown = list(self.items[:max_items])
        more = len(self.items) - len(shown)
        what = f" ({', '.join(shown)}{f', +{more} more' if more > 0 else ''})" if shown else ""
        return f"{self.kind}{what}: {self.how}" if self.how else f"{self.kind}{what}"


def next_steps(reasons: list[str], path: str | None = None) -> list[Step]:
    """The ladder's reasons folded into one :class:`Step` per kind of missing evidence, in the order they come;
    ``path``: the document, named in the commands instead of ``FILE``."""
    groups: dict[str, tuple[str, list[str], list[str]]] = {}
    for reason in reasons:
        for pattern, kind, how in _COMPILED:
            m = pattern.search(reason)
            if m is None:
                continue
            item = next((v for k, v in m.groupdict().items() if v), None)
            entry = groups.setdefault(kind, (how, [], []))
            if item and item not in entry[1]:
                entry[1].append(item.rstrip(",;:"))
            entry[2].append(reason)
            break
        else:
            groups.setdefault(reason, ("", [], [reason]))

    return [Step(kind, named(how, path), tuple(items), tuple(rs)) for kind, (how, items, rs) in groups.items()]


def next_status(supported: str) -> str | None:
    """The rung above ``supported`` (None at the top)."""
    rank = RANK.get(supported)
    return LADDER[rank + 1] if rank is not None and rank + 1 < len(LADDER) else None


__all__ = ["DOES_NOT_FIT", "FITS", "UNKNOWN", "Step", "Verdict", "next_status", "next_steps", "verdict"]
