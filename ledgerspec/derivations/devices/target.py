"""Which device a verdict is asked for, and what lies outside the caching allocator on it.

:func:`target_of` names the device of a ledger and a memory size (``result.target_device.name``, the device catalogue's
entry nearest to the size, or ``software.gpu_name``) and :func:`cuda_total_of` gives the total its allocator can ever
get (CUDA's own, below a catalogue card's nominal memory). :func:`outside_of` gives what one rank holds outside the
allocator there: the ledger's ``outside_allocator.total`` when it holds one for that rank and card
(:func:`held_elsewhere`), else the outside catalogue's figure (:mod:`ledgerspec.derivations.devices.outside`), plus
colocated vLLM's share of the card (:func:`vllm_share_of`); :func:`high_of` the high end of the catalogue's range
behind it. The verdict itself is :mod:`ledgerspec.derivations.devices.prediction`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.fields import OUTSIDE_PARTS
from ledgerspec.contract.units import format_size, parse_size
from ledgerspec.derivations.devices import outside

#: how near a catalogue device's total (or its vendor memory) must be to the asked memory to name it
NAME_TOLERANCE = 0.01


@dataclass(frozen=True)
class Target:
    """The device a verdict is asked for: its total (bytes, as PyTorch reports it), its name and how it was named."""

    total: int
    name: str | None
    #: ``result.target_device.name``, ``catalogue``, ``software.gpu_name`` or ``none``
    named_by: str
    #: how, in words
    how: str = ""
    #: the total the caching allocator can ever get (CUDA's own, ``cudaMemGetInfo``; see :func:`cuda_total_of`):
    #: ``total`` unless the declared memory is the named catalogue device's nominal one (0: ``total``)
    cuda_total: int = 0
    #: how ``cuda_total`` was chosen, in one phrase ("an A100 80GB's CUDA total is 79.25 GiB, not the declared
    #: 80.00 GiB"); empty when it is ``total``
    cuda_note: str = ""

    def __post_init__(self) -> None:
        if self.cuda_total <= 0:
            object.__setattr__(self, "cuda_total", self.total)


def _article(short: str) -> str:
    """ "a" or "an" before a device's short name (letters read out: an A100, an H100, an RTX 4090, a GeForce)."""
    head = short[:1].upper()
    acronym = len(short) > 1 and (short[1].isdigit() or short[1].isupper())
    vowel_sound = head in "AEIOU" or (acronym and head in "FHLMNRSX")
    return "an" if vowel_sound else "a"


def cuda_total_of(total: int, name: str | None, catalogue: Any = None) -> tuple[int, str]:
    """The device total the caching allocator can ever get, for a declared ``total`` on the device ``name``, and
    the phrase that says so. PyTorch's allocator gets its segments from ``cudaMalloc`` and reports the device's
    total as ``cudaMemGetInfo``'s (c10/cuda/CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``: the
    out-of-memory message's "total capacity"), which is below nvidia-smi's total and the vendor's size. When
    ``name`` is a catalogue entry (:func:`~ledgerspec.derivations.devices.catalogue.device_named`) and ``total`` is
    that entry's nominal memory (its nvidia-smi total, or its vendor memory in GB or GiB), the entry's ``capacity``
    (``total`` where the catalogue gives none, said); else ``total`` as it is (a MIG slice, ``--device-memory
    20GiB``): ``(total, "")``."""
    from ledgerspec.derivations.devices.catalogue import device_named, load_catalogue

    if not name:
        return total, ""
    devices = (catalogue if catalogue is not None else load_catalogue()).devices
    device = device_named(name, devices)
    if device is None or total not in device.nominal():
        return total, ""
    short = device.name.removeprefix("NVIDIA ").removeprefix("AMD ").removeprefix("GeForce ")
    if device.capacity_assumed:
        return total, (
            f"ASSUMPTION: {_article(short)} {short}'s CUDA total is taken as the declared {format_size(total)}: the "
            "device catalogue gives no capacity for it (CUDA's own total is a little lower)"
        )
    if device.capacity == total:
        return total, ""
    return device.capacity, (
        f"{_article(short)} {short}'s CUDA total is {format_size(device.capacity)}, not the declared "
        f"{format_size(total)}"
    )


def catalogue_match(total: int, catalogue: Any = None) -> tuple[Any, list[str], list[str]] | None:
    """The device catalogue's entry (the built-in one unless ``catalogue`` is given) whose total (as PyTorch reports
    it) or vendor memory is nearest to ``total`` within :data:`NAME_TOLERANCE`, the names of the other entries as
    near, and those of the others within the tolerance; None: none is."""
    from ledgerspec.contract.units import UnitError
    from ledgerspec.derivations.devices.catalogue import load_catalogue

    found: list[tuple[float, int, Any]] = []
    for i, device in enumerate((catalogue if catalogue is not None else load_catalogue()).devices):
        sizes = [device.total]
        try:
            sizes.append(parse_size(device.vendor_memory))
        except UnitError:
            pass
        distance = min(abs(s - total) / total for s in sizes)
        if distance <= NAME_TOLERANCE:
            found.append((distance, i, device))
    if not found:
        return None
    found.sort(key=lambda f: (f[0], f[1]))
    best = found[0]
    return (
        best[2],
        [d.name for dist, _, d in found[1:] if dist == best[0]],
        [d.name for dist, _, d in found[1:] if dist != best[0]],
    )


