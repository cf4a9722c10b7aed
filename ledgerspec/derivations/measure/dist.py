"""``ledgerspec measure --nproc N``: the measurement protocol on every rank of a real FSDP2 run under ``torchrun``.

The parent process never imports torch. It picks a free loopback port (a bound socket), starts
``torchrun --nproc_per_node N -m ledgerspec.derivations.measure.dist --rank REQUEST OUTDIR`` and waits.
Every rank (gloo on the CPU, nccl on CUDA) builds the document's workload on the meta device
(:class:`ledgerspec.derivations.engine.workload.Workload`: exact model, adapters), applies ``fully_shard`` to every
decoder layer and then to the root (:mod:`ledgerspec.derivations.shard.fsdp.workload`), and runs the SAME
phases as a single-device measurement, :func:`ledgerspec.derivations.engine.protocol.run_protocol`, with its own
backend (tensor tracking on the CPU: FSDP2's all-gather buffers and reduce-scatter outputs are real tensors and
are counted; allocator counters on CUDA). Materialising allocates only this rank's padded shards: the base
shards at ``after_load``, the adapter shards at ``after_adapter_injection``. Each rank writes ``rankR.json``
(its protocol result and the calculated per-rank state of :mod:`ledgerspec.derivations.shard.state` for
comparison) into a temporary folder; the parent reads them all.

Write-back (only after every rank reported; a failure leaves the ledger byte-identical):
``parallelism.per_rank_peak`` (one MEASURED figure per rank, in rank order), ``gpu_count``, ``strategy``,
placements; ``metrics.peak_allocated`` = the worst rank (never a sum); ``phases`` = the worst rank per phase;
the per-rank phase table and the calculated-vs-measured model state in ``x-measure-per-rank``.

QLoRA is measured when bitsandbytes stores the packed 4-bit weights in the loaded float dtype
(``bnb_4bit_quant_storage``, checked before launching): FSDP2 shards the packed weights like any parameter, every
rank keeps the whole quantization state, and bitsandbytes' ``Linear4bit`` finds it again on the module for the
gathered weight (:mod:`ledgerspec.derivations.shard.fsdp.workload`). Not supported with ``--nproc``:
``--memory-limit`` (a simulated OOM on one rank would leave the others waiting in a collective). An out-of-memory
error on any rank ends the run without writing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, from_text
from ledgerspec.derivations.shard.options import (
    FSDP2_DEFAULT,
    check_fsdp1_mixed_precision,
    check_qlora,
    cpu_offload,
    reshard_after_forward_switch,
    zero_stage,
)
from ledgerspec.errors import EXIT_FINDINGS, EXIT_USAGE, LedgerspecError, described

EXTENSION = "x-measure-per-rank"
STRATEGY = "fsdp2"
DEFAULT_TIMEOUT_S = 900.0


@dataclass
class DistRequest:
    """What every rank needs (JSON across the process boundary)."""

    doc_text: str
    doc_path: str
    spec: dict[str, Any]
    nproc: int
    device: str = "cpu"
    steps: int = 2
    reshard_after_forward: bool | None = None  # None: FSDP2's default (layers reshard, the root does not)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy / FSDP1 CPUOffload(offload_params=True), as declared


@dataclass
class RankOutput:
    """One rank's answer."""

    rank: int
    result: Any  # ProtocolResult
    software: dict[str, str] = field(default_factory=dict)
    calculated: dict[str, int] = field(default_factory=dict)  # sharding.RankState of this rank, in bytes

    @property
    def peak(self) -> int:
        """This rank's peak allocated: the maximum over its phases."""
        peak = self.result.peak_allocated()
        if peak is None:
            raise ValueError(f"rank {self.rank} reported no phase")
        return int(peak)


@dataclass
class DistOutcome:
    """What ``measure --nproc`` saw (the document holds it now): the worst-rank result, every rank, notes."""

    result: Any  # ProtocolResult of the worst rank per phase
    ranks: list[RankOutput]
    notes: list[str]
    strategy: str = "FSDP2"  # FSDP2, FSDP1, DeepSpeed ZeRO-2/3 (for the command's summary line)

    @property
    def worst(self) -> int:
        return max(o.peak for o in self.ranks)


# -- the ranks ------------------------------------------------------------------------------------------------------


