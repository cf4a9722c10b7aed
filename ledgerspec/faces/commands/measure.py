"""``ledgerspec measure`` and ``ledgerspec triage``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, PrintableLines, printable
from ledgerspec.faces.arguments import add_force, positive_size
from ledgerspec.faces.status import add_keep_status


def register(sub: Any) -> None:
    m = sub.add_parser("measure", help="run the measurement protocol (child process) and write MEASURED figures")
    m.add_argument("file", metavar="FILE")
    m.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cpu",
        help="cuda: allocator counters + NVML; cpu: tensor-level tracking (never VALIDATED)",
    )
    m.add_argument("--steps", type=int, default=2, help="repeated representative steps for the steady state (>= 2)")
    m.add_argument("-o", "--output", metavar="OUT", help="write the measured ledger here instead of in place")
    m.add_argument(
        "--memory-limit",
        metavar="SIZE",
        type=positive_size,
        help="cpu only: a simulated out-of-memory when tracked tensors exceed SIZE (e.g. 2MiB)",
    )
    m.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="measure every rank of an FSDP2 run under torchrun with N processes (gloo on cpu, nccl on "
        "cuda); writes parallelism.per_rank_peak and the worst rank into metrics",
    )
    add_force(m)
    add_keep_status(m)
    m.set_defaults(run=_measure)

    t = sub.add_parser("triage", help="fill the OOM Triage Worksheet by controlled measurements")
    t.add_argument("file", metavar="FILE")
    t.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    t.add_argument("--steps", type=int, default=2)
    t.add_argument("-o", "--output", metavar="OUT", help="write the worksheet here instead of in place")
    t.add_argument("--memory-limit", metavar="SIZE", type=positive_size, help="cpu only: the simulated device memory")
    add_force(t)
    t.set_defaults(run=_triage)


def _command(name: str, args: argparse.Namespace) -> str:
    import shlex

    parts = [name, args.file, "--device", args.device, "--steps", str(args.steps)]
    if args.output:
        parts += ["-o", args.output]
    if args.memory_limit:
        parts += ["--memory-limit", str(args.memory_limit)]
    if getattr(args, "nproc", None) is not None:
        parts += ["--nproc", str(args.nproc)]
    return "ledgerspec " + shlex.join(parts)


def _measure(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return _measure_ranks(args)
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.measure.measurer import measure, snapshot_path_for

    doc, target = _open(args, "measure")
    outcome = measure(
        doc,
        device=args.device,
        steps=args.steps,
        memory_limit=args.memory_limit,
        command=_command("measure", args),
        snapshot_path=snapshot_path_for(target),
    )
    report = _save(doc, target, args)
    r = outcome.result
    err = PrintableLines(sys.stderr)  # paths and messages quote user strings
    for note in outcome.notes:
        print(f"{target}: note: {note}", file=err)
    if r.oom:
        kind = "simulated out-of-memory" if r.simulated_oom else "out of memory"
        print(f"{target}: {kind} in phase {r.oom_phase} ({r.oom_message})", file=err)
        if r.snapshot_path:
            print(
                f"{target}: allocator snapshot saved to {r.snapshot_path} (open it at https://pytorch.org/memory_viz)",
                file=err,
            )
    peak = r.peak_allocated()
    print(
        f"{target}: measured on {r.backend}: peak allocated "
        f"{format_size(peak) if peak is not None else 'n/a'}; supported status {report.supported_status}",
        file=err,
    )
    for reason in report.reasons[:3]:
        print(f"  - {reason}", file=err)
    return EXIT_FINDINGS if r.oom else EXIT_OK


def _open(args: argparse.Namespace, command: str) -> tuple[Any, str]:
    """The ledger to measure, and where it will be written (checked before minutes of measuring)."""
    from ledgerspec.contract.document import load_ledger
    from ledgerspec.contract.writer import check_writable
    from ledgerspec.faces.preflight import preflight

    doc = load_ledger(args.file, command)
    preflight(doc, command)  # validate's input checks, before a child process imports torch
    target = args.output or args.file
    check_writable(target, force=args.force)
    return doc, target


def _save(doc: Any, target: str, args: argparse.Namespace) -> Any:
    """Set the status the measurement supports (up or down; ``--keep-status`` keeps it), then write the ledger."""
    from ledgerspec.faces.status import save_settled, settle_for

    report, change = settle_for(doc, args)
    save_settled(doc, target, args.force, change)
    return report


def _measure_ranks(args: argparse.Namespace) -> int:
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.measure.dist import measure_dist

    if args.memory_limit:
        raise LedgerspecError(
            "--memory-limit is not supported with --nproc: a simulated OOM on one rank would leave "
            "the others waiting in a collective",
            args.file,
            rule="usage",
            exit_code=EXIT_USAGE,
        )
    doc, target = _open(args, "measure")
    from ledgerspec.contract.config import UNSHARDED_STRATEGIES, declared_strategy

    declared = declared_strategy(doc)
    if declared in UNSHARDED_STRATEGIES:  # it ran FSDP2 ranks and wrote strategy: fsdp2 over the declared one
        raise LedgerspecError(
            f"--nproc runs FSDP1, FSDP2 or ZeRO ranks; the declared strategy {declared} shards nothing",
            args.file,
            rule="usage",
            exit_code=EXIT_USAGE,
            hint="each data-parallel rank holds the whole model: `ledgerspec measure FILE` measures one; or declare "
            "the sharded strategy to measure",
        )
    gpus = doc.get("parallelism", "gpu_count").integer()
    outcome = measure_dist(doc, args.nproc, device=args.device, steps=args.steps, command=_command("measure", args))
    report = _save(doc, target, args)
    err = PrintableLines(sys.stderr)  # paths and messages quote user strings
    if gpus is not None and gpus != args.nproc:
        print(
            f"{target}: note: parallelism.gpu_count {gpus} is now {args.nproc}, the ranks measured (the ledger records "
            "the run)",
            file=err,
        )
    for note in outcome.notes:
        print(f"{target}: note: {note}", file=err)
    for out in outcome.ranks:
        print(f"{target}: rank {out.rank}: peak allocated {format_size(out.peak)}", file=err)
    print(
        f"{target}: measured {len(outcome.ranks)} {outcome.strategy} ranks on {outcome.result.backend}: worst rank "
        f"{format_size(outcome.worst)}; supported status {report.supported_status}",
        file=err,
    )
    for reason in report.reasons[:3]:
        print(f"  - {reason}", file=err)
    return EXIT_OK


def _triage(args: argparse.Namespace) -> int:
    from ledgerspec.contract.writer import save
    from ledgerspec.derivations.measure.triage import triage

    doc, target = _open(args, "triage")
    outcome = triage(doc, device=args.device, steps=args.steps, memory_limit=args.memory_limit)
    save(doc, target, force=args.force)
    for line in outcome.summary(target):
        print(printable(line))
    return EXIT_OK
