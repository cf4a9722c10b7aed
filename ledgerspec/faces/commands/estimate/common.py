"""What every ``estimate`` question shares: the estimate cache the arguments ask for, one estimate as they ask it,
the processes a sweep runs in, whether an answer is written, and the write-back with the status it supports."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_USAGE, LedgerspecError


def layers_of(args: argparse.Namespace) -> str:
    """How deep the step is traced: ``full`` with ``--full`` (every layer), else ``auto`` (two probe depths,
    extrapolated)."""
    return "full" if args.full else "auto"


def memory_of(doc: Any, device: int | None) -> int | None:
    """The device memory a question is asked against: ``--device-memory`` (``device``), else the ledger's
    ``result.target_device.memory`` (None: neither)."""
    from ledgerspec.derivations.estimate.estimator import device_memory_of

    return device if device is not None else device_memory_of(doc)


def cache_of(args: argparse.Namespace) -> Any:
    """The estimate cache the arguments ask for: None with ``--no-cache``."""
    from ledgerspec.derivations.estimate.cache import EstimateCache

    return None if args.no_cache else EstimateCache.from_environment()


def estimator_for(args: argparse.Namespace, parallel: bool = False) -> Any:
    """One estimate of a document (or a variant of it) as the arguments ask, through the estimate cache unless
    ``--no-cache``; ``parallel``: its depth probes in two processes (a single estimate: a sweep's estimates run in
    processes of their own instead)."""
    from ledgerspec.derivations.estimate.estimator import estimate

    layers, store = layers_of(args), cache_of(args)
    return lambda variant: estimate(variant, target=args.target, layers=layers, store=store, parallel=parallel)


def warm_for(args: argparse.Namespace) -> Any:
    """What a sweep runs before forking its workers: the stack imported, unless the cache answers every estimate."""
    from ledgerspec.derivations.estimate.search import warm_stack

    store = cache_of(args)
    question = {"target": args.target, "layers": layers_of(args), "offline": True}
    return lambda docs: warm_stack(docs, store, question)


def jobs_of(args: argparse.Namespace) -> int:
    """Processes for a sweep's estimates: ``--jobs``, else one per usable CPU (at most 4). On an idle 2-core machine
    two processes take the 5 x 5 sweep from 63 s to 35 s (benchmarks/results/estimate.md); the workers are forked
    only before this process has traced anything (:func:`ledgerspec.derivations.estimate.search.run_estimates`)."""
    import os

    if args.jobs < 0:
        raise LedgerspecError("--jobs must be >= 0", args.file, rule="usage", exit_code=EXIT_USAGE)
    if args.jobs:
        return int(args.jobs)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, usable))


def refuse_chosen_microbatches(doc: Any, args: argparse.Namespace) -> None:
    """Before anything is imported or traced: ``--fit microbatch`` and ``--what-if`` choose microbatches themselves
    (:func:`ledgerspec.derivations.estimate.search.refuse_chosen_microbatches`)."""
    asked = "--what-if" if args.what_if else "--fit microbatch" if args.fit and "microbatch" in args.fit else None
    if asked is not None:
        from ledgerspec.derivations.estimate.search import refuse_chosen_microbatches

        refuse_chosen_microbatches(doc, asked)


def writable(doc: Any, args: argparse.Namespace) -> bool:
    """Whether a --fit or --devices answer is written into the ledger (not with --dry-run, not into an intake)."""
    if args.dry_run:
        return False
    if doc.kind == "intake":
        print(
            f"{args.file}: an intake: nothing written (resolve it into a ledger to record the answer)", file=sys.stderr
        )
        return False
    from ledgerspec.contract.writer import check_writable

    check_writable(args.output or args.file, force=args.force)
    return True


def save_back(doc: Any, args: argparse.Namespace, what: str, fields: str = "") -> None:
    """Write ``what`` back (its ``fields`` named after "written") with the status it supports, or say the ledger is
    up to date when it already holds it."""
    from ledgerspec.faces.status import save_settled, settle_for

    _, status_change = settle_for(doc, args)
    unchanged = f"up to date ({what} as it holds it)"
    save_settled(doc, args.output or args.file, args.force, status_change, f"{what} written{fields}", unchanged)


__all__ = [
    "cache_of",
    "estimator_for",
    "jobs_of",
    "layers_of",
    "memory_of",
    "refuse_chosen_microbatches",
    "save_back",
    "warm_for",
    "writable",
]
