"""What every per-rank simulation shares, FSDP's (:mod:`.fsdp.simulate`) and DeepSpeed ZeRO's (:mod:`.zero.simulate`).

- :class:`RankEstimate` and :class:`ShardEstimate`: one rank's predicted phases, and every rank's with the method;
- :func:`add_sides`: a rank's device and host figures under CPU offload, beside its totals;
- :func:`fake_process_group`: a fake default process group of ``W`` ranks, this process being one of them;
- :func:`prepare_trace`: the target, intake, workload, attention, model config and trace plan, checked and read;
- :func:`probe_runner`: a rank's figures at the model's depth, from two probe depths or the full one;
- :func:`stream_runner`: a rank's allocation stream at the model's depth (for the allocator model's replay), each
  allocation on the stream it was made on (:func:`stream_numbers`), with the same figures;
- :func:`extension_block`: the ``estimate`` block of ``parallelism.x-per-rank``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, ErrorAt
from ledgerspec.derivations.estimate.extrapolate import Plan
from ledgerspec.derivations.estimate.fit import ALL_PHASES, PHASES, Fit, fit
from ledgerspec.errors import LedgerspecError

#: a progress line's receiver
Progress = Callable[[str], None]
#: the model-state components of a rank's figures
COMPONENTS = F.RESIDENT

_err = ErrorAt("shard")


@dataclass
class RankEstimate:
    """One rank's predicted phases (bytes allocated by PyTorch tensors)."""

    rank: int
    phases: dict[str, int]
    activations: int  # held after the first forward, less the parameters FSDP2 keeps gathered into backward
    components: dict[str, int]
    simulated_as: int  # the rank whose simulation these figures are (same local rows for every parameter)
    #: with CPU offload (issue 16): ``phases`` are the device's; what the host holds per phase, both sides together
    #: (what a CPU-only run counts), and the host's peak over the whole step
    host_phases: dict[str, int] | None = None
    total_phases: dict[str, int] | None = None
    host_peak: int | None = None
    #: the rank's allocation stream at full depth (:class:`ledgerspec.derivations.allocator.step.StepEvents`), when
    #: the device-level verdict was asked for (:func:`stream_runner`); shared by the ranks simulated as one
    step: Any = None

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @classmethod
    def of(cls, rank: int, figures: dict[str, int], activations: int, components: dict[str, int], rep: int) -> Any:
        """Rank ``rank`` from the simulated ``figures`` of rank ``rep``: with offload (:func:`add_sides`) the device's
        phases, the host's and the totals beside them."""
        names = [k for k in ALL_PHASES if k in PHASES or k in figures]  # GRPO/RLOO: generation_peak too
        if "host_peak" not in figures:
            return cls(rank, {k: figures[k] for k in names}, activations, components, rep)
        return cls(
            rank,
            {k: figures[f"device.{k}"] for k in names},
            activations,
            components,
            rep,
            host_phases={k: figures[f"host.{k}"] for k in names},
            total_phases={k: figures[k] for k in names},
            host_peak=figures["host_peak"],
        )


def add_sides(out: dict[str, int], sides: dict[str, tuple[int, int]], tracker: Any) -> None:
    """A simulated rank's ``{phase: (device, host)}`` (:func:`.offload.sides.recording_sides`)
    and its split tracker's host peak, into its figures as ``device.PHASE``, ``host.PHASE`` and ``host_peak``."""
    for name, (device, host) in sides.items():
        out[f"device.{name}"], out[f"host.{name}"] = device, host
    out["host_peak"] = tracker.host_max