def _calculated(doc: Document, world: int, rank: int, optimizer: str, reshard: bool | None) -> dict[str, int]:
    """Rank ``rank``'s calculated state (the plan ``shard`` calculates:
    :func:`~ledgerspec.derivations.shard.plans.fsdp_plan`) and the gathered parameter bytes still held when the forward
    returns (``reshard``: the declared ``reshard_after_forward``, None when absent)."""
    from ledgerspec.derivations.shard import state as S
    from ledgerspec.derivations.shard.model import document_descriptors
    from ledgerspec.derivations.shard.options import mixed_precision
    from ledgerspec.derivations.shard.plans import fsdp_plan

    descs = document_descriptors(doc)
    plan = fsdp_plan(doc, descs, world, optimizer)
    if isinstance(plan, S.Fsdp1Plan):  # FSDP1's root stays gathered into backward too (the policy's units)
        kept = S.fsdp1_kept_after_forward(plan, reshard)
    else:
        mp = mixed_precision(doc)
        gathered_dtype = mp.param_dtype if mp else None  # parallelism.mixed_precision_policy (issue 16)
        kept = S.kept_after_forward(S.unit_unsharded_bytes(descs, world, gathered_dtype), reshard)
    rs = plan.ranks[rank]
    return {
        "frozen_base": rs.frozen_base,
        "adapter": rs.adapter,
        "gradients": rs.gradients,
        "optimizer": rs.optimizer,
        "optimizer_host": rs.optimizer_host,
        "gathered": rs.gathered,
        "kept_after_forward": kept,
    }


def run_rank(req: DistRequest) -> RankOutput:
    """The work of one rank (inside an initialised process group)."""
    import torch
    import torch.distributed as dist

    from ledgerspec.derivations.engine.backends import Backend, CudaBackend, TrackerBackend
    from ledgerspec.derivations.engine.protocol import run_protocol
    from ledgerspec.derivations.engine.workload import Workload, WorkloadSpec
    from ledgerspec.derivations.measure.measurer import software_versions

    doc = from_text(req.doc_text, req.doc_path)
    spec = WorkloadSpec.from_json(req.spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend: Backend
    if req.device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        backend = CudaBackend(device_index=index, record_history=False)
        device: Any = torch.device("cuda", index)
    else:
        backend = TrackerBackend()
        device = "cpu"
    from ledgerspec.derivations.shard.fsdp.workload import fsdp1_workload, sharded_workload
    from ledgerspec.derivations.shard.options import is_fsdp1, zero_options, zero_stage
    from ledgerspec.derivations.shard.zero.engine import zero_workload

    if zero_stage(doc) is not None:  # DeepSpeed ZeRO-2/3 by its own engine (issue 16): no FSDP plan to compare
        workload = zero_workload(Workload)(doc, spec)
        workload.options = zero_options(doc)
        result = run_protocol(workload, backend, device=device, steps=req.steps)
        if result.complete:
            from ledgerspec.derivations.shard.zero.simulate import check_steps

            check_steps(doc, workload.engine, 1 + req.steps)
        return RankOutput(rank, result, software_versions(workload, req.device), {})
    workload = (fsdp1_workload if is_fsdp1(doc) else sharded_workload)(Workload)(doc, spec)
    workload.reshard_after_forward = req.reshard_after_forward
    workload.cpu_offload = req.cpu_offload
    from ledgerspec.derivations.shard.offload.fsdp import pinning_as_copies
    from ledgerspec.derivations.shard.options import shard_group

    with pinning_as_copies() if req.cpu_offload else contextlib.nullcontext():
        result = run_protocol(workload, backend, device=device, steps=req.steps)
    group = shard_group(doc, world)  # hybrid sharding: the rank holds its shard group's share
    calc = _calculated(doc, group, rank % group, spec.optimizer, req.reshard_after_forward)
    if result.activations_saved is not None:  # gathered parameters FSDP2 keeps into backward are no activations
        result.activations_saved = max(0, result.activations_saved - calc["kept_after_forward"])
    return RankOutput(rank, result, software_versions(workload, req.device), calc)


def _rank_main(request_file: str, out_dir: str) -> int:
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    req = DistRequest(**json.loads(Path(request_file).read_text(encoding="utf-8")))
    use_cuda = req.device == "cuda"
    if use_cuda:
        problem = cuda_rank_problem(
            torch.cuda.is_available(), torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0")), req.nproc
        )
        if problem is not None:
            error = LedgerspecError(
                problem,
                req.doc_path,
                rule="measure",
                hint="use --device cpu (gloo) or fewer ranks",
                exit_code=EXIT_USAGE,
            )
            payload: dict[str, Any] = {"error": error.to_json()}
            _write(out_dir, int(os.environ.get("RANK", "0")), payload)
            return 1
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)  # tracked bytes do not depend on threads; avoids spin-waits on a busy host
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if zero_stage(from_text(req.doc_text, req.doc_path)) is not None:
        from ledgerspec.derivations.shard.zero.engine import import_deepspeed

        import_deepspeed(cpu=not use_cuda)  # DS_ACCELERATOR=cpu on gloo ranks; deepspeed.comm wraps the group
    rank = dist.get_rank()
    failed = False
    try:
        out = run_rank(req)
        payload = {"rank": rank, "result": out.result.to_json(), "software": out.software, "calculated": out.calculated}
        failed = bool(out.result.oom)
    except LedgerspecError as exc:
        failed = True
        payload = {"error": exc.to_json()}
    except Exception as exc:  # reported by the parent as one line
        import traceback

        traceback.print_exc()
        failed = True
        payload = {"crash": described(exc)}
    _write(out_dir, rank, payload)
    if failed:  # the other ranks may wait in a collective: exit at once, torchrun stops them
        sys.stderr.flush()
        os._exit(3)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def cuda_rank_problem(available: bool, device_count: int, local_rank: int, nproc: int) -> str | None:
    """Why this rank cannot run on its own GPU (nccl needs one GPU per rank: two ranks on one GPU fail), or None."""
    if not available:
        return "--device cuda: no CUDA device is available (torch.cuda.is_available() is false)"
    if local_rank >= device_count or nproc > device_count:  # every rank says so, none waits in a collective
        return (
            f"--nproc {nproc} --device cuda needs one GPU per rank (nccl), but this node has {device_count} "
            f"visible GPU(s)"
        )
    return None


