"""``ledgerspec estimate FILE --fit microbatch|max_length``: the largest value that fits the device, from the
estimate's search, then checked on the device (the allocator model's replay); written to ``x-fit``."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from ledgerspec.errors import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, LedgerspecError, printable
from ledgerspec.faces.commands.estimate.common import cache_of, estimator_for, layers_of, memory_of, save_back, writable


def _fit_memory(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    memory = memory_of(doc, device)
    if memory is None:
        raise LedgerspecError(
            "--fit needs a device memory",
            args.file,
            rule="usage",
            hint="pass --device-memory 24GiB or set result.target_device.memory",
            exit_code=EXIT_USAGE,
        )
    return memory


def run_fit(doc: Any, args: argparse.Namespace, device: int | None) -> int:
    memory = _fit_memory(doc, args, device)
    if args.fit_step < 1:
        raise LedgerspecError("--fit-step must be >= 1", args.file, rule="usage", exit_code=EXIT_USAGE)
    writes = writable(doc, args)
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
        save_back(doc, args, "x-fit")
    fitting = all(a.largest is not None for a in answers) and all(c.largest is not None for c in on_device.values())
    return EXIT_OK if fitting else EXIT_FINDINGS


def _fit_answers(
    doc: Any, args: argparse.Namespace, memory: int, helpers: contextlib.ExitStack
) -> tuple[list[Any], dict[str, Any]]:
    """Each ``--fit`` answer, printed as it comes, with its check on the device (cuda): the answers and the checks
    by name; the :class:`MicrobatchSteps` the microbatch checks use is entered on ``helpers`` (closed with it)."""
    from ledgerspec.contract.units import format_size
    from ledgerspec.derivations.estimate import search

    estimate_fn = estimator_for(args, parallel=True)  # the first estimate's probes at once (the rest follow it)
    answers = []
    on_device: dict[str, Any] = {}
    steps = None
    for name in dict.fromkeys(args.fit):
        if name == "microbatch":
            if args.target == "cuda":  # decided on the device: the search's traces keep their streams for it
                from ledgerspec.derivations.devices.along import MicrobatchSteps

                layers = layers_of(args)
                steps = helpers.enter_context(MicrobatchSteps(doc, args.target, layers, cache_of(args), parallel=True))
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
    layers = layers_of(args)
    return check_on_device(
        doc,
        answer,
        memory,
        step=step,
        store=cache_of(args),
        parallel=True,
        along=steps,
        from_flag=from_flag,
        layers=layers,
    )


__all__ = ["run_fit"]