@dataclass
class ShardEstimate:
    world_size: int
    reshard_after_forward: bool | None
    target: str
    ranks: list[RankEstimate]
    plan: Plan
    method: str
    seconds: float
    notes: list[str] = field(default_factory=list)
    strategy: str = "fsdp2"  # or fsdp1 (parallelism.strategy)

    @property
    def worst(self) -> int:
        return max(r.peak for r in self.ranks)

    #: each rank's prediction on the device (:class:`ledgerspec.derivations.devices.prediction.DevicePrediction`),
    #: in rank order, when the verdict was decided on the device (:mod:`ledgerspec.derivations.devices.per_rank`)
    device: list[Any] | None = None
    #: why the verdict compares allocated tensors only (None: it is decided on the device, or no device was asked)
    allocated_only: str | None = None

    def fits(self, device_memory: int) -> list[Fit]:
        """Each rank's verdict for ``device_memory``: on the device (the allocator model's replay plus what lies
        outside it) when :attr:`device` holds one for that memory, else the allocated phases against it."""
        if self.device is not None and all(d.total == device_memory for d in self.device):
            return [device_fit(d) for d in self.device]
        return [fit(r.phases, device_memory) for r in self.ranks]


def device_fit(d: Any) -> Fit:
    """A :class:`~ledgerspec.derivations.devices.prediction.DevicePrediction` as a :class:`Fit`: the device-level
    peak against the device's CUDA total, the first out-of-memory phase of the replay against its capacity (none at
    the edge: it does not fit with a headroom of at least 0)."""
    from ledgerspec.derivations.estimate.fit import OOM_PHASE

    key = d.oom.phase if d.oom is not None else None
    return Fit(d.cuda_total, d.device_peak, d.fits, d.margin, OOM_PHASE.get(key, key) if key else None, key)


@contextlib.contextmanager
def device_waits(backend: Any, numbers: Any, reads_loss: bool) -> Iterator[None]:
    """What a simulated rank's event log needs besides its allocations for the replay to free blocks when a GPU
    would: FSDP1's ``record_stream`` calls (``_no_dispatch_record_stream``, a no-op for CPU tensors; on a GPU the
    unsharded flat parameter freed on the compute stream and the gradient handed to the post-backward stream go back
    to the pool only once the other stream has used them: the tracker logs their frees as pending), and the points
    where the host waits for the device: FSDP1's rate limiter (``limit_all_gathers``: before each all-gather,
    ``event.synchronize()`` on the free event two reshards back, ``_runtime_utils._unshard``; every pending free
    before that event's ``record()`` has completed) and, with ``reads_loss``, the loss read on the host after each
    micro-step's backward: transformers' Trainer checks it (``torch.isnan(tr_loss_step) or
    torch.isinf(tr_loss_step)`` in a boolean context with ``logging_nan_inf_filter``, the default, trainer.py), and a
    hand-written loop does when it declares ``training.loss_item_each_step`` (Answer.AI's ``fsdp_qlora`` train.py:
    ``ddp_loss[0] += loss.item() * bs`` right after ``backward``, 50efa1e): the device has finished the micro-step.
    Without that wait the replay of a 2-GPU FSDP1 LoRA step of that script kept backward's pending frees into the
    optimizer step: peak reserved 10.64 GiB, where the script's own log shows 10.24 and the replay with it 10.15
    (``benchmarks/results/device-answerai.md``)."""
    import torch
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.distributed.fsdp._runtime_utils as runtime_utils

    tracker = backend.tracker

    def record_stream(tensor: Any, stream: Any) -> None:
        tracker.record_stream(tensor.untyped_storage(), numbers.of(stream))

    class Event(torch.cpu.Event):
        """``torch.cpu.Event`` (no-ops), noting how many pending frees were logged when it was recorded."""

        before: int | None = None

        def record(self, stream: Any = None) -> None:
            self.before = tracker.pending_frees

        def synchronize(self) -> None:
            if self.before is not None:
                tracker.sync(tracker.pending_frees - self.before)

    reset_peak = backend.reset_peak

    def reset_with_check() -> None:
        if reads_loss and backend.windows and backend.windows[-1].endswith(":temporary"):
            tracker.sync(0)  # the loss read after each micro-step's backward (the Trainer's check, loss.item())
        reset_peak()

    saved = (flat_param._no_dispatch_record_stream, runtime_utils._no_dispatch_record_stream, torch.cpu.Event)
    flat_param._no_dispatch_record_stream = record_stream
    runtime_utils._no_dispatch_record_stream = record_stream
    torch.cpu.Event = Event  # type: ignore[misc]
    backend.reset_peak = reset_with_check
    try:
        yield
    finally:
        flat_param._no_dispatch_record_stream, runtime_utils._no_dispatch_record_stream = saved[:2]
        torch.cpu.Event = saved[2]  # type: ignore[misc]
        backend.reset_peak = reset_peak