def _write(out_dir: str, rank: int, payload: dict[str, Any]) -> None:
    tmp = Path(out_dir) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(Path(out_dir) / f"rank{rank}.json")  # complete files only


# -- the parent -----------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on the loopback interface right now (bound by the OS, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(request_file: str, out_dir: str, nproc: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--max_restarts=0",
        "-m",
        "ledgerspec.derivations.measure.dist",
        "--rank",
        request_file,
        out_dir,
    ]


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_HUB_OFFLINE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_ERROR_FILE": os.devnull,
    }
    if Path("/sys/class/net/lo").exists():  # loopback only
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_ranks(req: DistRequest, timeout: float | None = DEFAULT_TIMEOUT_S) -> list[RankOutput]:
    """Run ``req`` under torchrun; every rank's output, in rank order, or one clear error."""
    from ledgerspec.derivations.engine.protocol import ProtocolResult

    with tempfile.TemporaryDirectory(prefix="ledgerspec-measure-dist-") as tmp:
        req_file = os.path.join(tmp, "request.json")
        out_dir = os.path.join(tmp, "ranks")
        os.mkdir(out_dir)
        Path(req_file).write_text(json.dumps(req.__dict__), encoding="utf-8")
        returncode, stderr = _launch(req_file, out_dir, req.nproc, timeout)
        payloads: dict[int, dict[str, Any]] = {}
        for r in range(req.nproc):
            f = Path(out_dir) / f"rank{r}.json"
            if f.exists():
                payloads[r] = json.loads(f.read_text(encoding="utf-8"))
    for r, payload in sorted(payloads.items()):
        if "error" in payload:
            raise LedgerspecError(**payload["error"])
        if "crash" in payload:
            raise LedgerspecError(
                f"rank {r} crashed: {payload['crash']}",
                req.doc_path,
                rule="measure",
                exit_code=EXIT_FINDINGS,
                hint="the ranks' tracebacks are on stderr of "
                "`python -m ledgerspec.derivations.measure.dist --rank` under torchrun",
            )
    outs = [
        RankOutput(r, ProtocolResult.from_json(p["result"]), p.get("software", {}), p.get("calculated", {}))
        for r, p in sorted(payloads.items())
    ]
    for o in outs:
        if o.result.oom:
            raise LedgerspecError(
                f"rank {o.rank} ran out of memory in phase {o.result.oom_phase} "
                f"({o.result.oom_message}); the ledger is unchanged",
                req.doc_path,
                rule="measure",
                exit_code=EXIT_FINDINGS,
                hint="per-rank OOMs are not recorded: size it with `ledgerspec shard --estimate` or use more ranks",
            )
    if len(outs) != req.nproc or returncode != 0:
        tail = " | ".join(line for line in stderr.strip().splitlines()[-3:])
        raise LedgerspecError(
            f"torchrun exited {returncode} with {len(outs)} of {req.nproc} ranks reporting: {tail or 'no output'}",
            req.doc_path,
            rule="measure",
            exit_code=EXIT_FINDINGS,
            hint="a killed process often means the host ran out of memory",
        )
    return outs


