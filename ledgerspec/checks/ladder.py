"""The status ladder: INSUFFICIENT DATA < CALCULATED < CANDIDATE < VALIDATED.

:func:`supported_status` computes the highest status the evidence in a document supports, with
the reasons that hold it down. Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.checks.stale import shard_again, stale_evidence
from ledgerspec.contract import fields as F
from ledgerspec.contract.config import GENERATING, read, sharded_ranks
from ledgerspec.contract.differences import stack_differences
from ledgerspec.contract.document import Document
from ledgerspec.contract.fingerprint import SHARD_ESTIMATE
from ledgerspec.contract.intake import dotted, minimum_intake_gaps
from ledgerspec.contract.values import EXACT_SOURCES, Value

LADDER = F.STATUSES
RANK = {s: i for i, s in enumerate(LADDER)}


@dataclass
class StatusResult:
    status: str
    reasons: list[str] = field(default_factory=list)
    intake_complete: bool = False
    best_peak: int | None = None
    best_peak_from: str | None = None


def input_fields(doc: Document) -> Iterator[tuple[tuple[str, ...], F.Field, Value]]:
    """Every field of the input sections (what an intake holds), with its value in ``doc``."""
    for section in F.INPUT_SECTION_NAMES:
        sec = F.lookup(doc.kind or "ledger", (section,))
        if sec is None:
            continue
        for path, f in F.walk(sec.children, (section,)):
            yield path, f, doc.get(*path)


def assumption_inputs(doc: Document) -> list[str]:
    out = []
    for path, f, v in input_fields(doc):
        if f.kind == F.FIGURES and v.form == "plain" and isinstance(v.raw, list):
            out += [
                f"{dotted(path)}[{i}]"
                for i, item in enumerate(v.raw)
                if Value.of(item).effective_source(True) == "ASSUMPTION"
            ]
        elif f.kind != F.OBJECT and v.effective_source(f.figure) == "ASSUMPTION":
            out.append(dotted(path))
    return out


#: where the estimate's device-level figure is, and the allocated one it stands in for
DEVICE_PEAK = "x-estimate.device_peak"
ALLOCATED_PEAK = "x-estimate.peak_allocated"


def _verdict_holds(
    doc: Document, verdict: Callable[..., Value], judged: int | None, used: int | None, what: str, again: str
) -> str | None:
    """Why a recorded device-level verdict no longer holds for what the document declares now (None: it holds):
    ``verdict(*keys)`` reads the verdict's entries (``x-estimate.verdict``, a rank's ``verdict``); ``judged``: the
    device memory it was decided for; ``used``: the bytes outside the allocator it took; ``what``: its figure, for
    the reason. It holds for the device memory, the allocator settings (``software.pytorch_cuda_alloc_conf``), the
    figure outside the allocator (``outside_allocator.total``, or its parts) and the device's name it was decided
    with; the input fingerprint of the command that wrote it covers the rest (LS006)."""
    target = doc.get("result", "target_device", "memory").size()
    if target is not None and judged != target:
        return f"{what} for another device memory: {again}"
    conf = (doc.get("software", "pytorch_cuda_alloc_conf").text() or "").strip()
    if (verdict("alloc_conf").text() or "").strip() != conf:
        return f"{what} with other allocator settings (pytorch_cuda_alloc_conf): {again}"
    declared = doc.get("outside_allocator", "total").size()
    from_ledger = verdict("outside_from").text() == "outside_allocator.total"
    if (declared is not None or from_ledger) and declared != used:
        return f"{what} with another outside_allocator.total: {again}"
    held = verdict("outside_held")
    if held.present and isinstance(held.value, dict) and declared is None:  # a verdict that records the parts
        now = {k: doc.get("outside_allocator", k).size() for k in F.OUTSIDE_PARTS}
        then = {k: verdict("outside_held", k).size() for k in F.OUTSIDE_PARTS}
        if now != then:
            return f"{what} with other outside_allocator parts (context, nccl, other): {again}"
    name = doc.get("result", "target_device", "name").text()
    if verdict("named_by").text() == "result.target_device.name" and name != verdict("device").text():
        return f"{what} for another result.target_device.name: {again}"
    return None


def device_prediction(doc: Document) -> tuple[int | None, str | None]:
    """The estimate's device-level peak (``x-estimate.device_peak``: the allocator model's peak reserved plus what
    lies outside the allocator) when it was predicted for what the document declares now: ``(bytes, None)``; else
    ``(None, why)`` (``why`` None: there is none): :func:`_verdict_holds`."""
    v = doc.get("x-estimate", "device_peak")
    size = v.size()
    if size is None or v.effective_source(True) not in ("CALCULATED", "ASSUMPTION") or cpu_estimate(doc):
        return None, None
    why = _verdict_holds(
        doc,
        lambda *keys: doc.get("x-estimate", "verdict", *keys),
        doc.get("x-estimate", "verdict", "device_memory").size(),
        doc.get("x-estimate", "outside_allocator").size(),
        f"{DEVICE_PEAK} was predicted",
        "run `ledgerspec estimate FILE` again",
    )
    return (None, why) if why else (size, None)


#: the per-rank estimate's device-level figure (``shard --estimate``): its worst rank's ``device_peak``
RANK_DEVICE_PEAK = f"{SHARD_ESTIMATE} (the worst rank's device_peak)"


def entry_of(mapping: Any, *keys: str) -> Value:
    """The value at ``keys`` in a mapping of the per-rank block as written (absent: an absent value)."""
    for key in keys:
        mapping = mapping.get(key) if isinstance(mapping, dict) else None
    return Value.of(mapping, present=mapping is not None)


def figure_of(value: Any) -> int | None:
    """A figure of the per-rank block as written (bytes, a size with a unit, or ``{value: ..., source: ...}``)."""
    return Value.of(value).size() if value is not None else None


def rank_rows(doc: Document) -> list[dict[str, Any]]:
    """The rows of the per-rank estimate (``parallelism.x-per-rank.estimate.ranks``) that hold a device-level peak
    (``shard --estimate`` with a device, for the CUDA target); [] when there are none or any is malformed."""
    block = doc.get(*SHARD_ESTIMATE.split(".")).raw
    if not isinstance(block, dict) or block.get("target") != "cuda" or block.get("source") != "CALCULATED":
        return []
    rows = block.get("ranks")
    if not isinstance(rows, list) or not rows:
        return []
    ok = all(
        isinstance(r, dict) and figure_of(r.get("device_peak")) is not None and isinstance(r.get("verdict"), dict)
        for r in rows
    )
    return rows if ok else []


def worst_rank(doc: Document) -> dict[str, Any] | None:
    """The per-rank estimate's row with the largest device-level peak (None: :func:`rank_rows` has none)."""
    rows = rank_rows(doc)
    return max(rows, key=lambda r: figure_of(r["device_peak"]) or 0) if rows else None


