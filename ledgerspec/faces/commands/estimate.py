"""``ledgerspec estimate FILE [--device-memory SIZE] [-o OUT] [--sweep NAME=V1,V2 ...] [--fit NAME ...]
[--devices [CATALOGUE]] [--what-if] [--target cuda|cpu]``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, printable
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
    from ledgerspec.faces.preflight import import_stack_quietly, preflight

    doc = load_for(args.file, "estimate")  # before torch is imported
    device = device_memory_bytes(args.device_memory, args.file)
    preflight(doc, "estimate")  # validate's input checks, before torch is imported
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
    _refuse_chosen_microbatches(doc, args)
    if args.sweep:
        return _run_sweep(doc, args, device)
    if args.fit:
        return _run_fit(doc, args, device)
    if args.devices is not None:
        return _run_devices(doc, args)
    if args.what_if:
        return _run_what_if(doc, args, device)
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
    from ledgerspec.derivations.estimate.estimator import device_memory_of, write_back

    if writes and doc.kind != "intake":
        check_writable(args.output or args.file, force=args.force)  # before the simulated step
    target_memory = device if device is not None else device_memory_of(doc)
    prediction = None
    if target_memory is not None and args.target == "cuda":  # a verdict is asked: decided on the device
        est, prediction = _estimate_on_device(doc, args, target_memory, from_flag=device is not None)
    else:
        est = _estimate_fn(args, parallel=True)(doc)  # one estimate: its two depth probes at once
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
    _save(doc, args, "estimate", " (ledger.activations, x-estimate)")  # with the status the estimate supports
    return code


def _estimate_on_device(doc: Any, args: argparse.Namespace, memory: int, from_flag: bool) -> tuple[Any, Any]:
    """The estimate and its prediction on the device (a third probe and the allocator replay), through the estimate
    cache unless ``--no-cache``."""
    from ledgerspec.derivations.devices.prediction import estimate_on_device

    layers = "full" if args.full else "auto"
    return estimate_on_device(doc, memory, from_flag, args.target, layers, store=_store(args), parallel=True)


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


def _estimate_fn(args: argparse.Namespace, parallel: bool = False) -> Any:
    """One estimate of a document (or a variant of it) as the arguments ask, through the estimate cache unless
    ``--no-cache``; ``parallel``: its depth probes in two processes (a single estimate: a sweep's estimates run in
    processes of their own instead)."""
    from ledgerspec.derivations.estimate.estimator import estimate

    layers = "full" if args.full else "auto"
    store = _store(args)
    return lambda variant: estimate(variant, target=args.target, layers=layers, store=store, parallel=parallel)


def _warm(args: argparse.Namespace) -> Any:
    """What a sweep runs before forking its workers: the stack imported, unless the cache answers every estimate."""
    from ledgerspec.derivations.estimate.search import warm_stack

    store = _store(args)
    question = {"target": args.target, "layers": "full" if args.full else "auto", "offline": True}
    return lambda docs: warm_stack(docs, store, question)


def _run_sweep(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    import time

    from ledgerspec.derivations.estimate import search, sweep
    from ledgerspec.derivations.estimate.estimator import device_memory_of

    started = time.perf_counter()
    axes = sweep.parse_axes(args.sweep)
    target_memory = device if device is not None else device_memory_of(doc)
    points = sweep.grid(axes)
    grid = _grid_sweep(doc, args, points) if {a.name for a in axes} & {"microbatch", "max_length"} else None
    if grid is not None:
        rows = grid.rows
    else:
        rows, traced = search.sweep_rows(doc, points, _estimate_fn(args), jobs=_jobs(args), warm=_warm(args))
    table = [(r.point, r.peak) for r in rows]
    checks = target_memory is not None and args.target == "cuda"  # the table's answer decided on the device
    sys.stdout.write(sweep.render(table, axes, doc, target_memory, on_device=checks))
    modelled = sum(1 for r in rows if not r.traced)
    if args.verbose:
        _print_components(rows)
    if grid is not None:
        for note in grid.notes:
            print(printable(f"  {note}"))
        print(
            f"({len(rows)} configurations from {grid.estimates} traced estimates"
            + (f" and {grid.checks} check probe(s)" if grid.checks else "")
            + (
                f"; {modelled} written from the traced allocation streams (every allocation affine in the microbatch "
                "and of degree <= 2 in the length, checked event by event at an untraced point)"
                if modelled
                else ""
            )
            + (f"; from the estimate cache, traced in {grid.cached_from:.1f} s" if grid.cached_from is not None else "")
            + f"; {time.perf_counter() - started:.1f} s)"
        )
    else:
        print(
            f"({len(rows)} configurations from {traced} traced estimates"
            + (f"; {modelled} from the microbatch model, within 0.5 % of full traces in tests" if modelled else "")
            + f"; {time.perf_counter() - started:.1f} s)"
        )
    on_device = (
        _configurations_on_device(doc, args, table, target_memory, device)
        if checks and target_memory is not None
        else None
    )
    if target_memory is not None and (
        sweep.largest_fitting(table, doc, target_memory) is None or (on_device is not None and on_device.best is None)
    ):
        return EXIT_FINDINGS  # as a single estimate that does not fit
    return EXIT_OK


def _configurations_on_device(
    doc: Any, args: argparse.Namespace, table: list[tuple[dict[str, Any], int]], memory: int, asked: int | None
) -> Any:
    """The table's answer checked on the device, best first (:mod:`ledgerspec.derivations.devices.sweep_check`),
    its lines printed; None when no configuration's allocated tensors fit (nothing to check). ``asked``: the memory
    given with ``--device-memory`` (None: the ledger's target device's)."""
    from ledgerspec.derivations.devices.sweep_check import check_configurations

    layers = "full" if args.full else "auto"
    checked = check_configurations(
        doc, table, memory, from_flag=asked is not None, store=_store(args), parallel=True, layers=layers
    )
    if checked.allocated_best is None:
        return None
    for line in checked.lines():
        print(printable(line))
    print(
        "(on the device: the allocator model's reserved bytes plus what lies outside the allocator, a model, not "
        f"measured; the table counts allocated tensors only; {checked.seconds:.1f} s)"
    )
    return checked


def _grid_sweep(doc: Any, args: argparse.Namespace, points: list[dict[str, Any]]) -> Any:
    """A microbatch x max_length sweep from a few traced streams
    (:func:`ledgerspec.derivations.estimate.gridsweep.grid_sweep_rows`), through the estimate cache (the whole
    sweep is one entry) unless ``--no-cache``; None when the sweep has no length to follow."""
    from ledgerspec.derivations.estimate.cache import cached
    from ledgerspec.derivations.estimate.gridsweep import GridSweep, grid_sweep_rows
    from ledgerspec.derivations.estimate.search import SweepRow

    layers = "full" if args.full else "auto"
    question = {"target": args.target, "layers": layers, "offline": True, "sweep": points}

    def compute() -> Any:
        import time

        from ledgerspec.derivations.estimate.estimator import prepare

        started = time.perf_counter()
        out = grid_sweep_rows(
            doc,
            points,
            args.target,
            layers,
            _estimate_fn(args),
            jobs=_jobs(args),
            warm=lambda: prepare(doc, args.target, layers).warm(),
        )
        if out is not None:
            out.seconds = time.perf_counter() - started
        return out

    class NothingToKeep(Exception):
        """The sweep has no length to follow: nothing is kept, the caller sweeps point by point."""

    def encode(result: Any) -> dict[str, Any]:
        if result is None:
            raise NothingToKeep
        return {
            "rows": [[r.phases, r.at_peak, r.traced] for r in result.rows],
            "estimates": result.estimates,
            "checks": result.checks,
            "notes": list(result.notes),
            "seconds": result.seconds,
        }

    def decode(value: dict[str, Any], _seconds: float) -> Any:
        rows = [SweepRow(p, dict(ph), dict(at), bool(t)) for p, (ph, at, t) in zip(points, value["rows"], strict=True)]
        out = GridSweep(rows, int(value["estimates"]), int(value["checks"]), list(value["notes"]))
        out.cached_from = float(value["seconds"])
        return out

    try:
        return cached(_store(args), doc, question, compute, encode, decode)
    except NothingToKeep:  # only that: any other error is the user's to see, not a silent slow path
        return None


def _jobs(args: argparse.Namespace) -> int:
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


def _print_components(rows: list[Any]) -> None:
    from ledgerspec.contract.units import format_size

    print(
        "what is alive at each peak (traced: an estimate; model: written from traced ones, the streams of a traced "
        "microbatch x length grid, or the line through two traced microbatches of its length):"
    )
    for r in rows:
        point = ", ".join(f"{k}={_show(v)}" for k, v in r.point.items())
        parts = ", ".join(f"{k.replace('_', ' ')} {format_size(n)}" for k, n in r.at_peak.items() if n)
        how = "traced" if r.traced else "model"
        print(f"  {point}: {format_size(r.peak)} at {r.peak_phase} ({how}) = {parts}")


def _show(v: Any) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def _refuse_chosen_microbatches(doc: Any, args: argparse.Namespace) -> None:
    """Before anything is imported or traced: ``--fit microbatch`` and ``--what-if`` choose microbatches themselves
    (:func:`ledgerspec.derivations.estimate.search.refuse_chosen_microbatches`)."""
    asked = "--what-if" if args.what_if else "--fit microbatch" if args.fit and "microbatch" in args.fit else None
    if asked is not None:
        from ledgerspec.derivations.estimate.search import refuse_chosen_microbatches

        refuse_chosen_microbatches(doc, asked)


def _fit_memory(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    from ledgerspec.derivations.estimate.estimator import device_memory_of

    memory = device if device is not None else device_memory_of(doc)
    if memory is None:
        raise LedgerspecError(
            "--fit needs a device memory",
            args.file,
            rule="usage",
            hint="pass --device-memory 24GiB or set result.target_device.memory",
            exit_code=EXIT_USAGE,
        )
    return memory


def _run_fit(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    memory = _fit_memory(doc, args, device)
    if args.fit_step < 1:
        raise LedgerspecError("--fit-step must be >= 1", args.file, rule="usage", exit_code=EXIT_USAGE)
    writes = _writable(doc, args)
    with contextlib.ExitStack() as helpers:  # the microbatch streams' helper process is stopped at its end
        answers, on_device = _fit_answers(doc, args, memory, helpers)
    if on_device:
        print(
            "(on the device: the allocator model's reserved bytes plus what lies outside the allocator, a model, not "
            "measured; the allocated answer above counts tensors only)"
        )
    else:
        print("(allocated tensors only: the CUDA context, allocator cache and fragmentation need headroom too)")
    if writes:
        from ledgerspec.contract.edit import set_extension
        from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, digests

        block = dict(doc.get("x-fit").raw) if isinstance(doc.get("x-fit").raw, dict) else {}
        block.update({a.name: a.to_extension() for a in answers})
        for name, checked in on_device.items():
            block[name]["device"] = checked.to_extension()
        block["source"] = "CALCULATED"
        block["inputs"] = digests(doc, WORKLOAD_INPUTS)
        set_extension(doc, ("x-fit",), block)
        _save(doc, args, "x-fit")
    fitting = all(a.largest is not None for a in answers) and all(c.largest is not None for c in on_device.values())
    return EXIT_OK if fitting else EXIT_FINDINGS


def _fit_answers(
    doc: Any, args: argparse.Namespace, memory: int, helpers: contextlib.ExitStack
) -> tuple[list[Any], dict[str, Any]]:
    """Each ``--fit`` answer, printed as it comes, with its check on the device (cuda): the answers and the checks
    by name; the :class:`MicrobatchSteps` the microbatch checks use is entered on ``helpers`` (closed with it)."""
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.estimate import search

    estimate_fn = _estimate_fn(args, parallel=True)  # the first estimate's probes at once (the rest follow it)
    answers = []
    on_device: dict[str, Any] = {}
    steps = None
    for name in dict.fromkeys(args.fit):
        if name == "microbatch":
            if args.target == "cuda":  # decided on the device: the search's traces keep their streams for it
                from ledgerspec.derivations.devices.along import MicrobatchSteps

                layers = "full" if args.full else "auto"
                steps = helpers.enter_context(MicrobatchSteps(doc, args.target, layers, _store(args), parallel=True))
                answer = search.fit_microbatch(doc, memory, steps.estimate, exact=args.exact)
            else:
                answer = search.fit_microbatch(doc, memory, estimate_fn, exact=args.exact)
        else:
            answer = search.fit_length(doc, memory, estimate_fn, step=args.fit_step)
        answers.append(answer)
        print(answer.sentence())
        print(f"  {answer.note}")
        if answer.at_peak and answer.largest is not None:
            parts = ", ".join(f"{k.replace('_', ' ')} {format_size(n)}" for k, n in answer.at_peak.items() if n)
            print(f"  alive at the peak of {answer.largest}: {parts}")
        if args.target == "cuda" and answer.largest is not None:  # the allocated answer, decided on the device
            checked = _check_on_device(
                doc,
                args,
                answer,
                memory,
                steps if name == "microbatch" else None,
                from_flag=args.device_memory is not None,
            )
            on_device[name] = checked
            for line in checked.lines():
                print(printable(f"  {line}"))
            if steps is not None and name == "microbatch":
                for line in steps.lines():
                    print(printable(f"  {line}"))
            answer.seconds += checked.seconds
        print(f"  time: {answer.seconds:.1f} s")
    return answers, on_device


def _check_on_device(
    doc: Any, args: argparse.Namespace, answer: Any, memory: int, steps: Any = None, from_flag: bool = False
) -> Any:
    """``answer`` checked on the device (:mod:`ledgerspec.derivations.devices.fit_check`), through the estimate
    cache unless ``--no-cache``; ``steps``: the microbatch streams the search kept
    (:class:`~ledgerspec.derivations.devices.along.MicrobatchSteps`)."""
    from ledgerspec.derivations.devices.fit_check import check_on_device

    step = 1 if answer.name == "microbatch" else args.fit_step
    layers = "full" if args.full else "auto"
    return check_on_device(
        doc,
        answer,
        memory,
        step=step,
        store=_store(args),
        parallel=True,
        along=steps,
        from_flag=from_flag,
        layers=layers,
    )


def _store(args: argparse.Namespace) -> Any:
    """The estimate cache the arguments ask for: None with ``--no-cache``."""
    from ledgerspec.derivations.estimate.cache import EstimateCache

    return None if args.no_cache else EstimateCache.from_environment()


def _run_devices(doc: Any, args: argparse.Namespace) -> int:
    import time

    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.devices import compare
    from ledgerspec.derivations.devices.catalogue import load_catalogue, usable_note
    from ledgerspec.derivations.devices.comparison import EXTENSION

    started = time.perf_counter()
    catalogue = load_catalogue(args.devices or None)
    writes = _writable(doc, args)
    from ledgerspec.derivations.devices.prediction import step_and_estimate

    layers = "full" if args.full else "auto"
    store = _store(args)

    def single_step() -> Any:  # one set of traces: the declared microbatch's estimate (cached) and the stream
        return step_and_estimate(doc, "cuda", layers, store=store, parallel=True)

    on_device = args.target == "cuda"
    from ledgerspec.derivations.devices.comparison import cached_compare

    result = cached_compare(
        doc,
        catalogue,
        store,
        {"target": args.target, "layers": layers, "offline": True, "on_device": on_device},
        lambda: compare(
            doc, catalogue, _estimate_fn(args, parallel=True), on_device=on_device, single_step=single_step
        ),
    )
    from ledgerspec.faces.report.terminal import device_head

    head = device_head(on_device)
    cells = [
        (
            r.device.name,
            str(r.gpus),
            r.device.vendor_memory,
            format_size(r.memory),
            format_size(r.peak) if r.peak is not None else "-",
            format_size(r.device_peak) if r.device_peak is not None else "-",
            fits_cell(r),
            (format_size(r.headroom) if r.headroom >= 0 else "-" + format_size(-r.headroom))
            if r.headroom is not None
            else "-",
            largest_cell(r.largest_microbatch, r.largest_at_most),
        )
        for r in result.rows
    ]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    print(f"which device: microbatch {result.microbatch} as declared, sharding {result.sharding}")
    for row in [head, *cells]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    for note in result.notes:
        print(f"  note: {note}")
    if not any(r.usable is not None for r in result.rows):  # rows judged against the catalogue's usable memory
        print(f"  {usable_note(catalogue)}")
    print(f"  (traced at microbatch {', '.join(map(str, result.traced))}; {time.perf_counter() - started:.1f} s)")
    if writes:
        from ledgerspec.contract.edit import set_extension
        from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, digests

        block = result.to_extension()
        block["inputs"] = digests(doc, WORKLOAD_INPUTS)
        set_extension(doc, (EXTENSION,), block)
        _save(doc, args, EXTENSION)
    return EXIT_OK


def largest_cell(largest: int | None, at_most: bool) -> str:
    """The largest microbatch of a ``--devices`` row: ``<= N`` when it is an upper bound (decided on the device)."""
    if largest is None:
        return "none"
    return f"<= {largest}" if at_most else str(largest)


def fits_cell(row: Any) -> str:
    """The ``fits`` cell of a ``--devices`` row (:class:`ledgerspec.derivations.devices.comparison.Row`): yes or NO,
    what decided a NO of the allocator's (the bytes free but unusable), and a verdict at the edge."""
    from ledgerspec.faces.report.data import fits_words

    fragmentation = row.fragmentation if row.decided_by == "fragmentation" else None
    return fits_words(bool(row.fits), fragmentation, row.uncertain)


