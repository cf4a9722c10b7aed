"""``ledgerspec estimate FILE [--device-memory SIZE] [-o OUT] [--sweep NAME=V1,V2 ...] [--fit NAME ...]
[--devices [CATALOGUE]] [--what-if] [--target cuda|cpu]``: the arguments, and which question they ask.

A module per question: :mod:`.plain` (the estimate of the declared configuration and its verdict on the device),
:mod:`.fit` (``--fit``: the largest microbatch or length that fits), :mod:`.devices` (``--devices``: which
accelerator and how many), :mod:`.sweep` (``--sweep`` and ``--what-if``: a grid of configurations); what they share
(the estimate cache, the write-back) is :mod:`.common`'s."""

from __future__ import annotations

import argparse
from typing import Any

from ledgerspec.errors import EXIT_USAGE, LedgerspecError
from ledgerspec.faces.arguments import (
    add_force,
    device_memory,
    device_memory_bytes,
    name_the_card,
    target_memory_note,
)
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
        "--device-memory",
        metavar="SIZE",
        type=device_memory,
        help="target device memory, e.g. 24GiB or 80GB, or a card of the device catalogue by name, e.g. 'RTX 4090'",
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
    p.add_argument(
        "--fit",
        nargs="+",
        choices=("microbatch", "max_length"),
        metavar="NAME",
        help="find the largest microbatch and/or max_length that fits the device (--device-memory or "
        "result.target_device.memory), with the peak there and at the value above; writes x-fit",
    )
    p.add_argument(
        "--fit-step", type=int, default=64, metavar="N", help="with --fit max_length: lengths in steps of N tokens"
    )
    p.add_argument(
        "--exact", action="store_true", help="with --fit microbatch: trace the answer and the value above it too"
    )
    p.add_argument(
        "--devices",
        nargs="?",
        const="",
        metavar="CATALOGUE",
        help="compare common accelerators (and 1/2/4/8 GPUs with the declared sharding): fits, headroom, largest "
        "microbatch; CATALOGUE: a YAML file that adds or replaces devices; writes x-devices",
    )
    p.add_argument(
        "--what-if",
        action="store_true",
        help="estimate a grid around the declared configuration (microbatch 1-16, max_length x1/4..x2, checkpointing "
        "off/on) and store it in x-what-if, for the sliders of `ledgerspec report --html`",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="--sweep: run its estimates in N processes (default: one per CPU this process may use, at most 4; 1: "
        "serial)",
    )
    p.add_argument("--full", action="store_true", help="trace every layer instead of extrapolating (slower)")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="trace again instead of answering from the estimate cache (LEDGERSPEC_CACHE_DIR, default "
        "~/.cache/ledgerspec; safe to delete)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the estimate, write nothing")
    add_force(p)
    p.add_argument("-v", "--verbose", action="store_true", help="--sweep: the components alive at each peak")
    add_keep_status(p)
    p.set_defaults(run=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    from ledgerspec.contract.document import load_for
    from ledgerspec.faces.preflight import ANSWER_RULES, import_stack_quietly, preflight

    doc = load_for(args.file, "estimate")  # before torch is imported
    device = device_memory_bytes(args.device_memory, args.file)
    preflight(doc, "estimate", echo=ANSWER_RULES)  # validate's input checks, before torch is imported
    name_the_card(doc, args.device_memory)
    import_stack_quietly()
    if device is None:
        target_memory_note(doc, args.file)
    modes = [
        name
        for name, on in (
            ("--sweep", args.sweep),
            ("--fit", args.fit),
            ("--devices", args.devices),
            ("--what-if", args.what_if),
        )
        if on is not None and on is not False
    ]
    if len(modes) > 1:
        raise LedgerspecError(
            f"{' and '.join(modes)} are separate questions: ask one at a time",
            args.file,
            rule="usage",
            exit_code=EXIT_USAGE,
        )
    if args.exact and "microbatch" not in (args.fit or ()):
        raise LedgerspecError(
            "--exact traces the answer of --fit microbatch: without it there is nothing to trace again",
            args.file,
            rule="usage",
            exit_code=EXIT_USAGE,
            hint="add --fit microbatch, or leave --exact out",
        )
    from ledgerspec.faces.commands.estimate.common import refuse_chosen_microbatches
    from ledgerspec.faces.commands.estimate.devices import run_devices
    from ledgerspec.faces.commands.estimate.fit import run_fit
    from ledgerspec.faces.commands.estimate.plain import run_plain
    from ledgerspec.faces.commands.estimate.sweep import run_sweep, run_what_if

    refuse_chosen_microbatches(doc, args)
    if args.sweep:
        return run_sweep(doc, args, device)
    if args.fit:
        return run_fit(doc, args, device)
    if args.devices is not None:
        return run_devices(doc, args)
    if args.what_if:
        return run_what_if(doc, args, device)
    return run_plain(doc, args, device)


__all__ = ["register", "run_estimate"]