def rank_prediction(doc: Document) -> tuple[int | None, str | None]:
    """The worst rank's device-level peak of ``shard --estimate`` (:data:`RANK_DEVICE_PEAK`) when it holds for what
    a document of sharded ranks (:func:`~ledgerspec.contract.config.sharded_ranks`) declares now: ``(bytes,
    None)``; else ``(None, why)`` (``why`` None: there is none). It holds for ``parallelism.gpu_count`` ranks (the
    world ``shard`` simulated: ``parallelism.x-per-rank.world_size``) and for what :func:`_verdict_holds` checks,
    each rank's verdict."""
    gpus = sharded_ranks(doc)
    worst = worst_rank(doc)
    if gpus is None or worst is None:
        return None, None
    again = f"run `{shard_again(gpus)}` again"
    rows = rank_rows(doc)
    # the ranks launched (written since), else the block's world (a plan of the shard group), else the rows
    world = (
        doc.get(*SHARD_ESTIMATE.split("."), "world").integer()
        or doc.get("parallelism", "x-per-rank", "world_size").integer()
        or len(rows)
    )
    if world != gpus:
        return None, f"{SHARD_ESTIMATE} was simulated on {world} ranks, not parallelism.gpu_count {gpus}: {again}"
    judged = figure_of(doc.get(*SHARD_ESTIMATE.split("."), "device_memory").raw)
    for r in rows:
        why = _verdict_holds(
            doc,
            lambda *keys, r=r: entry_of(r, "verdict", *keys),
            judged,
            figure_of(r.get("outside_allocator")),
            f"{SHARD_ESTIMATE} was decided",
            again,
        )
        if why:
            return None, why
    return figure_of(worst["device_peak"]), None