class StreamNumbers:
    """Streams as small numbers, for the event log of a simulated rank (see :func:`stream_numbers`)."""

    def __init__(self) -> None:
        import torch

        self._numbers = {id(torch.cpu.current_stream()): 0}
        self._keep: list[Any] = []  # the stream objects, so that an id is never reused while numbered

    def of(self, stream: Any) -> int:
        n = self._numbers.get(id(stream))
        if n is None:
            n = self._numbers[id(stream)] = len(self._numbers)
            self._keep.append(stream)
        return n

    def __call__(self) -> int:
        import torch

        return self.of(torch.cpu.current_stream())


def stream_numbers() -> StreamNumbers:
    """The current stream as a small number, for the event log of a simulated rank: 0 for the default stream, then
    1, 2, ... in the order FSDP first allocates on its streams (FSDP1's unshard and post-backward streams, FSDP2's
    all-gather copy-in, all-gather and reduce-scatter streams). The simulation runs on the CPU device, where
    ``torch.cpu.stream(s)`` sets the stream ``torch.cpu.current_stream()`` returns exactly as FSDP's
    ``device_handle.stream(s)`` does on CUDA; the caching allocator keeps a pool per stream, so the replay needs
    them apart."""
    return StreamNumbers()


def recorded(backend: Any, spec: Any, source: Any, figures: dict[str, int]) -> Any:
    """The allocation stream a simulated rank's event backend (:func:`ledgerspec.derivations.allocator.step.
    _event_backend_class`) logged, as :class:`~ledgerspec.derivations.allocator.step.StepEvents`."""
    from ledgerspec.derivations.allocator.step import StepEvents
    from ledgerspec.derivations.estimate.extrapolate import layer_count

    backend.close_window()
    events = backend.tracker.events
    assert events is not None
    depth = layer_count(source.config)
    return StepEvents(
        list(events),
        list(backend.windows),
        min(spec.accumulation, 2),
        figures,
        backend.window_figures,
        depth,
        f"traced with {depth} decoder layers",
    )


