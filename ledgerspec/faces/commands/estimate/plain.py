"""``ledgerspec estimate FILE``: the estimate of the declared configuration, phase by phase, what is alive at its
peak, and (with a device memory) the verdict on the device: the allocator model's reserved bytes and what lies
outside the allocator, per phase; written back into the ledger."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, printable
from ledgerspec.faces.commands.estimate.common import cache_of, estimator_for, layers_of, memory_of, save_back


def run_plain(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    """The estimate itself (no other question asked): printed, with the verdict on the device when a memory is
    known, and written back into a ledger (``ledger.activations``, ``x-estimate``) unless ``--dry-run``."""
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
    from ledgerspec.contract.writer import check_writable
    from ledgerspec.derivations.estimate.estimator import write_back

    if writes and doc.kind != "intake":
        check_writable(args.output or args.file, force=args.force)  # before the simulated step
    target_memory = memory_of(doc, device)
    prediction = None
    if target_memory is not None and args.target == "cuda":  # a verdict is asked: decided on the device
        est, prediction = _estimate_on_device(doc, args, target_memory, from_flag=device is not None)
    else:
        est = estimator_for(args, parallel=True)(doc)  # one estimate: its two depth probes at once
    _print(est, target_memory, prediction)
    from ledgerspec.checks.stale import shard_again
    from ledgerspec.contract.config import sharded_ranks

    ranks = sharded_ranks(doc)
    if ranks is not None:  # the verdict above is one GPU's of the whole model, not a rank's (validate -v says so too)
        command = shard_again(ranks).replace("FILE", args.file, 1)
        print(
            printable(
                f"  note: parallelism declares {ranks} sharded ranks: this is one GPU holding the whole model; "
                f"`{command}` predicts each rank"
            )
        )
    code = EXIT_OK
    fits = prediction.fits if prediction is not None else target_memory is None or est.fit(target_memory).fits
    if not fits:
        code = EXIT_FINDINGS
    if doc.kind == "intake":
        print(
            printable(f"{args.file}: an intake: nothing written (resolve it into a ledger to record the estimate)"),
            file=sys.stderr,
        )
        return code
    if not writes:
        return code
    changes = write_back(doc, est, target_memory, from_flag=device is not None, device=prediction)
    for ch in changes:
        if ch.skipped:
            print(printable(f"{args.file}: kept {ch.pointer}: {ch.skipped}"), file=sys.stderr)
    save_back(doc, args, "estimate", " (ledger.activations, x-estimate)")  # with the status the estimate supports
    return code


def _estimate_on_device(doc: Any, args: argparse.Namespace, memory: int, from_flag: bool) -> tuple[Any, Any]:
    """The estimate and its prediction on the device (a third probe and the allocator replay), through the estimate
    cache unless ``--no-cache``."""
    from ledgerspec.derivations.devices.prediction import estimate_on_device

    layers = layers_of(args)
    return estimate_on_device(doc, memory, from_flag, args.target, layers, store=cache_of(args), parallel=True)


def _print(est: Any, device: int | None, prediction: Any = None) -> None:
    from ledgerspec.contract.units import format_size

    out = sys.stdout
    print(f"predicted memory ({est.target} kernels, attention {est.attention}; {est.plan.describe()}):", file=out)
    for key, value in est.phases.items():
        print(f"  {key:<24}{format_size(value):>12}  {value:,} B", file=out)
    print(f"  {'activations':<24}{format_size(est.activations):>12}  {est.activations:,} B", file=out)
    print(f"  {'peak allocated':<24}{format_size(est.peak_allocated):>12}  {est.peak_allocated:,} B", file=out)
    host = est.figures.get("host.offloaded_peak")
    if host is not None:
        print(f"  {'offloaded to the host':<24}{format_size(host):>12}  {host:,} B (pinned host memory)", file=out)
    if est.at_peak:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_size(n)}" for name, n in est.at_peak.items() if n)
        print(f"  alive at the peak ({est.peak_phase}): {parts}", file=out)
        if est.at_peak.get("temporary"):
            print(
                "  (temporary: what no component owns: fp32 logits and loss, gradients in flight, attention and "
                "dequantization workspaces)",
                file=out,
            )
    if prediction is not None:
        _print_device(est, prediction)
    elif device is not None:
        verdict = est.fit(device)
        print(f"  {verdict.sentence()}", file=out)
        print(
            "  (allocated tensors only: the CUDA context, allocator cache and fragmentation need headroom too)",
            file=out,
        )
    for note in est.notes:  # the declared stack's known differences (docs: Declared stack)
        print(printable(f"  stack: {note}"), file=out)
    if est.cached_from is not None and prediction is not None and not prediction.cached:
        # a device asked about first: the step's stream kept in the cache, replayed for this device
        print(
            f"  time: {est.seconds + prediction.replayed.seconds:.1f} s (the step's stream from the estimate cache, "
            f"traced in {est.cached_from:.1f} s; the allocator replays {prediction.replayed.seconds:.1f} s)",
            file=out,
        )
    elif est.cached_from is not None:
        print(f"  time: {est.seconds:.1f} s (from the estimate cache; traced in {est.cached_from:.1f} s)", file=out)
    elif prediction is not None:
        print(
            f"  time: {est.seconds + prediction.replayed.seconds:.1f} s (three probes traced for the device verdict; "
            f"the allocator replays {prediction.replayed.seconds:.1f} s)",
            file=out,
        )
    else:
        print(f"  time: {est.seconds:.1f} s", file=out)


def _print_device(est: Any, p: Any) -> None:
    """The estimate on the device: per phase allocated, reserved and device-level bytes, then the verdict."""
    from ledgerspec.contract.units import format_size

    out = sys.stdout
    r = p.replayed
    print(
        printable(
            f"  on the device: {p.device_text()}, {format_size(p.total)}"
            + (f" declared, {format_size(p.cuda_total)} CUDA total" if p.cuda_total != p.total else "")
            + f" ({r.stream}, {r.events:,} allocation events, "
            f"replayed through the caching-allocator model; {p.conf_text()}):"
        ),
        file=out,
    )
    if r.fallback:
        print(printable(f"    ({r.fallback})"), file=out)
    head = ("phase", "allocated", "reserved", "device-level")
    print(f"    {head[0]:<24}{head[1]:>12}{head[2]:>12}{head[3]:>14}", file=out)
    for key, value in est.phases.items():
        ph = p.phases.get(key)
        reserved = format_size(ph.reserved) if ph is not None else "-"
        level = format_size(ph.device) if ph is not None else "-"
        print(f"    {key:<24}{format_size(value):>12}{reserved:>12}{level:>14}", file=out)
    print(
        f"    {'peak':<24}{format_size(est.peak_allocated):>12}{format_size(p.peak_reserved):>12}"
        f"{format_size(p.device_peak):>14}",
        file=out,
    )
    print(
        printable(f"  outside the allocator: {format_size(p.outside)} ({p.outside_provenance}): {p.outside_text()}"),
        file=out,
    )
    print(f"  {p.sentence()}", file=out)
    for line in p.lines():
        print(printable(f"  {line}"), file=out)
    # the allocated answer stays against the declared memory (as the ledger's result.fits and x-estimate.verdict's
    # allocated part are): said so where the device verdict replayed against another total (CUDA's, the card's)
    allocated = est.fit(p.total)
    print(
        f"  allocated only: {'fits' if allocated.fits else 'does NOT fit'}, peak {format_size(est.peak_allocated)}, "
        + (
            f"headroom {format_size(allocated.headroom)}"
            if allocated.fits
            else f"{format_size(-allocated.headroom)} over"
        )
        + (f" (of the declared {format_size(p.total)}, not the CUDA total)" if p.cuda_total != p.total else ""),
        file=out,
    )
    print(
        "  (device-level figures are a model, not a measurement: PyTorch 2.13's caching allocator replayed, and the "
        "bytes outside it as stated; `ledgerspec measure --device cuda` measures both)",
        file=out,
    )


__all__ = ["run_plain"]