def compared_total(doc: Document, target: int, peak_from: str | None) -> int:
    """The device total a peak is compared with: for the estimate's device-level peak (held for this device memory:
    :func:`device_prediction`), the card's CUDA total it was decided against (``x-estimate.verdict.cuda_total``:
    a named card's nominal memory is replayed against CUDA's own, lower total); else, and for a ledger estimated
    before that field, ``target`` (``result.target_device.memory``)."""
    if peak_from == DEVICE_PEAK:
        cuda_total = doc.get("x-estimate", "verdict", "cuda_total").size()
        if cuda_total is not None and cuda_total < target:
            return cuda_total
    if peak_from == RANK_DEVICE_PEAK and (worst := worst_rank(doc)) is not None:
        total = figure_of(worst["verdict"].get("cuda_total"))
        if total is not None and total < target:
            return total
    return target


def _uncertain_field(peak_from: str | None) -> str:
    """Where the at-the-edge flag of the peak compared is written."""
    return (
        f"{SHARD_ESTIMATE}.ranks[].verdict.uncertain"
        if peak_from == RANK_DEVICE_PEAK
        else "x-estimate.verdict.uncertain"
    )


def at_the_edge(doc: Document, peak_from: str | None) -> bool:
    """The peak compared is the estimate's device-level one and its verdict is at the edge
    (``x-estimate.verdict.uncertain``: the replay completes only with the outside-allocator catalogue's typical
    figure, not with the high end of its range): it does not fit, whatever its headroom."""
    if peak_from == RANK_DEVICE_PEAK:  # any rank at the edge: that rank does not fit
        return any(r["verdict"].get("uncertain") is True for r in rank_rows(doc))
    return peak_from == DEVICE_PEAK and doc.get("x-estimate", "verdict", "uncertain").value is True


def best_peak(doc: Document) -> tuple[int | None, str | None]:
    """The strongest available peak figure: measured (device, reserved, allocated; the protocol's, then a pilot
    run's), then the estimate's predicted device-level peak when it holds for the declared device
    (:func:`device_prediction`), else its predicted allocated peak. Never a sum of ledger components: a peak has
    temporaries a sum does not hold (logits and loss in fp32, attention workspaces, dequantized weights), and an
    assumed ``temporary`` added to the sum is the "subtotal + overhead" shortcut the method refuses."""
    pilot = pilot_section(doc)
    for section, key in (
        ("metrics", "device_peak"),
        ("metrics", "peak_reserved"),
        ("metrics", "peak_allocated"),
        ("phases", "steady_state_peak"),
        (pilot, "device_peak"),
        (pilot, "peak_reserved"),
        (pilot, "peak_allocated"),
    ):
        v = doc.get(section, key)
        if v.source == "MEASURED" and v.size() is not None:
            return v.size(), f"{section}.{key} (MEASURED)"
    ranked, _ = rank_prediction(doc)  # several GPUs: what one rank holds, where shard --estimate predicted it
    if ranked is not None:
        return ranked, RANK_DEVICE_PEAK
    device, _ = device_prediction(doc)
    if device is not None:
        return device, DEVICE_PEAK
    est = doc.get("x-estimate", "peak_allocated")
    if est.source in EXACT_SOURCES and est.size() is not None and not cpu_estimate(doc):
        return est.size(), ALLOCATED_PEAK
    return None, None


_PILOT_PEAKS = ("peak_allocated", "peak_reserved", "device_peak")


def cpu_estimate(doc: Document) -> bool:
    """``x-estimate`` modelled the CPU's kernels (``estimate --target cpu``, for checks): no GPU's peak."""
    return doc.get("x-estimate", "target").text() == "cpu"


def pilot_section(doc: Document) -> str:
    """Where a pilot run's figures are: ``pilot`` in an intake; ``x-pilot`` in a ledger (the ledger has no pilot
    section: ``resolve -o`` and ``init --from`` both keep the intake's pilot there, as written)."""
    return "pilot" if doc.kind == "intake" else "x-pilot"


def _activation_figure(doc: Document) -> bool:
    """A CALCULATED estimate or a MEASURED pilot (spec: CANDIDATE): a measured peak (a pilot's, or one in
    ``metrics``) includes the activations of the run it measured."""
    act = doc.get("ledger", "activations")
    if act.source in ("CALCULATED", "MEASURED") and act.size() is not None:
        return True
    return any(
        doc.get(section, k).source == "MEASURED" and doc.get(section, k).size() is not None
        for section in {pilot_section(doc), "metrics"}
        for k in _PILOT_PEAKS
    )