def target_of(doc: Document, total: int, from_flag: bool = False, catalogue: Any = None) -> Target:
    """Name the device of ``total`` bytes: ``result.target_device.name`` (unless ``--device-memory`` asked about
    another size than the ledger's target), else the device catalogue's entry whose total or vendor memory matches
    (within 1 %, the nearest), else ``software.gpu_name``, else unnamed (the outside catalogue's unknown-GPU
    figure); and the total its caching allocator can get (:func:`cuda_total_of`). ``catalogue``: a
    :class:`~ledgerspec.derivations.devices.catalogue.Catalogue` instead of the built-in one."""
    named = _named(doc, total, from_flag, catalogue)
    cuda_total, note = cuda_total_of(total, named.name, catalogue)
    return replace(named, cuda_total=cuda_total, cuda_note=note)


def _named(doc: Document, total: int, from_flag: bool, catalogue: Any) -> Target:
    name = doc.get("result", "target_device", "name").text()
    declared = doc.get("result", "target_device", "memory").size()
    if name and name.strip() and (not from_flag or declared is None or declared == total):
        return Target(total, name.strip(), "result.target_device.name", "result.target_device.name")
    gpu = doc.get("software", "gpu_name").text()
    if gpu and gpu.strip() and _is_nominal_of(gpu, total, catalogue):  # the declared card, at its own memory
        return Target(total, gpu.strip(), "software.gpu_name", "software.gpu_name (a catalogue card at its memory)")
    match = catalogue_match(total, catalogue)
    if match is not None:
        device, others, near = match
        named = "--device-memory 'NAME'" if from_flag else "result.target_device.name"
        also = f"; as near: {', '.join(others)} (to decide on one of them, name it: {named})" if others else ""
        also += f"; also within {NAME_TOLERANCE:.0%}: {', '.join(near)}" if near else ""
        return Target(
            total,
            device.name,
            "catalogue",
            f"the device catalogue's entry nearest to {format_size(total)} ({format_size(device.total)} as PyTorch "
            f"reports it, {device.vendor_memory} as sold{also})",
        )
    if gpu and gpu.strip():
        return Target(total, gpu.strip(), "software.gpu_name", "software.gpu_name")
    return Target(total, None, "none", "nothing: no result.target_device.name, catalogue entry or software.gpu_name")


def _is_nominal_of(name: str, total: int, catalogue: Any) -> bool:
    """Whether ``name`` is a catalogue card and ``total`` its nominal memory (an H100 declared on 80 GiB is the H100,
    not the A100 80GB that the memory alone would name)."""
    from ledgerspec.derivations.devices.catalogue import device_named, load_catalogue

    device = device_named(name, (catalogue if catalogue is not None else load_catalogue()).devices)
    return device is not None and total in device.nominal()


def outside_of(
    doc: Document, target: Target, world: int | None = None, paged_state: int | None = None
) -> outside.Figure:
    """The bytes this rank holds outside the caching allocator on ``target``: the ledger's
    ``outside_allocator.total`` when it holds one, else the outside catalogue's estimate for the declared stack on
    the named device with the parts the ledger holds in place of the catalogue's
    (:func:`ledgerspec.derivations.devices.outside.with_declared`; ``world``: the ranks it runs on, when
    not the ledger's ``parallelism.gpu_count``, e.g. ``shard --nproc``; ``paged_state``: a paged optimizer's state
    bytes, when not the ledger's ``ledger.optimizer``); plus colocated vLLM's share of the card
    (:func:`vllm_share_of`), which the training step's allocator cannot get either. What the ledger holds is of its
    own ranks on its own card: asked about another GPU count or another GPU architecture (a ``--devices`` row,
    ``shard --nproc``, ``--device-memory`` naming another card), the catalogue's figure for the rank asked about, and
    the method says why (:func:`held_elsewhere`)."""
    elsewhere = held_elsewhere(doc, target, world)
    v = doc.get("outside_allocator", "total")
    size = v.size()
    if size is not None and elsewhere is None:
        why = " ".join((v.note or v.method or "").split())
        return _with_vllm(
            doc,
            target,
            outside.Figure(size, v.effective_source(True), "outside_allocator.total" + (f" ({why})" if why else "")),
        )
    stack = replace(outside.stack_of(doc), gpu_name=target.name)
    if world is not None:
        stack = replace(stack, world_size=world)
    if paged_state is not None and stack.paged:
        stack = replace(stack, paged_state=paged_state)
    est = outside.estimate(stack)
    if elsewhere is None:
        est = outside.with_declared(est, doc)
    reason = elsewhere or ""
    method = est.method() + (f"; {reason}" if reason else "")
    return _with_vllm(doc, target, outside.Figure(est.typical, est.provenance, method, est, elsewhere=reason))


