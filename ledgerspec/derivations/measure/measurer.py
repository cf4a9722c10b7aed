"""``ledgerspec measure``: run the measurement protocol in a child process and write what it saw.

The parent process never imports torch: it reads the ledger, checks the workload it declares,
starts ``python -m ledgerspec.derivations.measure.measurer --child REQUEST`` and waits. The child builds the
workload, runs :func:`ledgerspec.derivations.engine.protocol.run_protocol` on the chosen backend and
writes a JSON result; an out-of-memory error is a result, a crash is reported as one line. Only
after a result has arrived is the ledger changed (atomically), so an OOM, a crash or Ctrl-C
never leaves a half-written ledger.

Write-back (source MEASURED): ``phases``, ``metrics``, ``measurement``, ``software`` (read from
the child's running stack), ``comparison`` (the ledger's calculated subtotal against the measured
peak), ``result.oom``/``oom_phase``; on cuda also ``ledger.activations`` (bytes held by the
forward at the worst shape) and ``outside_allocator`` (device memory the caching allocator does not see: the CUDA
context before the first allocation, at the end of ``after_load``, at the device peak). Details that have no ledger
key go to ``x-measure``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ledgerspec.contract import fields as F
from ledgerspec.contract.document import Document, from_text
from ledgerspec.contract.edit import remove, remove_keys, set_extension, set_figure, set_plain
from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, digests
from ledgerspec.contract.units import format_size
from ledgerspec.derivations.stack.versions import installed_stack
from ledgerspec.errors import EXIT_FINDINGS, EXIT_USAGE, LedgerspecError, described

PROTOCOL = "ledgerspec-measure/1"
#: relative tolerance within which a measured static component "matches" the calculated one
MATCH_TOLERANCE = 0.01


class MeasurementCrash(RuntimeError):
    """The child raised an unexpected exception (the CLI reports it as an internal error)."""


@dataclass
class Request:
    """What one child measurement needs (JSON across the process boundary)."""

    doc_text: str
    doc_path: str
    spec: dict[str, Any]
    device: str = "cpu"
    steps: int = 2
    memory_limit: int | None = None
    snapshot_path: str | None = None


@dataclass
class ChildOutput:
    """A child's answer: the protocol result and the software it ran on."""

    result: Any  # ProtocolResult
    software: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """What ``measure`` saw (the document holds it now), with notes for the user."""

    result: Any  # ProtocolResult
    notes: list[str]


# -- the child ------------------------------------------------------------------------------------------------------


def run_request(req: Request) -> ChildOutput:
    """Run one measurement in this process (the child's work)."""
    from ledgerspec.derivations.engine.backends import Backend, CudaBackend, TrackerBackend
    from ledgerspec.derivations.engine.protocol import run_protocol
    from ledgerspec.derivations.engine.workload import Workload, WorkloadSpec

    doc = from_text(req.doc_text, req.doc_path)
    spec = WorkloadSpec.from_json(req.spec)
    backend: Backend
    if req.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LedgerspecError(
                "--device cuda: no CUDA device is available (torch.cuda.is_available() is false)",
                req.doc_path,
                rule="measure",
                hint="use --device cpu for tensor-level tracking",
                exit_code=EXIT_USAGE,
            )
        backend = CudaBackend()
        device = "cuda"
    else:
        backend = TrackerBackend(limit=req.memory_limit)
        device = "cpu"
    workload = Workload(doc, spec)
    result = run_protocol(
        workload,
        backend,
        device=device,
        steps=req.steps,
        snapshot_path=req.snapshot_path,
        memory_limit=req.memory_limit,
    )
    return ChildOutput(result, software_versions(workload, req.device))