def _shown_value(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "<a very large number>"
    return text if len(text) <= 40 else text[:37] + "..."


def supported_status(doc: Document) -> StatusResult:
    """The highest status the evidence supports, with the reasons that hold it down."""
    gaps = minimum_intake_gaps(doc)
    res = StatusResult(LADDER[0], intake_complete=not gaps)
    res.best_peak, res.best_peak_from = best_peak(doc)
    if gaps:
        res.reasons = [f"minimum intake: {g}" for g in gaps]
        return res
    if doc.kind == "intake":
        res.reasons = ["an intake holds no ledger figures: `ledgerspec resolve FILE -o LEDGER` turns it into a ledger"]
        return res

    # -- CALCULATED -------------------------------------------------------------------------------
    weak = []
    for key in F.RESIDENT:
        v = doc.get("ledger", key)
        src = v.effective_source(True)
        if not v.present:
            weak.append(f"ledger.{key} is missing")
        elif src not in EXACT_SOURCES or v.unknown:
            weak.append(f"ledger.{key} is {src}")
        elif v.size() is None:  # CALCULATED (or stronger) but no size: nan, inf, -1 GiB, a word
            weak.append(f"ledger.{key} is {src} but its value {_shown_value(v.value)} is not a size in bytes")
    weak += stale_evidence(doc, "CALCULATED")  # figures of since-edited inputs (LS006)
    if weak:
        res.reasons = [f"CALCULATED needs exact figures: {w}" for w in weak]
        return res
    res.status = "CALCULATED"

    # -- CANDIDATE --------------------------------------------------------------------------------
    held: list[str] = []
    target = doc.get("result", "target_device", "memory").size()
    if target is None:
        held.append("CANDIDATE needs result.target_device.memory")
    if not _activation_figure(doc):
        held.append(
            "CANDIDATE needs an activation figure: ledger.activations CALCULATED (ledgerspec estimate) "
            "or MEASURED, or a MEASURED peak (a pilot's, or metrics)"
        )
    if res.best_peak is None and cpu_estimate(doc):
        held.append(
            "CANDIDATE needs a peak figure: x-estimate models the CPU's kernels (`estimate --target cpu`, "
            "for checks); `ledgerspec estimate FILE` predicts the GPU's"
        )
    elif res.best_peak is None:
        held.append(
            "CANDIDATE needs a peak figure: a predicted peak (`ledgerspec estimate FILE` writes "
            "x-estimate) or a MEASURED one (metrics or a pilot); a sum of ledger components is not a peak"
        )
    elif target is not None and res.best_peak > (limit := compared_total(doc, target, res.best_peak_from)):
        pilot = (
            " (a pilot run's: remove x-pilot if it measured another configuration)"
            if (res.best_peak_from or "").startswith("x-pilot.")
            else ""
        )
        held.append(
            f"best peak ({res.best_peak_from}) = {res.best_peak} B does not fit the target device ({limit} B"
            + (f", its CUDA total; declared {target} B" if limit != target else "")
            + f"){pilot}"
        )
    ranked = res.best_peak_from == RANK_DEVICE_PEAK
    if at_the_edge(doc, res.best_peak_from):
        measure = "ledgerspec measure --device cuda" + (f" --nproc {sharded_ranks(doc)}" if ranked else "")
        held.append(
            f"the device verdict is {F.AT_THE_EDGE}, so it does not fit ({_uncertain_field(res.best_peak_from)}): "
            f"{F.EDGE_WHY}, "
            "not with the catalogue's high end; measure "
            f"outside_allocator (`{measure}`) or leave more headroom"
        )
    elif doc.get("result", "fits").switch() is False and not ranked:
        # the per-rank verdict holds for the inputs it read (its stamp): a result.fits an earlier one-GPU estimate
        # of the whole model wrote is not the ranks' answer
        held.append("result.fits is false")
    pilot_oom = doc.get(pilot_section(doc), "oom_phase").text()
    if pilot_oom:
        held.append(
            f"the pilot run ran out of memory in phase {pilot_oom} ({pilot_section(doc)}.oom_phase): it "
            "does not show that this configuration fits; measure it on the target device"
        )
    if doc.get("result", "oom").switch() is True:
        phase = doc.get("result", "oom_phase").text()
        where = f"in phase {phase}" if phase else "(result.oom_phase not recorded)"
        held.append(
            f"result.oom is true: the run ran out of memory {where}; change the configuration "
            "(see `ledgerspec triage FILE`) or the target device"
        )
    held += stale_evidence(doc, "CANDIDATE", res.best_peak_from)
    held += [
        f"CANDIDATE needs figures of the declared stack: {d.message()}; accept it in "
        f"software.accepted_differences or compute on the declared stack"
        for d in stack_differences(doc, read(doc).accepted_differences)
        if not d.accepted
    ]
    held += _unmodelled_kernels(doc, res.best_peak_from)
    training = read(doc).training
    if not training.simulated and res.best_peak_from is not None and "MEASURED" not in res.best_peak_from:
        held.append(
            f"CANDIDATE needs a prediction of the declared step: training.objective {training.objective} is not "
            "simulated (LS014); measure the run"
        )
    if held:
        res.reasons = held
        return res
    res.status = "CANDIDATE"

    # -- VALIDATED --------------------------------------------------------------------------------
    held = [f"ASSUMPTION in an intake field caps the status at CANDIDATE: {p}" for p in assumption_inputs(doc)]
    held += validated_gaps(doc)
    held += stale_evidence(doc, "VALIDATED")
    if held:
        res.reasons = held
        return res
    res.status = "VALIDATED"
    return res


def _unmodelled_kernels(doc: Document, peak_from: str | None) -> list[str]:
    """A predicted peak is not the declared step's when a declared kernel is not modelled (rule LS013); a measured
    peak ran the kernels themselves."""
    from ledgerspec.contract.kernels import is_modelled

    if peak_from is None or "MEASURED" in peak_from:
        return []
    kernels = read(doc).kernels
    names = [name for op, name in kernels.declared() if not is_modelled(op, name)]
    names += list(kernels.other)
    if not names:
        return []
    return [
        f"CANDIDATE needs a prediction of the declared step: the estimate does not model {', '.join(names)} "
        "(software.kernels, LS013); measure the run, or declare the kernels the estimate models"
    ]


def validated_gaps(doc: Document) -> list[str]:
    gaps: list[str] = []
    device = doc.get("measurement", "device").text()
    if device == "cpu":
        gaps.append("measurement.device is cpu: a CPU run never validates GPU memory")
    elif device is None:
        gaps.append("VALIDATED needs measurement.device: cuda (a measurement on the GPU)")
    generates = read(doc).training.objective in GENERATING
    for _, f in F.walk(F.PHASES.children, ("phases",)):
        if f.name in F.GENERATION_PHASES and not generates:  # a phase of the online-RL step only
            continue
        if doc.get("phases", f.name).source != "MEASURED":
            gaps.append(f"VALIDATED needs phases.{f.name} MEASURED")
    for key in ("peak_allocated", "peak_reserved", "device_peak"):
        if doc.get("metrics", key).source != "MEASURED":
            gaps.append(f"VALIDATED needs metrics.{key} MEASURED")
    if doc.get("result", "oom").switch() is not False:
        gaps.append("VALIDATED needs result.oom: false")
    steps = doc.get("measurement", "steps").integer()
    if steps is None or steps < 2:
        gaps.append("VALIDATED needs measurement.steps >= 2 (repeated representative steps)")
    needed = ["torch", "transformers", "peft"]
    config = read(doc)
    if config.quantized or config.optimizer.bitsandbytes:
        needed.append("bitsandbytes")
    for key in needed:
        if doc.get("software", key).unknown:
            gaps.append(f"VALIDATED needs software.{key}")
    if doc.get("software", "cuda").unknown and doc.get("software", "rocm").unknown:
        gaps.append("VALIDATED needs software.cuda or software.rocm")
    if not doc.section("comparison") or doc.get("comparison", "known_explanation").unknown:
        gaps.append("VALIDATED needs comparison filled, with known_explanation")
    for path, f, v in input_fields(doc):
        if f.kind != F.OBJECT and v.present and v.unknown:
            gaps.append(f"VALIDATED needs no UNKNOWN in the intake: {dotted(path)}")
    if doc.get("memory_options", "activation_offload").switch():
        for key in ("host_peak", "step_time_s"):
            if doc.get("metrics", key).source != "MEASURED":
                gaps.append(f"activation offload: VALIDATED needs metrics.{key} MEASURED")
    gpus = doc.get("parallelism", "gpu_count").integer()
    if gpus is not None and gpus > 1:
        peaks = doc.get("parallelism", "per_rank_peak")
        items = peaks.raw if peaks.form == "plain" and isinstance(peaks.raw, list) else []
        measured = [Value.of(i) for i in items if Value.of(i).source == "MEASURED"]
        if len(items) != gpus or len(measured) != gpus:
            gaps.append(f"gpu_count {gpus}: VALIDATED needs one MEASURED parallelism.per_rank_peak per rank")
    return gaps
