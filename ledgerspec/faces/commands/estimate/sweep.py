"""``ledgerspec estimate FILE --sweep NAME=V1,V2 ...`` and ``--what-if``: a grid of configurations (the Memory
Sensitivity Matrix; the what-if grid stored in ``x-what-if`` for the report's sliders), the largest that fits checked
on the device."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, printable
from ledgerspec.faces.commands.estimate.common import (
    cache_of,
    estimator_for,
    jobs_of,
    layers_of,
    memory_of,
    save_back,
    warm_for,
    writable,
)


def run_sweep(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    import time

    from ledgerspec.derivations.estimate import search, sweep

    started = time.perf_counter()
    axes = sweep.parse_axes(args.sweep)
    target_memory = memory_of(doc, device)
    points = sweep.grid(axes)
    grid = _grid_sweep(doc, args, points) if {a.name for a in axes} & {"microbatch", "max_length"} else None
    if grid is not None:
        rows = grid.rows
    else:
        rows, traced = search.sweep_rows(doc, points, estimator_for(args), jobs=jobs_of(args), warm=warm_for(args))
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

    layers = layers_of(args)
    checked = check_configurations(
        doc, table, memory, from_flag=asked is not None, store=cache_of(args), parallel=True, layers=layers
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

    layers = layers_of(args)
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
            estimator_for(args),
            jobs=jobs_of(args),
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
        return cached(cache_of(args), doc, question, compute, encode, decode)
    except NothingToKeep:  # only that: any other error is the user's to see, not a silent slow path
        return None


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


def run_what_if(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    from ledgerspec.derivations.estimate import sweep, whatif

    target_memory = memory_of(doc, device)
    axes = whatif.default_axes(doc)
    writes = writable(doc, args)
    result = whatif.what_if(
        doc, estimator_for(args), axes, jobs=jobs_of(args), device_memory=target_memory, warm=warm_for(args)
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
        save_back(doc, args, whatif.EXTENSION)
    return EXIT_OK


__all__ = ["run_sweep", "run_what_if"]
