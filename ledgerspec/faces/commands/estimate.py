"""``ledgerspec estimate FILE [--device-memory SIZE] [-o OUT] [--sweep NAME=V1,V2 ...] [--target cuda|cpu]``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError
from ledgerspec.faces.arguments import device_memory, device_memory_bytes
from ledgerspec.faces.status import add_keep_status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="GPU-free activation and phase-peak estimate from a simulated training step",
        description="Simulate one training step (and a steady-state step) of the exact configuration under "
        "FakeTensorMode; fill ledger.activations and x-estimate; say whether it fits a device. "
        "Exit 1 when a device memory is given and the prediction does not fit.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument(
        "--device-memory", metavar="SIZE", type=device_memory, help="target device memory, e.g. 24GiB or 80GB"
    )
    p.add_argument("-o", "--output", metavar="OUT", help="write the updated ledger here instead of in place")
    p.add_argument(
        "--sweep",
        nargs="+",
        metavar="NAME=V1,V2",
        help="print the Memory Sensitivity Matrix over these inputs (microbatch, max_length, "
        "gradient_checkpointing, rank, optimizer, attention_implementation); writes nothing",
    )
    p.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the device whose kernels are modelled (cpu: the CPU's own kernels, for checks)",
    )
    p.add_argument("--full", action="store_true", help="trace every layer instead of extrapolating (slower)")
    p.add_argument("--dry-run", action="store_true", help="print the estimate, write nothing")
    add_keep_status(p)
    p.set_defaults(run=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load
    from ledgerspec.faces.preflight import preflight

    doc = load(args.file)
    device = device_memory_bytes(args.device_memory, args.file)
    preflight(doc, "estimate")  # validate's input checks, before torch is imported
    if args.sweep:
        return _run_sweep(doc, args, device)
    writes = not args.dry_run
    if doc.kind == "intake" and writes and args.output:
        line, col = doc.position("/ledgerspec")
        raise LedgerspecError(
            "an intake holds no ledger figures: resolve it into a ledger first",
            doc.path,
            line,
            col,
            rule="estimate",
            hint=f"ledgerspec resolve {args.file} -o ledger.yaml",
            exit_code=EXIT_USAGE,
        )
    from ledgerspec.contract.writer import check_writable, save
    from ledgerspec.derivations.estimate.estimator import device_memory_of, estimate, write_back

    if writes and doc.kind != "intake":
        check_writable(args.output or args.file)  # before the simulated step
    est = estimate(doc, target=args.target, layers="full" if args.full else "auto")
    target_memory = device if device is not None else device_memory_of(doc)
    _print(est, target_memory)
    code = EXIT_OK
    if target_memory is not None and not est.fit(target_memory).fits:
        code = EXIT_FINDINGS
    if doc.kind == "intake":
        print(
            f"{args.file}: an intake: nothing written (resolve it into a ledger to record the estimate)",
            file=sys.stderr,
        )
        return code
    if not writes:
        return code
    changes = write_back(doc, est, target_memory, from_flag=device is not None)
    for ch in changes:
        if ch.skipped:
            print(f"{args.file}: kept {ch.pointer}: {ch.skipped}", file=sys.stderr)
    from ledgerspec.faces.status import settle_for

    _, status_change = settle_for(doc, args)  # the status the estimate supports
    target = args.output or args.file
    save(doc, target)
    print(f"{target}: estimate written (ledger.activations, x-estimate)", file=sys.stderr)
    if status_change:
        print(status_change, file=sys.stderr)
    return code


def _print(est: Any, device: int | None) -> None:
    from ledgerspec.contract.units import format_size

    out = sys.stdout
    print(f"predicted memory ({est.target} kernels, attention {est.attention}; {est.plan.describe()}):", file=out)
    for key, value in est.phases.items():
        print(f"  {key:<24}{format_size(value):>12}  {value:,} B", file=out)
    print(f"  {'activations':<24}{format_size(est.activations):>12}  {est.activations:,} B", file=out)
    print(f"  {'peak allocated':<24}{format_size(est.peak_allocated):>12}  {est.peak_allocated:,} B", file=out)
    if est.at_peak:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_size(n)}" for name, n in est.at_peak.items() if n)
        print(f"  alive at the peak ({est.peak_phase}): {parts}", file=out)
        if est.at_peak.get("temporary"):
            print(
                "  (temporary: what no component owns: fp32 logits and loss, gradients in flight, attention and "
                "dequantization workspaces)",
                file=out,
            )
    if device is not None:
        verdict = est.fit(device)
        print(f"  {verdict.sentence()}", file=out)
        print(
            "  (allocated tensors only: the CUDA context, allocator cache and fragmentation need headroom too)",
            file=out,
        )
    print(f"  time: {est.seconds:.1f} s", file=out)


def _run_sweep(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    from ledgerspec.derivations.estimate import sweep
    from ledgerspec.derivations.estimate.estimator import device_memory_of, estimate

    axes = sweep.parse_axes(args.sweep)
    target_memory = device if device is not None else device_memory_of(doc)
    rows = []
    for point in sweep.grid(axes):
        est = estimate(sweep.apply(doc, point), target=args.target, layers="full" if args.full else "auto")
        rows.append((point, est.peak_allocated))
    sys.stdout.write(sweep.render(rows, axes, doc, target_memory))
    if target_memory is not None and sweep.largest_fitting(rows, doc, target_memory) is None:
        return EXIT_FINDINGS  # as a single estimate that does not fit
    return EXIT_OK
