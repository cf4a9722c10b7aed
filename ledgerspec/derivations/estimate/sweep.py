"""The Memory Sensitivity Matrix as estimated numbers: one estimate per point of a small grid.

``--sweep microbatch=1,2,4 max_length=1024,2048 gradient_checkpointing=on,off`` is parsed into axes
(:func:`parse_axes`); each point is a copy of the document with those inputs replaced
(:func:`apply`); :func:`largest_fitting` picks the configuration with the most tokens per micro-step
that fits a device. Pure: no torch (the caller runs the estimates).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import REMOVE, variant
from ledgerspec.contract.values import Value
from ledgerspec.derivations.engine.workload import ATTENTION, OPTIMIZERS
from ledgerspec.errors import EXIT_USAGE, LedgerspecError


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("is not a whole number (e.g. 1,2,4)") from None
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _switch(text: str) -> bool:
    value = Value.of(text).switch()
    if value is None:
        raise ValueError("is not on/off (true/false, yes/no)")
    return value


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"is not one of {', '.join(options)}")
        return text

    return parse


#: the inputs a sweep may vary: name -> (document path, parser)
AXES: dict[str, tuple[tuple[str, ...], Callable[[str], Any]]] = {
    "microbatch": (("workload", "microbatch"), _int),
    "max_length": (("workload", "max_length"), _int),
    "gradient_checkpointing": (("memory_options", "gradient_checkpointing"), _switch),
    "rank": (("method", "rank"), _int),
    "optimizer": (("optimizer", "name"), _choice(OPTIMIZERS)),
    "attention_implementation": (("software", "attention_implementation"), _choice(ATTENTION)),
}


@dataclass(frozen=True)
class Axis:
    name: str
    path: tuple[str, ...]
    values: tuple[Any, ...]


def parse_axes(specs: Sequence[str]) -> list[Axis]:
    """``["microbatch=1,2,4", ...]`` -> axes; a bad spec is a usage error naming it."""
    axes: list[Axis] = []
    seen: set[str] = set()
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or not rest.strip():
            raise LedgerspecError(
                f"--sweep {spec!r}: expected NAME=V1,V2,...",
                rule="estimate",
                hint=f"names: {', '.join(AXES)}",
                exit_code=EXIT_USAGE,
            )
        if name not in AXES:
            raise LedgerspecError(
                f"--sweep: unknown input {name!r}",
                rule="estimate",
                hint=f"names: {', '.join(AXES)}",
                exit_code=EXIT_USAGE,
            )
        if name in seen:
            raise LedgerspecError(f"--sweep: {name} given twice", rule="estimate", exit_code=EXIT_USAGE)
        seen.add(name)
        path, parse = AXES[name]
        values: list[Any] = []
        for item in rest.split(","):
            try:
                values.append(parse(item.strip()))
            except ValueError as exc:
                raise LedgerspecError(
                    f"--sweep {name}: {item.strip()!r} {exc}", rule="estimate", exit_code=EXIT_USAGE
                ) from None
        axes.append(Axis(name, path, tuple(dict.fromkeys(values))))
    return axes


def grid(axes: Sequence[Axis]) -> list[dict[str, Any]]:
    """Every combination, first axis slowest."""
    return [
        dict(zip([a.name for a in axes], combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))
    ]


def apply(doc: Document, point: dict[str, Any]) -> Document:
    """A copy of ``doc`` with the point's inputs set (a sequence profile above a new max_length is clipped)."""
    values: dict[tuple[str, ...], Any] = {}
    for name, value in point.items():
        path, _ = AXES[name]
        values[path] = value
        if name == "max_length":
            for key in ("sequence_p50", "sequence_p95"):
                n = doc.get("workload", key).integer()
                if n is not None and n > value:
                    values[("workload", key)] = value
        if name == "microbatch":
            values[("workload", "global_batch")] = REMOVE
    return variant(doc, values)


def tokens(point: dict[str, Any], doc: Document) -> int:
    """Tokens in one micro-step of a point (microbatch x max_length)."""
    mb = point.get("microbatch", doc.get("workload", "microbatch").integer() or 1)
    seq = point.get(
        "max_length", doc.get("workload", "max_length").integer() or doc.get("workload", "sequence_p95").integer() or 1
    )
    return int(mb) * int(seq)


def fitting_in_order(
    rows: Sequence[tuple[dict[str, Any], int]], doc: Document, device_memory: int
) -> list[tuple[dict[str, Any], int]]:
    """The points whose peak fits, best first: the most tokens per micro-step; ties go to checkpointing off, then the
    lower peak (the order the device check follows, :mod:`ledgerspec.derivations.devices.sweep_check`)."""
    fitting = [(p, peak) for p, peak in rows if peak <= device_memory]
    return sorted(
        fitting, key=lambda r: (tokens(r[0], doc), r[0].get("gradient_checkpointing") is False, -r[1]), reverse=True
    )


def largest_fitting(
    rows: Sequence[tuple[dict[str, Any], int]], doc: Document, device_memory: int
) -> tuple[dict[str, Any], int] | None:
    """The fitting point with the most tokens per micro-step; ties go to checkpointing off, then the lower peak."""
    fitting = fitting_in_order(rows, doc, device_memory)
    return fitting[0] if fitting else None


def describe(point: dict[str, Any]) -> str:
    """``microbatch=4, gradient_checkpointing=on``: a point as the sweep's lines name it."""
    return ", ".join(f"{k}={show(v)}" for k, v in point.items())


def show(v: Any) -> str:
    """A point's value as the table prints it (switches as on/off)."""
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def render(
    rows: Sequence[tuple[dict[str, Any], int]],
    axes: Sequence[Axis],
    doc: Document,
    device_memory: int | None,
    on_device: bool = False,
) -> str:
    """The matrix as a text table, one row per point. ``on_device``: the answer is checked on the device below it
    (:mod:`ledgerspec.derivations.devices.sweep_check`), so the table's answer is named for what it counts."""
    from ledgerspec.contract.units import format_size

    fits = "fits (allocated)" if on_device else "fits"
    head = [a.name for a in axes] + ["predicted peak"] + ([fits] if device_memory else [])
    body = []
    for point, peak in rows:
        cells = [show(point[a.name]) for a in axes] + [format_size(peak)]
        if device_memory:
            cells.append("yes" if peak <= device_memory else "NO")
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if device_memory:
        best = largest_fitting(rows, doc, device_memory)
        what = "whose allocated tensors fit" if on_device else "that fits"
        if best is None:
            lines.append(
                f"no configuration {'has allocated tensors that fit' if on_device else 'fits'} "
                f"{format_size(device_memory)}"
            )
        else:
            lines.append(
                f"largest configuration {what} {format_size(device_memory)}: {describe(best[0])} "
                f"(predicted peak {format_size(best[1])})"
            )
        if not on_device:
            lines.append(
                "(allocated tensors only: the CUDA context, allocator cache and fragmentation need headroom too)"
            )
    return "\n".join(lines) + "\n"