def _run_what_if(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    from ledgerspec.derivations.estimate import sweep, whatif
    from ledgerspec.derivations.estimate.estimator import device_memory_of

    target_memory = device if device is not None else device_memory_of(doc)
    axes = whatif.default_axes(doc)
    writes = _writable(doc, args)
    result = whatif.what_if(
        doc, _estimate_fn(args), axes, jobs=_jobs(args), device_memory=target_memory, warm=_warm(args)
    )
    rows = [(c.point, c.peak) for c in result.cells]
    checks = target_memory is not None and args.target == "cuda"  # the table's answer decided on the device
    sys.stdout.write(sweep.render(rows, axes, doc, target_memory, on_device=checks))
    print(
        f"(what-if: {len(result.cells)} configurations from {result.traced} traced estimates; {result.seconds:.1f} s)"
    )
    on_device = (
        _configurations_on_device(doc, args, rows, target_memory, device)
        if checks and target_memory is not None
        else None
    )
    if writes:
        from ledgerspec.contract.edit import set_extension
        from ledgerspec.contract.fingerprint import WORKLOAD_INPUTS, digests

        block = result.to_extension()
        if on_device is not None:
            block["device"] = on_device.to_extension()
        block["inputs"] = digests(doc, WORKLOAD_INPUTS)
        set_extension(doc, (whatif.EXTENSION,), block)
        _save(doc, args, whatif.EXTENSION)
    return EXIT_OK


def _writable(doc: Any, args: argparse.Namespace) -> bool:
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


def _save(doc: Any, args: argparse.Namespace, what: str, fields: str = "") -> None:
    """Write ``what`` back (its ``fields`` named after "written") with the status it supports, or say the ledger is
    up to date when it already holds it."""
    from ledgerspec.contract.writer import save
    from ledgerspec.faces.status import settle_for

    _, status_change = settle_for(doc, args)
    target = args.output or args.file
    written = save(doc, target, force=args.force)
    told = f"{what} written{fields}" if written else f"up to date ({what} as it holds it)"
    print(printable(f"{target}: {told}"), file=sys.stderr)
    if status_change:
        print(printable(status_change), file=sys.stderr)