def _holds_any(doc: Document) -> bool:
    return any(doc.get("outside_allocator", k).size() is not None for k in ("total", *OUTSIDE_PARTS))


def held_elsewhere(doc: Document, target: Target, world: int | None = None) -> str | None:
    """Why what the ledger holds in ``outside_allocator`` is not this rank's (None: it is, or it holds nothing): it
    was measured (or declared) for the ledger's own GPU count and device. A device of another memory than the
    ledger's ``result.target_device.memory`` (a ``--devices`` row, ``--device-memory``) is another card when its
    GPU architecture is known and differs from the ledger's card's (``measurement.device_name`` of a CUDA
    measurement, else ``software.gpu_name``, else ``result.target_device.name``); another count changes NCCL's
    buffers, another architecture the CUDA context and its modules."""
    if not _holds_any(doc):
        return None
    own_world = outside.stack_of(doc).world_size
    if world is not None and world != own_world:
        return (
            f"the ledger's outside_allocator is of {own_world} rank(s), not {world}: the catalogue's figure for "
            f"{world} instead"
        )
    if target.total == doc.get("result", "target_device", "memory").size():
        return None  # the ledger's own device, however it is named
    measured = doc.get("measurement", "device_name").text() if doc.get("measurement", "device").text() == "cuda" else ""
    own = next(
        (
            t.strip()
            for t in (
                measured,
                doc.get("software", "gpu_name").text(),
                doc.get("result", "target_device", "name").text(),
            )
            if t and t.strip()
        ),
        None,
    )
    if own is None or not target.name:
        return None
    mine, theirs = outside.architecture(own)[0], outside.architecture(target.name)[0]
    if mine == theirs or "unknown" in (mine, theirs):
        return None
    return (
        f"the ledger's outside_allocator is of {own} ({mine}), not {target.name} ({theirs}): the catalogue's figure "
        "for that card instead"
    )


def stated(
    doc: Document, target: Target, figure: outside.Figure, optimizer_state: int | None, world: int | None = None
) -> outside.Figure:
    """``figure`` with a paged optimizer's state taken from the estimate the verdict is computed with
    (``optimizer_state``: its optimizer component, the bytes ``resolve`` writes to ``ledger.optimizer``; a sharded
    rank's own share under ``shard --estimate``): the catalogue's high end counts that state as possibly resident on
    the device, and the ledger's figure is absent in an intake, another configuration's in a sweep's variant and the
    whole model's where each rank holds a shard. The typical figure, and so the capacity, is unchanged (a paged
    state's typical residency is 0); a figure the ledger declares is kept as it is. ``world``: as
    :func:`outside_of`'s."""
    if figure.estimate is None or optimizer_state is None:
        return figure
    stack = outside.stack_of(doc)
    if not stack.paged or stack.paged_state == optimizer_state:
        return figure
    return outside_of(doc, target, world, paged_state=optimizer_state)


def vllm_share_of(doc: Document, target: Target) -> int:
    """The bytes colocated vLLM holds on ``target`` for the whole run (0 when there is none): GRPO/RLOO with
    ``use_vllm`` in ``colocate`` mode (TRL 1.16's default mode, grpo_config.py:594-595) without sleep mode. vLLM
    sizes its instance to ``gpu_memory_utilization`` x the device's total memory (``requested_memory``,
    vllm/v1/worker/gpu_worker.py ``init_device``: ``cudaMemGetInfo``'s total, the allocator's capacity here; its
    weights, activation peak and KV cache fill it: ``determine_available_memory``) before training starts, and holds
    it in segments of its own that the training step never gets back; TRL's default share is 0.3
    (grpo_config.py:656-657). With ``vllm_enable_sleep_mode`` TRL puts the engine to sleep at level 2 after every
    generation (generation/vllm_generation.py:365-366, 750-751): its weights and KV cache, allocated in vLLM's
    ``CuMemAllocator`` pool, are unmapped, so the training step does not share the card with them (0 here)."""
    from ledgerspec.contract import config

    t = config.read(doc).training
    if t.objective not in config.GENERATING or t.vllm_mode != "colocate" or t.vllm_enable_sleep_mode:
        return 0
    return int(t.vllm_share * target.cuda_total)


def _with_vllm(doc: Document, target: Target, figure: outside.Figure) -> outside.Figure:
    share = vllm_share_of(doc, target)
    if not share:
        return figure
    return replace(
        figure,
        bytes=figure.bytes + share,
        method=f"{figure.method}; plus colocated vLLM's share of the card, {format_size(share)}",
        vllm=share,
    )


def high_of(figure: outside.Figure) -> int | None:
    """The high end of the outside-allocator catalogue's range behind ``figure`` (None: a figure the ledger holds,
    measured or declared, has no range here), colocated vLLM's share included."""
    return figure.estimate.high + figure.vllm if figure.estimate is not None else None


__all__ = [
    "NAME_TOLERANCE",
    "Target",
    "catalogue_match",
    "cuda_total_of",
    "held_elsewhere",
    "high_of",
    "outside_of",
    "stated",
    "target_of",
    "vllm_share_of",
]