def software_versions(workload: Any, device: str) -> dict[str, str]:
    """The versions of the running stack (only those that are installed / apply)."""
    out = installed_stack()
    import torch

    if device == "cuda":
        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        if getattr(torch.version, "hip", None):
            out["rocm"] = str(torch.version.hip)
        out["gpu_name"] = torch.cuda.get_device_name()
        with contextlib.suppress(Exception):  # a build without NCCL
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        loading = os.environ.get("CUDA_MODULE_LOADING", "").strip().upper()
        if loading in ("LAZY", "EAGER"):
            out["cuda_module_loading"] = loading
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            out["pytorch_cuda_alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    model = getattr(workload, "model", None)
    if model is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # full fine-tuning: no PEFT
        impl = getattr(base.config, "_attn_implementation", None)
        if impl:
            out["attention_implementation"] = str(impl)
    return out


def _child_main(request_file: str, result_file: str) -> int:
    import warnings

    warnings.simplefilter("ignore")
    req = Request(**json.loads(Path(request_file).read_text(encoding="utf-8")))
    if req.device == "cpu":
        import torch

        # tracked bytes do not depend on the thread count; one thread avoids OpenMP spin-waits on a busy host
        torch.set_num_threads(1)
    try:
        out = run_request(req)
        payload: dict[str, Any] = {"result": out.result.to_json(), "software": out.software}
    except LedgerspecError as exc:
        payload = {"error": exc.to_json()}
    except Exception as exc:  # reported by the parent as one line
        import traceback

        traceback.print_exc()
        payload = {"crash": described(exc)}
    Path(result_file).write_text(json.dumps(payload), encoding="utf-8")
    return 0


# -- the parent -----------------------------------------------------------------------------------------------------


def run_child(req: Request, timeout: float | None = None) -> ChildOutput:
    """Run ``req`` in a fresh Python process; Ctrl-C stops the child and propagates."""
    from ledgerspec.derivations.engine.protocol import ProtocolResult

    with tempfile.TemporaryDirectory(prefix="ledgerspec-measure-") as tmp:
        req_file, res_file = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        Path(req_file).write_text(json.dumps(req.__dict__), encoding="utf-8")
        from ledgerspec.derivations.measure import launch

        # KeyboardInterrupt, timeout: the child is killed (it must not outlive us) and the error propagates
        args = ["-m", "ledgerspec.derivations.measure.measurer", "--child", req_file, res_file]
        # a CPU measurement's tracked bytes do not depend on the thread count, and OpenMP threads spin-wait on a
        # busy host (bitsandbytes' CPU kernels link their own OpenMP runtime, which torch.set_num_threads does not
        # reach: a tiny QLoRA step took 22.6 s beside two busy processes, 3.0 s with one thread): one thread each,
        # read when the runtimes load, as torchrun sets it for its ranks; a thread count the user set is kept
        env = None if req.device != "cpu" else {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = launch.run(args, env, timeout)
        stderr = done.stderr
        if not os.path.exists(res_file):
            tail = " | ".join(line for line in stderr.strip().splitlines()[-3:])
            raise LedgerspecError(
                f"the measurement process died (exit {done.returncode}) before reporting: {tail or 'no output'}",
                req.doc_path,
                rule="measure",
                exit_code=EXIT_FINDINGS,
                hint="a killed process often means the host ran out of memory",
            )
        payload = json.loads(Path(res_file).read_text(encoding="utf-8"))
    if "error" in payload:
        raise LedgerspecError(**payload["error"])
    if "crash" in payload:  # an unexpected exception in the child: ledgerspec's bug, not the ledger's
        if os.environ.get("LEDGERSPEC_DEBUG", "").strip() not in ("", "0"):
            sys.stderr.write(stderr)  # the child's traceback
        raise MeasurementCrash(f"the measurement process crashed: {payload['crash']}")
    return ChildOutput(ProtocolResult.from_json(payload["result"]), payload.get("software", {}))


def make_request(
    doc: Document, device: str, steps: int, memory_limit: int | None, snapshot_path: str | None, spec: Any = None
) -> Request:
    from ledgerspec.derivations.engine.workload import WorkloadSpec
    from ledgerspec.derivations.stack.build import preflight

    if device not in ("cpu", "cuda"):
        raise LedgerspecError(f"--device must be cpu or cuda, got {device!r}", rule="measure", exit_code=EXIT_USAGE)
    if steps < 2:
        raise LedgerspecError(
            f"--steps must be >= 2 (repeated representative steps), got {steps}", rule="measure", exit_code=EXIT_USAGE
        )
    if memory_limit is not None and device != "cpu":
        raise LedgerspecError(
            "--memory-limit simulates an out-of-memory on the cpu backend only",
            rule="measure",
            exit_code=EXIT_USAGE,
            hint="on cuda the device's own memory is the limit",
        )
    spec = spec or WorkloadSpec.from_document(doc)
    declared = spec.kernels.declared() + tuple(("other", k) for k in spec.kernels.other)
    # TRL's fused LM head runs here as TRL runs it (its torch path): the step is SFTTrainer's (engine/trl_sft.py)
    declared = tuple(
        (op, k)
        for op, k in declared
        if not (op == "cross_entropy" and k == "trl_chunked_nll" and spec.loop == "trainer")
    )
    if declared:
        op, name = declared[0]
        raise LedgerspecError(
            f"{doc.path}: software.kernels.{op}: {name}: `ledgerspec measure` runs transformers' and PEFT's own "
            "modules, not the declared kernels, so it would measure another step",
            rule="measure",
            exit_code=EXIT_USAGE,
            hint="record the run you launch with its kernels (LedgerCallback), or declare the kernels eager to "
            "measure the eager step",
        )
    if spec.offload:
        raise LedgerspecError(
            f"{doc.path}: memory_options.activation_offload: `ledgerspec measure` does not offload activations, so "
            "it would measure another step",
            rule="measure",
            exit_code=EXIT_USAGE,
            hint="record the run you launch (LedgerCallback), or set activation_offload: false to measure without",
        )
    preflight(doc)  # a missing or broken config.json, rank 0: before a child imports torch
    return Request(doc.text, os.path.abspath(doc.path), spec.to_json(), device, steps, memory_limit, snapshot_path)


def measure(
    doc: Document,
    device: str = "cpu",
    steps: int = 2,
    memory_limit: int | None = None,
    command: str | None = None,
    snapshot_path: str | None = None,
) -> Outcome:
    """Measure the ledger ``doc`` in a child process and write what it saw into ``doc`` (in memory; the caller
    saves it). ``snapshot_path``: where a CUDA out-of-memory saves the allocator's history."""
    req = make_request(doc, device, steps, memory_limit, snapshot_path if device == "cuda" else None)
    out = run_child(req)
    notes = write_back(doc, out, command or f"ledgerspec measure {doc.path} --device {device} --steps {steps}")
    return Outcome(out.result, notes)


def snapshot_path_for(target: str) -> str:
    """Where ``measure --device cuda`` saves the allocator history of an out-of-memory, beside the ledger."""
    return str(Path(target).with_suffix("")) + ".oom-snapshot.pickle"


# -- write-back -----------------------------------------------------------------------------------------------------


def _methods(result: Any) -> tuple[str, str]:
    if result.backend == "cuda":
        return (
            "torch.cuda.memory_allocated at the end of the phase",
            "torch.cuda.max_memory_allocated during the phase (reset_peak_memory_stats at its start)",
        )
    base = "cpu tensor tracking (live storages, see x-measure)"
    return base + ": held at the end of the phase", base + ": peak during the phase, reset at its start"


def write_back(doc: Document, out: ChildOutput, command: str, compare: bool = True) -> list[str]:
    """Write a child's result into ``doc`` (in memory). Returns notes for the user. ``compare=False``: no
    ``comparison`` with the single-device ``ledger.calculated_subtotal`` (a per-rank measurement)."""
    from ledgerspec.derivations.engine.protocol import HELD_PHASES, OPTIONAL_PHASES, PHASES

    r = out.result
    notes: list[str] = []
    _forget_previous_measurement(doc)
    held_m, peak_m = _methods(r)
    shape = (
        f"microbatch {r.microbatch} x {r.seq_worst} tokens (worst), {r.accumulation} micro-step(s); "
        f"steady state {r.steps} steps at {r.seq_typical} tokens"
    )
    for name in (*PHASES, *OPTIONAL_PHASES):
        rec = r.phases.get(name)
        if rec is not None:
            set_figure(
                doc,
                ("phases", name),
                rec.figure,
                "MEASURED",
                held_m if name in HELD_PHASES else f"{peak_m}; {shape}",
                force=True,
            )
    peak = r.peak_allocated()
    if peak is not None:
        what = "torch.cuda.max_memory_allocated" if r.backend == "cuda" else "tracked tensor bytes"
        set_figure(
            doc, ("metrics", "peak_allocated"), peak, "MEASURED", f"maximum over the phases of {what}", force=True
        )
    if r.backend == "cuda":
        if r.peak_reserved() is not None:
            set_figure(
                doc,
                ("metrics", "peak_reserved"),
                r.peak_reserved(),
                "MEASURED",
                "torch.cuda.max_memory_reserved, maximum over the phases",
                force=True,
            )
        if r.device_peak() is not None:
            set_figure(
                doc,
                ("metrics", "device_peak"),
                r.device_peak(),
                "MEASURED",
                f"{r.device.get('device_memory_source')}, sampled in a thread during each phase",
                force=True,
            )
        for key, (value, method) in outside_figures(r).items():
            set_figure(doc, ("outside_allocator", key), value, "MEASURED", method, force=True)
        if r.activations_saved is not None and not r.oom:
            set_figure(
                doc,
                ("ledger", "activations"),
                r.activations_saved,
                "MEASURED",
                f"allocated bytes held after the forward of the first micro-step ({r.microbatch} x "
                f"{r.seq_worst} tokens), logits included",
                force=True,
            )
    else:
        notes.append(
            "cpu backend: metrics.peak_reserved and metrics.device_peak are not measured (there is no "
            "caching allocator or device to read); a cpu run never reaches VALIDATED"
        )
    if r.host_peak is not None:
        set_figure(
            doc,
            ("metrics", "host_peak"),
            r.host_peak,
            "MEASURED",
            "peak resident set (ru_maxrss) of the measuring process: Python, libraries and host tensors",
            force=True,
        )
    if r.step_time_s is not None:
        timing = "" if r.backend == "cuda" else " (with cpu tensor tracking, slower than untracked)"
        set_figure(
            doc,
            ("metrics", "step_time_s"),
            round(r.step_time_s, 6),
            "MEASURED",
            f"mean wall time of a steady-state step{timing}",
            size_comment=False,
            force=True,
        )
    _write_measurement(doc, r, command)
    _write_software(doc, _software(out), notes)
    if compare:
        _write_comparison(doc, r, notes)
    _write_result(doc, r)
    set_extension(doc, ("x-measure",), {**_extension(r), "inputs": digests(doc, WORKLOAD_INPUTS)})  # LS006
    if r.snapshot_path:
        notes.append(
            f"memory snapshot of the OOM saved to {r.snapshot_path} (drop it on https://pytorch.org/memory_viz)"
        )
    return notes


def _software(out: ChildOutput) -> dict[str, str]:
    """The child's package versions, completed on cuda from the backend's device record (driver, CUDA, GPU name)."""
    r = out.result
    software = dict(out.software)
    if r.backend == "cuda":
        for key, dev_key in (("driver", "driver"), ("cuda", "cuda"), ("gpu_name", "device_name")):
            if r.device.get(dev_key) and not software.get(key):
                software[key] = str(r.device[dev_key])
    elif r.device.get("driver"):
        software["driver"] = str(r.device["driver"])
    return software


#: the ``outside_allocator`` keys a measurement writes (a new one replaces the MEASURED ones it finds)
OUTSIDE_KEYS = ("context", "after_load", "total", "per_rank")


def outside_figures(r: Any) -> dict[str, tuple[int, str]]:
    """What a cuda run saw outside the caching allocator: ``context`` (before the first allocation),
    ``after_load`` (at the end of the phase) and ``total`` (at the device peak), each as (bytes, method)."""
    if r.backend != "cuda":
        return {}
    src = str(r.device.get("device_memory_source") or (r.context or {}).get("source") or "device memory")
    if "device-wide" in src:
        src += "; other processes on the device count too"
    out: dict[str, tuple[int, str]] = {}
    ctx = r.context or {}
    if ctx.get("used") is not None:
        used, reserved = int(ctx["used"]), int(ctx.get("reserved") or 0)
        out["context"] = (
            max(used - reserved, 0),
            f"{src}, after the CUDA context was created and before the first allocation"
            + (f" (minus {reserved} B the allocator had reserved)" if reserved else ""),
        )
    after = r.phases.get("after_load")
    if after is not None and after.outside is not None:
        out["after_load"] = (
            after.outside,
            f"{src} minus torch.cuda.memory_reserved, read together at the end of after_load",
        )
    at = r.outside_at_peak()
    if at is not None:
        out["total"] = (
            at[0],
            f"device peak minus torch.cuda.max_memory_reserved of the phase with the device peak ({at[1]}); "
            f"device memory from {src}",
        )
    return out


def _write_measurement(doc: Document, r: Any, command: str) -> None:
    dev = r.device
    set_plain(doc, ("measurement", "device"), r.backend if r.backend in ("cpu", "cuda") else "cpu", force=True)
    if dev.get("device_name"):
        set_plain(doc, ("measurement", "device_name"), str(dev["device_name"]), force=True)
    memory = dev.get("device_memory") or r.memory_limit
    if memory:
        set_plain(doc, ("measurement", "device_memory"), int(memory), force=True)
    set_plain(doc, ("measurement", "steps"), int(r.steps), force=True)
    set_plain(doc, ("measurement", "repeats"), 1, force=True)
    protocol = PROTOCOL
    if r.backend == "cpu":
        protocol += " (cpu tensor tracking"
        if r.memory_limit is not None:
            protocol += f"; simulated memory limit {r.memory_limit} B: an OOM here is simulated"
        protocol += ")"
    set_plain(doc, ("measurement", "protocol"), protocol, force=True)
    set_plain(doc, ("measurement", "date"), datetime.now(UTC).replace(microsecond=0).isoformat(), force=True)
    set_plain(doc, ("measurement", "command"), command, force=True)


def _write_software(doc: Document, software: dict[str, str], notes: list[str]) -> None:
    for key, value in software.items():
        declared = doc.get("software", key)
        if declared.known and str(declared.value) != value:
            notes.append(f"software.{key}: declared {declared.value!r}, measured with {value!r} (recorded)")
        set_plain(doc, ("software", key), value, force=True)


def _write_comparison(doc: Document, r: Any, notes: list[str]) -> None:
    peak = r.peak_allocated()
    if peak is None:
        return
    sub = doc.get("ledger", "calculated_subtotal")
    set_figure(doc, ("comparison", "measured_peak"), peak, "MEASURED", "metrics.peak_allocated", force=True)
    calc = sub.size()
    if calc is None:
        notes.append("ledger.calculated_subtotal is unknown: run `ledgerspec resolve` first for a comparison")
        return
    set_figure(
        doc,
        ("comparison", "calculated_subtotal"),
        calc,
        sub.effective_source(True),
        "ledger.calculated_subtotal",
        force=True,
    )
    if peak >= calc:
        set_figure(
            doc,
            ("comparison", "difference"),
            peak - calc,
            "CALCULATED",
            "comparison.measured_peak - comparison.calculated_subtotal",
            force=True,
        )
    else:
        notes.append(f"the measured peak is {format_size(calc - peak)} below the calculated subtotal")
    explanation = explain(doc, r)
    if explanation:
        set_plain(doc, ("comparison", "known_explanation"), explanation, force=True)
    else:
        notes.append(
            "comparison.known_explanation is left for you: the measured components do not all match "
            "the calculated ones (see x-measure)"
        )


def measured_components(r: Any) -> dict[str, int]:
    """Static components at the end of the steady state (after zero_grad, so gradients from the step phase)."""
    from ledgerspec.derivations.engine.tracker import by_component

    steady = r.phases.get("steady_state_peak") or r.phases.get("optimizer_step_peak")
    grads_phase = r.phases.get("backward_peak")
    if steady is None:
        return {}
    comps = by_component(steady.census)
    if grads_phase is not None:
        comps["gradients"] = by_component(grads_phase.census).get("gradients", 0)
    return comps


def explain(doc: Document, r: Any) -> str | None:
    """A known explanation when every calculated static component matches its measured bytes (within 1%)."""
    if r.oom or not r.complete:
        return None
    comps = measured_components(r)
    parts = []
    for key in F.RESIDENT:
        calc = doc.get("ledger", key).size()
        got = comps.get(key)
        if calc is None or got is None:
            return None
        if abs(got - calc) > MATCH_TOLERANCE * max(calc, 1):
            return None
        parts.append(f"{key} {got} B" + ("" if got == calc else f" (calculated {calc} B)"))
    top = max(r.phases.values(), key=lambda p: p.peak)
    act = f"{r.activations_saved} B held after one forward at the worst shape" if r.activations_saved else "unknown"
    return (
        f"measured static components match the calculated ones within {MATCH_TOLERANCE:.0%} ({', '.join(parts)}); "
        f"the difference is activations ({act}) and temporaries at the peak phase {top.name}"
    )


#: what a measurement owns: a new one replaces all of it (a human's comparison.known_explanation is kept)
_OWNED = {
    "phases": None,
    "metrics": None,
    "measurement": None,
    "comparison": ("calculated_subtotal", "measured_peak", "difference"),
    "result": ("oom", "oom_phase"),
}


def _forget_previous_measurement(doc: Document) -> None:
    """Drop the figures of an earlier measurement, so that none of them outlives this one (e.g. a cuda
    ``peak_reserved`` next to a cpu run, or a ``forward_peak`` the new run never reached)."""
    for section, keys in _OWNED.items():
        remove_keys(doc, section, keys, prune=False)
    for key in OUTSIDE_KEYS:  # an earlier measurement's; a figure the user declared stays
        if _measured(doc.get("outside_allocator", key).raw):
            remove(doc, ("outside_allocator", key), prune=False)
    remove(doc, ("x-measure",))


def _measured(raw: Any) -> bool:
    """A MEASURED figure, or a list of them (``per_rank``)."""
    if isinstance(raw, list):
        return bool(raw) and all(_measured(item) for item in raw)
    return isinstance(raw, dict) and raw.get("source") == "MEASURED"


def _write_result(doc: Document, r: Any) -> None:
    if r.oom and r.simulated_oom:
        set_figure(
            doc,
            ("result", "oom"),
            True,
            "MEASURED",
            note=f"simulated: tracked tensors exceeded --memory-limit {r.memory_limit} B on the cpu backend",
            size_comment=False,
            force=True,
        )
    else:
        set_plain(doc, ("result", "oom"), bool(r.oom), force=True)
    if r.oom:
        set_plain(doc, ("result", "oom_phase"), r.oom_phase, force=True)


def _extension(r: Any) -> dict[str, Any]:
    ext: dict[str, Any] = {
        "protocol": r.protocol,
        "backend": r.backend,
        "method": "cpu: a TorchDispatchMode tracker counts every live tensor storage once (exact nbytes); memory "
        "allocated inside kernels without the dispatcher and memory outside PyTorch is not seen"
        if r.backend == "cpu"
        else "cuda: caching-allocator counters per phase; device memory from "
        + str(r.device.get("device_memory_source")),
        "shapes": {
            "microbatch": r.microbatch,
            "gradient_accumulation": r.accumulation,
            "worst_sequence": r.seq_worst,
            "typical_sequence": r.seq_typical,
        },
        "phases": {
            name: {
                k: v
                for k, v in (
                    ("figure", rec.figure),
                    ("peak", rec.peak),
                    ("held", rec.held),
                    ("reserved_peak", rec.reserved_peak),
                    ("device_peak", rec.device_peak),
                    ("seconds", round(rec.seconds, 4)),
                    ("categories_at_peak", rec.categories_at_peak),
                    ("census", rec.census),
                )
                if v is not None
            }
            for name, rec in r.phases.items()
        },
    }
    if r.activations_saved is not None:
        ext["activations_saved"] = r.activations_saved
    if r.oom:
        ext["oom"] = {
            "phase": r.oom_phase,
            "during": r.oom_during,
            "message": r.oom_message,
            "simulated": r.simulated_oom,
            "peak_when_failed": r.failed_phase_peak,
        }
        for key, value in (
            ("reserved_when_failed", getattr(r, "failed_phase_reserved", None)),
            ("device_when_failed", getattr(r, "failed_phase_device", None)),
        ):
            if value is not None:
                ext["oom"][key] = value
        if r.snapshot_path:
            ext["oom"]["snapshot"] = r.snapshot_path
    for key in ("device_memory_source", "memory_history"):
        if r.device.get(key):
            ext[key] = r.device[key]
    if r.context is not None:
        ext["context"] = dict(r.context)
    outside = {name: rec.outside for name, rec in r.phases.items() if rec.outside is not None}
    if outside:
        ext["outside_allocator_at_phase_end"] = outside
    return ext


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--child":
        return _child_main(args[1], args[2])
    print("usage: python -m ledgerspec.derivations.measure.measurer --child REQUEST.json RESULT.json", file=sys.stderr)
    return EXIT_USAGE


__all__ = [
    "MeasurementCrash",
    "Outcome",
    "Request",
    "explain",
    "make_request",
    "measure",
    "outside_figures",
    "run_child",
    "run_request",
    "snapshot_path_for",
    "write_back",
]

if __name__ == "__main__":
    sys.exit(main())