def _launch(req_file: str, out_dir: str, nproc: int, timeout: float | None) -> tuple[int, str]:
    """The ranks, run to their end: under torchrun (its own session: on a timeout or Ctrl-C the whole session is
    killed, no rank outlives us), or, with ``LEDGERSPEC_LAUNCHER=forkserver``, started directly as torchrun would
    start them (:mod:`.launch`). The exit code and standard error."""
    from ledgerspec.derivations.measure import launch

    port = free_port()
    if launch.mode() == "forkserver":
        args = ["-m", "ledgerspec.derivations.measure.dist", "--rank", req_file, out_dir]
        return launch.run_ranks(args, nproc, _env(), port, timeout)
    done = launch.run(torchrun_command(req_file, out_dir, nproc, port)[1:], _env(), timeout, new_session=True)
    return done.returncode, done.stderr


# -- merging and write-back -----------------------------------------------------------------------------------------


def worst_rank(outs: list[RankOutput]) -> Any:
    """One :class:`ProtocolResult` holding, per phase, the record of the rank with the largest figure."""
    from ledgerspec.derivations.engine.protocol import ProtocolResult
    from ledgerspec.derivations.estimate.fit import ALL_PHASES

    first = outs[0].result
    merged = ProtocolResult.from_json(first.to_json())
    merged.phases = {}
    for name in ALL_PHASES:
        recs = [o.result.phases[name] for o in outs if name in o.result.phases]
        if recs:
            merged.phases[name] = max(recs, key=lambda rec: rec.figure)

    def most(values: list[Any]) -> Any:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    merged.host_peak = most([o.result.host_peak for o in outs])
    merged.step_time_s = most([o.result.step_time_s for o in outs])
    merged.activations_saved = most([o.result.activations_saved for o in outs])
    return merged


def per_rank_extension(
    outs: list[RankOutput], reshard: bool | None, strategy_text: str = "fsdp2 (fully_shard per decoder layer + root)"
) -> dict[str, Any]:
    """The per-rank phase table and each rank's measured model state next to :mod:`sharding`'s calculation."""
    from ledgerspec.derivations.estimate.fit import ALL_PHASES
    from ledgerspec.derivations.measure.measurer import measured_components

    ranks = []
    for o in outs:
        r = o.result
        comps = measured_components(r)
        after_opt = r.phases["after_optimizer_init"].figure
        calc = o.calculated
        ranks.append(
            {
                "rank": o.rank,
                "peak_allocated": o.peak,
                "phases": {name: r.phases[name].figure for name in ALL_PHASES if name in r.phases},
                "measured": {k: comps.get(k, 0) for k in F.RESIDENT},
                "calculated": dict(calc),
                "after_optimizer_init_vs_calculated": after_opt - (calc.get("frozen_base", 0) + calc.get("adapter", 0)),
                "host_peak": r.host_peak,
            }
        )
    backend = outs[0].result.backend
    return {
        "strategy": strategy_text,
        "world_size": len(outs),
        "reshard_after_forward": FSDP2_DEFAULT if reshard is None else reshard,
        "backend": backend,
        "process_group": "nccl" if backend == "cuda" else "gloo",
        "method": "every rank runs the measurement protocol (same phases) on its own shards under torchrun; "
        "metrics and phases hold the worst rank, never a sum; `calculated` is "
        "ledgerspec.derivations.shard.state for this rank (optimizer state appears at the first step: "
        "torch optimizers create it lazily, so after_optimizer_init holds frozen_base + adapter)",
        "ranks": ranks,
    }


