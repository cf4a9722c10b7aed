"""``ledgerspec estimate FILE --devices [CATALOGUE]``: which accelerator and how many, a row per device and GPU
count (fits, headroom, largest microbatch), decided on the device; written to ``x-devices``."""

from __future__ import annotations

import argparse
from typing import Any

from ledgerspec.errors import EXIT_OK
from ledgerspec.faces.commands.estimate.common import cache_of, estimator_for, layers_of, save_back, writable


def run_devices(doc: Any, args: argparse.Namespace) -> int:
    import time

    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.devices import compare
    from ledgerspec.derivations.devices.catalogue import load_catalogue, usable_note
    from ledgerspec.derivations.devices.comparison import EXTENSION

    started = time.perf_counter()
    catalogue = load_catalogue(args.devices or None)
    writes = writable(doc, args)
    from ledgerspec.derivations.devices.prediction import step_and_estimate

    layers = layers_of(args)
    store = cache_of(args)

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
            doc, catalogue, estimator_for(args, parallel=True), on_device=on_device, single_step=single_step
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
        save_back(doc, args, EXTENSION)
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


__all__ = ["fits_cell", "largest_cell", "run_devices"]
