"""``ledgerspec shard FILE [--nproc N] [--estimate [--device-memory SIZE] [--target cuda|cpu]] [-o OUT] [--check]``.

With ``cpu_offload: true`` (FSDP2 ``CPUOffloadPolicy``, FSDP1 ``CPUOffload``) the calculated figures say what moves to
the host and what comes back per micro-step, and ``--estimate`` predicts the device's phases and each rank's
``host_peak`` (:mod:`ledgerspec.derivations.shard.offload.fsdp`).

Calculates what each rank holds under FSDP2 (``fully_shard`` per decoder layer + root), with ZeRO-1/2/3 for
comparison, prints a per-rank table and writes ``parallelism.x-per-rank`` into the document. ``--estimate``
also simulates each rank's FSDP2 training step (fake tensors, fake process group) and predicts its peak, with
the fit verdict against ``--device-memory`` or ``result.target_device.memory``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.contract.fields import AT_THE_EDGE, EDGE_WHY
from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, printable
from ledgerspec.faces.arguments import add_force, device_memory, device_memory_bytes, name_the_card
from ledgerspec.faces.status import add_keep_status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("shard", help="calculate per-rank state under FSDP2 (and ZeRO for comparison)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--nproc", type=int, metavar="N", help="ranks (default: parallelism.gpu_count)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the result here instead of in place")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file would change")
    p.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code (auto_map)")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="also predict each rank's phases: a simulated FSDP2 step per rank (fake tensors, no GPU)",
    )
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        type=device_memory,
        help="with --estimate: memory of ONE device, e.g. 24GiB, or a card of the device catalogue by name, e.g. "
        "'RTX 4090' (default: result.target_device.memory)",
    )
    p.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="with --estimate: model a CUDA GPU (attention kernels, 512 B rounding) or the CPU",
    )
    p.add_argument(
        "--layers",
        choices=("auto", "full"),
        default="auto",
        help="with --estimate: extrapolate from two probe depths (auto) or simulate every layer",
    )
    add_force(p)
    add_keep_status(p)
    p.set_defaults(run=run_shard)


def run_shard(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load_for
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.shard.options import cpu_offload
    from ledgerspec.derivations.shard.sharder import shard

    doc = load_for(args.file, "shard")
    memory = device_memory_bytes(args.device_memory, args.file)
    if (memory is not None or args.target != "cuda" or args.layers != "auto") and not args.estimate:
        raise LedgerspecError(
            "--device-memory, --target and --layers need --estimate", args.file, rule="usage", exit_code=EXIT_USAGE
        )
    from ledgerspec.faces.preflight import ANSWER_RULES, import_stack_quietly, preflight

    preflight(doc, "shard", echo=ANSWER_RULES if args.estimate else ())  # validate's input checks, before torch
    name_the_card(doc, args.device_memory)
    import_stack_quietly()
    result = shard(
        doc,
        nproc=args.nproc,
        offline=args.offline,
        trust_remote_code=args.trust_remote_code,
        estimate=args.estimate,
        target=args.target,
        device_memory=memory,
        layers=args.layers,
    )
    plan = result.plan
    reshard = result.extension["reshard_after_forward"]
    from ledgerspec.derivations.shard.options import zero_stage

    stage = zero_stage(doc)
    from ledgerspec.contract.config import UNSHARDED_STRATEGIES, declared_strategy

    declared = declared_strategy(doc)
    if declared in UNSHARDED_STRATEGIES:  # the declared strategy shards nothing: the table is a what-if
        print(
            f"declared: {declared} (every rank holds the whole model and its state: `ledgerspec "
            "estimate` sizes one); for comparison, if the model were sharded:"
        )
    if stage is not None:  # the declared strategy first: its row is below the FSDP table
        row = f"zero{stage}_offload" if cpu_offload(doc) is not None else f"zero{stage}"
        print(f"declared: DeepSpeed ZeRO-{stage} (its model state per rank: the {row} row below); for comparison:")
    if "no_shard" in result.extension:  # FSDP1 NO_SHARD: one rank of one listed for every rank
        print(result.extension["no_shard"])
    else:
        print(
            f"{result.extension['strategy'].split(' ')[0].upper()} on {plan.world_size} ranks, reshard_after_forward="
            f"{str(reshard).lower() if isinstance(reshard, bool) else reshard}"
        )
    print(
        f"{'rank':>4}  {'frozen':>11}  {'adapter':>11}  {'gradients':>11}  {'optimizer':>11}  {'gathered':>11}  "
        f"{'total':>11}"
    )
    for rs in plan.ranks:
        cells = (rs.frozen_base, rs.adapter, rs.gradients, rs.optimizer, rs.gathered, rs.with_gathered)
        print(f"{rs.rank:>4}  " + "  ".join(f"{format_size(v):>11}" for v in cells))
    offload = result.extension.get("cpu_offload")
    if isinstance(offload, dict):  # issue 16: what moves to the host under FSDP CPU offload
        print(f"CPU offload ({offload['policy']}): {offload['moves']}")
        for row in offload["ranks"]:
            host, device = format_size(row["host"]["value"]), format_size(row["device"]["value"])
            up, down = (format_size(row[k]["value"]) for k in ("to_device_per_micro_step", "to_host_per_micro_step"))
            print(
                f"{row['rank']:>4}  host {host}, device {device} (+ activations); "
                f"per micro-step {up} to the device, {down} to the host"
            )
    for key, z in result.zero.items():
        print(f"{key:>13}: device {format_size(z.device_total)} per rank, host {format_size(z.host)}")
    code = EXIT_OK
    if result.estimate is None:
        print("(model state only: `--estimate` predicts each rank's peak with activations and temporaries)")
    else:
        _print_estimate(result.estimate, result.device_memory)
        if result.device_memory is not None and not all(f.fits for f in result.estimate.fits(result.device_memory)):
            code = EXIT_FINDINGS  # as `ledgerspec estimate`: written, but it does not fit
    if doc.kind == "intake":  # as `ledgerspec estimate`: an intake is sized, not written into
        print(
            printable(
                f"{args.file}: an intake: nothing written (resolve it into a ledger to record the per-rank figures)"
            ),
            file=sys.stderr,
        )
        return code
    from ledgerspec.faces.status import save_settled, settle_for

    _, status_change = settle_for(doc, args)  # the status the per-rank figures support
    if args.check:
        if result.change is not None or status_change:
            # the field it would write first: the per-rank block, else a result field it records beside it
            what = (
                result.change.pointer.strip("/").replace("/", ".")
                if result.change is not None
                else "the declared status"
            )
            print(printable(f"{args.file}: would change {what}; run `ledgerspec shard`"), file=sys.stderr)
            return EXIT_FINDINGS
        return EXIT_OK
    if result.change is not None or args.output or status_change:
        # what was written, as `estimate` says it: the per-rank block when it changed (the status line says the rest)
        block = "parallelism.x-per-rank written" if result.change is not None else None
        save_settled(doc, args.output or args.file, args.force, status_change, block, "up to date")
    return code


def _print_estimate(est: Any, device_memory: int | None) -> None:
    from ledgerspec.contract.units import format_size

    print(f"estimate ({est.target}, simulated {est.strategy.upper()} step per rank, {est.plan.describe()}):")
    fits = est.fits(device_memory) if device_memory is not None else None
    device = est.device if fits is not None and est.device is not None else None
    for i, r in enumerate(est.ranks):
        verdict = ""
        if device is not None:
            verdict = f"; {device[i].sentence()}"
        elif fits is not None:
            verdict = f"; {fits[i].sentence()}"
        host = f", host_peak {format_size(r.host_peak)}" if r.host_peak is not None else ""
        acts = format_size(r.activations)
        print(f"{r.rank:>4}  predicted peak {format_size(r.peak)} allocated (activations {acts}){host}{verdict}")
    if fits is not None and device_memory is not None:
        answer = "fits" if all(f.fits for f in fits) else "does NOT fit"
        if device is not None and any(d.uncertain for d in device) and all(d.completes for d in device):
            answer = f"does NOT fit, {AT_THE_EDGE} ({EDGE_WHY})"
        if device is not None:
            worst = max(range(len(device)), key=lambda i: device[i].device_peak)
            for line in device[worst].lines():
                print(f"      rank {est.ranks[worst].rank}: {line}")
            print(
                f"{est.world_size} x {format_size(device_memory)}: {answer} on the device (worst rank device peak "
                f"{format_size(device[worst].device_peak)}; allocated {format_size(est.worst)})"
            )
        else:
            why = f": {est.allocated_only}" if est.allocated_only else ""
            print(
                f"{est.world_size} x {format_size(device_memory)}: {answer} (worst rank {format_size(est.worst)}; "
                f"allocated tensors only{why})"
            )