def write_back(doc: Document, outs: list[RankOutput], command: str, reshard: bool | None) -> list[str]:
    """Write the ranks' results into ``doc`` (in memory). Returns notes for the user."""
    from ledgerspec.contract.edit import set_extension, set_figure, set_plain
    from ledgerspec.derivations.measure import measurer as M
    from ledgerspec.derivations.shard.options import is_fsdp1

    merged = worst_rank(outs)
    notes = M.write_back(doc, M.ChildOutput(merged, outs[0].software), command, compare=False)
    _drop_single_device_comparison(doc)
    worst = max(o.peak for o in outs)
    what = "torch.cuda.max_memory_allocated" if merged.backend == "cuda" else "tracked tensor bytes"
    set_figure(
        doc,
        ("metrics", "peak_allocated"),
        worst,
        "MEASURED",
        f"the worst of {len(outs)} {_label(doc)} ranks (not a sum): maximum over the phases of {what}",
        force=True,
    )
    peaks = [
        {
            "value": o.peak,
            "source": "MEASURED",
            "method": f"rank {o.rank} of {len(outs)}: maximum over the phases of {what}",
        }
        for o in outs
    ]
    p = ("parallelism",)
    set_plain(doc, (*p, "gpu_count"), len(outs), force=True)
    fsdp1 = is_fsdp1(doc)
    stage = zero_stage(doc)
    set_plain(doc, (*p, "strategy"), f"zero{stage}" if stage else "fsdp1" if fsdp1 else STRATEGY, force=True)
    offloaded = cpu_offload(doc) is not None  # the run offloaded (DistRequest.cpu_offload): on the host, as imports say
    hosted = {"parameter_placement": offloaded, "gradient_placement": offloaded, "optimizer_placement": offloaded}
    if stage:  # DeepSpeed: what the run offloaded (offload_optimizer: gradients and optimizer; offload_param)
        from ledgerspec.derivations.shard.options import zero_options

        zo = zero_options(doc)
        offloaded = zo.offloaded
        hosted = {
            "parameter_placement": zo.offload_param,
            "gradient_placement": zo.offload_optimizer,
            "optimizer_placement": zo.offload_optimizer,
        }
    from ledgerspec.derivations.shard.options import no_shard

    whole = fsdp1 and no_shard(doc, len(outs))  # FSDP1's NO_SHARD: the run replicated all three
    for key in ("parameter_placement", "gradient_placement", "optimizer_placement"):
        replicated = whole or (stage in (1, 2) and key == "parameter_placement")  # ZeRO-1/2 keep whole parameters
        set_plain(doc, (*p, key), "cpu" if hosted[key] else "replicated" if replicated else "sharded", force=True)
    if all(doc.get(*where, "cpu_offload").switch() is None for where in (p, ("memory_options",))):
        # not declared: what the run did (DeepSpeed may offload by its placements alone); a declared value (false,
        # OFF, true: the run offloaded) stays as written
        set_plain(doc, (*p, "cpu_offload"), offloaded, force=True)
    if reshard is not None:
        set_plain(doc, (*p, "reshard_after_forward"), reshard, force=True)
    set_plain(doc, (*p, "per_rank_peak"), peaks, force=True)
    _write_outside(doc, outs)
    text = "fsdp1 (FullyShardedDataParallel, use_orig_params, PEFT's fsdp_auto_wrap_policy)" if fsdp1 else None
    if stage:
        from ledgerspec.derivations.shard.options import zero_options

        text = f"zero{stage} (DeepSpeed's engine: {zero_options(doc).describe()})"
    ext = per_rank_extension(outs, reshard, *([text] if text else []))
    if offloaded and stage:  # issue 16: DeepSpeed's offload, as the engine ran it
        ext["cpu_offload"] = f"DeepSpeed ZeRO-{stage} {zero_options(doc).describe()}" + (
            "; without an accelerator DeepSpeed's host and device are the same memory and its pin_memory() a no-op: "
            "every figure counts both sides"
            if merged.backend != "cuda"
            else ""
        )
    elif offloaded:  # issue 16: the run offloaded as declared
        from ledgerspec.derivations.shard.offload.fsdp import describe

        ext["cpu_offload"] = describe("fsdp1" if fsdp1 else "fsdp2") + (
            "; without an accelerator pin_memory() is a plain copy (the same host bytes) and FSDP1's CPU stream "
            "synchronize a no-op; every figure counts both sides (all of it is host memory here)"
            if merged.backend != "cuda"
            else ""
        )
    set_extension(doc, (EXTENSION,), ext)
    notes.append(
        f"{len(outs)} ranks: per-rank peaks "
        + ", ".join(str(o.peak) for o in outs)
        + f" B; metrics.peak_allocated is the worst rank ({worst} B)"
    )
    return notes