@contextlib.contextmanager
def fake_process_group(rank: int, world: int) -> Iterator[None]:
    """A fake default process group of ``world`` ranks, this process being ``rank`` (no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def generation_refused(doc: Document, vllm: str | None) -> str | None:
    """Where GRPO/RLOO's step (``vllm``: its ``GenerationSpec.vllm``) runs instead of these ranks, for the refusal's
    hint, or None when it runs here. Its generation on several ranks runs under every strategy, each gathering what
    TRL gathers for ``generate`` (the workload's ``generating``: FSDP2's registered forward method, FSDP1's
    ``summon_full_params(recurse=False)``, ZeRO-3's ``GatheredParameters``). vLLM's weight sync runs under DeepSpeed
    ZeRO (ZeRO-3: every parameter gathered for PEFT's merge, TRL's ``gather_params``) and FSDP2 (PEFT's merge into the
    sharded weights, then each parameter's ``full_tensor()``: the workload's ``synced``); under FSDP1 it is refused:
    TRL merges the adapters into FSDP1's sharded views first, which fails in a real run (``GENERATION_SHARDED``)."""
    from ledgerspec.derivations.shard.options import is_fsdp1

    return "one device, FSDP2 ranks or DeepSpeed ZeRO" if vllm is not None and is_fsdp1(doc) else None


def prepare_trace(
    doc: Document, target: str, layers: str, offline: bool, refuse: Callable[[Any], None]
) -> tuple[Any, Any, Plan]:
    """What every per-rank simulation checks and reads first: the target, the intake, the workload (``refuse``
    raises for a workload the strategy cannot run), the attention, the model config and the trace plan (``layers``:
    ``auto`` or ``full``). Returns the workload spec, the model source and the plan."""
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.estimate import estimator as E
    from ledgerspec.derivations.estimate.extrapolate import plan
    from ledgerspec.derivations.stack.build import load_config

    if target not in E.TARGETS:
        raise ValueError(f"target must be one of {E.TARGETS}")
    E._check_intake(doc)
    spec = WorkloadSpec.from_document(doc)
    elsewhere = generation_refused(doc, spec.generation.vllm) if spec.generation is not None else None
    if elsewhere is not None:
        from ledgerspec.derivations.engine.workload import GENERATION_SHARDED

        raise _err(doc, ("training", "objective"), GENERATION_SHARDED, f"estimate it on {elsewhere}")
    refuse(spec)
    E._check_attention(doc, spec.attention)
    source = load_config(doc, offline=offline)
    try:
        est_plan = plan(source.config)
    except ValueError:
        raise _err(doc, ("identity",), "the model has no num_hidden_layers: not a decoder stack") from None
    if layers == "full":
        est_plan = Plan(est_plan.layers, est_plan.period, None, "full trace requested")
    return spec, source, est_plan


def probe_runner(
    doc: Document,
    source: Any,
    est_plan: Plan,
    say: Progress,
    label: str,
    simulate: Callable[[Any, int], dict[str, int]],
) -> Callable[[int], dict[str, int]]:
    """A rank's figures at the model's depth: ``simulate(model_source, rank)`` at the plan's two probe depths,
    extended to every layer (or at full depth when the plan has no probes). ``label`` (with ``{rank}``) names the
    rank in progress lines; a failure inside torch & co. becomes one clear line, never a wrong number."""
    from ledgerspec.derivations.estimate import estimator as E
    from ledgerspec.derivations.estimate.extrapolate import extend_all, with_layers
    from ledgerspec.derivations.stack.build import ModelSource

    def run(n: int | None, rank: int) -> dict[str, int]:
        src = (
            source
            if n is None
            else ModelSource(with_layers(source.config, n), source.config_file, source.sha256, source.architecture)
        )
        say(f"simulating {label.format(rank=rank)} with {n or est_plan.layers} layers")
        try:
            return simulate(src, rank)
        except LedgerspecError:
            raise
        except Exception as exc:
            raise E._fail(doc, exc, source.architecture) from None

    def figures(rank: int) -> dict[str, int]:
        if est_plan.probes is None:
            return run(None, rank)
        n1, n2 = est_plan.probes
        return extend_all(run(n1, rank), run(n2, rank), n1, n2, est_plan.layers)

    return figures


def simulated_rank(
    rep: int, run: Callable[[int], dict[str, int]], rank_step: Callable[[int], Any] | None, offloaded: bool
) -> tuple[dict[str, int], Any]:
    """A representative rank's figures and, with ``rank_step`` (:func:`stream_runner`'s), its allocation stream: the
    stream's own estimate figures (the same probes, one set of traces), else ``run(rep)`` (:func:`probe_runner`'s);
    under CPU offload the stream is the device's alone, so the figures (both sides) are the probes' own."""
    step = rank_step(rep) if rank_step is not None else None
    from_step = step.estimate_figures if step is not None and not offloaded else None
    return from_step or run(rep), step


def stream_runner(
    doc: Document,
    source: Any,
    est_plan: Plan,
    say: Progress,
    label: str,
    simulate: Callable[..., dict[str, int]],
) -> Callable[[int], Any]:
    """A rank's allocation stream at the model's depth (:func:`ledgerspec.derivations.allocator.step.full_depth`:
    the plan's two probes and a third, extended event by event, or a full trace), from ``simulate(model_source,
    rank, record)`` as :func:`probe_runner` calls it with a ``record`` list that receives each run's stream. Its
    :attr:`~ledgerspec.derivations.allocator.step.StepEvents.estimate_figures` are the figures
    :func:`probe_runner` gives (the same two probes, extended the same way), None only when the model is too
    shallow for a third probe (then ask :func:`probe_runner`)."""
    from ledgerspec.derivations.allocator.step import full_depth
    from ledgerspec.derivations.estimate import estimator as E
    from ledgerspec.derivations.estimate.extrapolate import with_layers
    from ledgerspec.derivations.stack.build import ModelSource

    def step(rank: int) -> Any:
        def probe(n: int | None) -> Any:
            src = (
                source
                if n is None
                else ModelSource(with_layers(source.config, n), source.config_file, source.sha256, source.architecture)
            )
            say(f"simulating {label.format(rank=rank)} with {n or est_plan.layers} layers (allocation stream)")
            record: list[Any] = []
            try:
                simulate(src, rank, record)
            except LedgerspecError:
                raise
            except Exception as exc:
                raise E._fail(doc, exc, source.architecture) from None
            return record[0]

        return full_depth(probe, est_plan)

    return step


def extension_block(est: ShardEstimate, device_memory: int | None) -> dict[str, Any]:
    """The ``estimate`` block of ``parallelism.x-per-rank``."""
    ranks = []
    fits = est.fits(device_memory) if device_memory is not None else None
    for i, r in enumerate(est.ranks):
        row: dict[str, Any] = {
            "rank": r.rank,
            "peak_allocated": {
                "value": r.peak,
                "source": "CALCULATED",
                "method": f"maximum of rank {r.rank}'s simulated phase peaks",
            },
            "phases": dict(r.phases),
            "activations": r.activations,
            "components": dict(r.components),
        }
        if r.host_peak is not None and r.host_phases is not None and r.total_phases is not None:
            row["host_peak"] = {
                "value": r.host_peak,
                "source": "CALCULATED",
                "method": f"rank {r.rank}'s host memory under CPU offload: the most its host-side tensors held at once "
                "(sharded parameters, gradient shards, optimizer state and step), simulated",
            }
            row["host_phases"] = dict(r.host_phases)
            row["total_phases"] = dict(r.total_phases)
        if r.simulated_as != r.rank:
            row["same_as_rank"] = r.simulated_as
        on_device = est.device is not None and fits is not None and fits[i].peak == est.device[i].device_peak
        if on_device:  # issue 23: what the rank's device holds, and its verdict (as estimate's x-estimate has them)
            assert est.device is not None
            row.update(est.device[i].extension())
        if fits is not None:
            row["fits"] = fits[i].fits
            row["headroom"] = fits[i].headroom
            if fits[i].oom_phase_key:
                row["oom_phase"] = fits[i].oom_phase_key
        ranks.append(row)
    block: dict[str, Any] = {
        "source": "CALCULATED",
        "method": est.method,
        "target": est.target,
        "worst_rank_peak": {
            "value": est.worst,
            "source": "CALCULATED",
            "method": "the largest per-rank predicted peak (never a sum across ranks)",
        },
        "ranks": ranks,
    }
    hosts = [r.host_peak for r in est.ranks if r.host_peak is not None]
    if hosts:  # CPU offload: phases are the device's; the host's peak is its own figure (the spec's host_peak)
        block["worst_rank_host_peak"] = {
            "value": max(hosts),
            "source": "CALCULATED",
            "method": "the largest per-rank host_peak (each rank's host memory; never a sum across ranks)",
        }
    if device_memory is not None and fits is not None:
        block["device_memory"] = device_memory
        block["fits"] = all(f.fits for f in fits)
        device = est.device is not None and all(d.total == device_memory for d in est.device)
        block["compared"] = (
            "each rank's device_peak (the allocator model's replay of its stream + what lies outside the allocator)"
            if device
            else "each rank's peak_allocated (tensors only"
            + (f": {est.allocated_only}" if est.allocated_only else "")
            + "; the CUDA context, allocator cache and NCCL buffers need headroom too)"
        )
    return block


__all__ = [
    "COMPONENTS",
    "Progress",
    "RankEstimate",
    "ShardEstimate",
    "StreamNumbers",
    "add_sides",
    "device_fit",
    "device_waits",
    "extension_block",
    "fake_process_group",
    "prepare_trace",
    "probe_runner",
    "recorded",
    "simulated_rank",
    "stream_numbers",
    "stream_runner",
]
