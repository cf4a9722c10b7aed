"""What if: a grid of microbatch x sequence length x checkpointing on/off, estimated once and stored in the ledger
(``x-what-if``), so that ``report --html`` lets the reader move two sliders and see the verdict, the peak phase and
the headroom change, offline.

The grid is a sweep (:func:`ledgerspec.derivations.estimate.search.sweep_rows`: two or three traced microbatches per
length and checkpointing setting, the rest from the microbatch model, every traced point marked). Its default axes
(:func:`default_axes`) centre on the declared configuration: microbatch 1, 2, 4, 8, 16 (and the declared one), the
declared ``max_length`` quartered, halved and doubled, checkpointing off and on. Pure apart from
the estimates the caller's ``estimate_fn`` runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.derivations.estimate.search import EstimateFn, sweep_rows
from ledgerspec.derivations.estimate.sweep import Axis, grid
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

EXTENSION = "x-what-if"
AXIS_NAMES = ("microbatch", "max_length", "gradient_checkpointing")
MICROBATCHES = (1, 2, 4, 8, 16)
#: the declared length divided by these (1/2: doubled)
LENGTH_DIVISORS = (4, 2, 1, 0.5)


def default_axes(doc: Document) -> list[Axis]:
    """The what-if grid around the declared configuration (see the module docstring)."""
    from ledgerspec.derivations.estimate.sweep import AXES

    w = config.read(doc).workload
    declared_b = w.microbatch or 1
    length = doc.get("workload", "max_length").integer()
    if length is None:
        raise LedgerspecError(
            "--what-if needs workload.max_length (the length axis is built around it)",
            doc.path,
            rule="estimate",
            hint="set workload.max_length",
            exit_code=EXIT_USAGE,
        )
    lengths = sorted({max(1, int(length // d)) for d in LENGTH_DIVISORS})
    microbatches = sorted({*MICROBATCHES, declared_b})
    values: dict[str, tuple[Any, ...]] = {
        "microbatch": tuple(microbatches),
        "max_length": tuple(lengths),
        "gradient_checkpointing": (False, True),
    }
    return [Axis(name, AXES[name][0], values[name]) for name in AXIS_NAMES]


@dataclass
class Cell:
    point: dict[str, Any]
    peak: int
    phase: str
    traced: bool

    def to_extension(self) -> dict[str, Any]:
        return {**self.point, "peak": self.peak, "phase": self.phase, "traced": self.traced}


@dataclass
class WhatIf:
    axes: list[Axis]
    cells: list[Cell]
    declared: dict[str, Any]
    traced: int
    seconds: float
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_extension(self) -> dict[str, Any]:
        """The ``x-what-if`` block (its ``inputs`` fingerprint is added by the caller)."""
        out: dict[str, Any] = {
            "source": "CALCULATED",
            "axes": {a.name: list(a.values) for a in self.axes},
            "declared": dict(self.declared),
            "cells": [c.to_extension() for c in self.cells],
            "traced_estimates": self.traced,
            "method": "peak allocated of each point: a traced estimate, or the line through two or three traced "
            "microbatches of the same length and checkpointing (traced: false); allocated tensors only",
        }
        if self.device_memory is not None:
            out["device_memory"] = self.device_memory
        return out


def declared_point(doc: Document) -> dict[str, Any]:
    read = config.read(doc)
    return {
        "microbatch": read.workload.microbatch or 1,
        "max_length": doc.get("workload", "max_length").integer(),
        "gradient_checkpointing": bool(doc.get("memory_options", "gradient_checkpointing").switch()),
    }


def what_if(
    doc: Document,
    estimate_fn: EstimateFn,
    axes: list[Axis] | None = None,
    jobs: int = 1,
    device_memory: int | None = None,
    warm: Any = None,
) -> WhatIf:
    """Estimate every point of the grid (``axes``, else :func:`default_axes`); ``warm``: as
    :func:`~ledgerspec.derivations.estimate.search.run_estimates` takes it."""
    started = time.perf_counter()
    if axes is None:  # the default grid chooses the microbatches
        from ledgerspec.derivations.estimate.search import refuse_chosen_microbatches

        refuse_chosen_microbatches(doc, "--what-if")
        axes = default_axes(doc)
    points = grid(axes)
    rows, traced = sweep_rows(doc, points, estimate_fn, jobs=jobs, warm=warm)
    cells = [Cell(dict(row.point), row.peak, row.peak_phase, row.traced) for row in rows]
    return WhatIf(axes, cells, declared_point(doc), traced, time.perf_counter() - started, device_memory)


__all__ = ["AXIS_NAMES", "EXTENSION", "WhatIf", "default_axes", "what_if"]