def _write_outside(doc: Document, outs: list[RankOutput]) -> None:
    """``outside_allocator.per_rank`` (each rank's bytes outside the caching allocator at its device peak) and the
    worst rank's ``total``, ``context`` and ``after_load`` (never a sum), when every rank measured them (cuda)."""
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.derivations.measure.measurer import outside_figures

    figures = [outside_figures(o.result) for o in outs]
    n = len(outs)
    if not figures or not all("total" in f for f in figures):
        return
    set_plain(
        doc,
        ("outside_allocator", "per_rank"),
        [
            {"value": f["total"][0], "source": "MEASURED", "method": f"rank {o.rank} of {n}: {f['total'][1]}"}
            for o, f in zip(outs, figures, strict=True)
        ],
        force=True,
    )
    for key in ("total", "context", "after_load"):
        known = [(f[key], o.rank) for o, f in zip(outs, figures, strict=True) if key in f]
        if len(known) == n:
            (value, method), rank = max(known, key=lambda x: x[0][0])
            set_figure(
                doc,
                ("outside_allocator", key),
                value,
                "MEASURED",
                f"the worst of {n} ranks (rank {rank}; not a sum): {method}",
                force=True,
            )


def _label(doc: Document) -> str:
    from ledgerspec.derivations.shard.options import is_fsdp1

    stage = zero_stage(doc)
    return f"DeepSpeed ZeRO-{stage}" if stage else "FSDP1" if is_fsdp1(doc) else "FSDP2"


def _drop_single_device_comparison(doc: Document) -> None:
    """``comparison`` compares with the single-device ``ledger.calculated_subtotal``: meaningless per rank."""
    from ledgerspec.contract.edit import remove_keys

    remove_keys(doc, "comparison", ("calculated_subtotal", "measured_peak", "difference", "known_explanation"))


def make_request(doc: Document, nproc: int, device: str, steps: int) -> DistRequest:
    from ledgerspec.derivations.measure.measurer import make_request as single

    if nproc < 2:
        raise LedgerspecError(
            f"--nproc must be >= 2 for a per-rank measurement, got {nproc}",
            doc.path,
            rule="measure",
            exit_code=EXIT_USAGE,
            hint="omit --nproc for one device",
        )
    base = single(doc, device, steps, None, None)
    from ledgerspec.derivations.shard.simulation import generation_refused

    generation = base.spec.get("generation")
    elsewhere = generation_refused(doc, generation.get("vllm")) if generation is not None else None
    if elsewhere is not None:
        from ledgerspec.derivations.engine.workload import GENERATION_SHARDED

        raise LedgerspecError(
            GENERATION_SHARDED, doc.path, rule="measure", exit_code=EXIT_USAGE, hint=f"measure it on {elsewhere}"
        )
    if zero_stage(doc) is not None:
        from ledgerspec.derivations.engine.workload import WorkloadSpec
        from ledgerspec.derivations.shard.options import zero_options
        from ledgerspec.derivations.shard.zero.engine import zero_refusal

        why = zero_refusal(WorkloadSpec.from_json(base.spec), zero_options(doc), on_cpu=device == "cpu")
        if why:
            raise LedgerspecError(why, doc.path, rule="measure", exit_code=EXIT_USAGE, hint="see docs/multi-gpu.md")
    elif base.spec.get("quant") is not None:
        check_qlora(doc, rule="measure", code=EXIT_USAGE)  # the layout FSDP2 can shard, before launching
    check_fsdp1_mixed_precision(doc, rule="measure")  # a first forward no real run survives, before launching
    reshard = reshard_after_forward_switch(doc)
    offload = cpu_offload(doc) is not None
    return DistRequest(base.doc_text, base.doc_path, base.spec, nproc, device, steps, reshard, offload)


def measure_dist(
    doc: Document,
    nproc: int,
    device: str = "cpu",
    steps: int = 2,
    command: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> DistOutcome:
    """Measure the ledger ``doc`` on ``nproc`` FSDP2 ranks and write the results into ``doc`` (in memory; the
    caller saves it)."""
    req = make_request(doc, nproc, device, steps)
    outs = run_ranks(req, timeout)
    notes = write_back(
        doc,
        outs,
        command or f"ledgerspec measure {doc.path} --nproc {nproc} --device {device} --steps {steps}",
        req.reshard_after_forward,
    )
    return DistOutcome(worst_rank(outs), outs, notes, _label(doc))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--rank":
        return _rank_main(args[1], args[2])
    print("usage: torchrun ... -m ledgerspec.derivations.measure.dist --rank REQUEST.json OUTDIR", file=sys.stderr)
    return EXIT_USAGE


__all__ = [
    "DistOutcome",
    "DistRequest",
    "RankOutput",
    "free_port",
    "make_request",
    "measure_dist",
    "per_rank_extension",
    "run_ranks",
    "torchrun_command",
    "worst_rank",
    "write_back",
]

if __name__ == "__main__":
    sys.exit(main())
