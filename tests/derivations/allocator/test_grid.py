"""A probe's stream on a microbatch x length grid (allocator/grid.py): pure arithmetic on hand-made streams.

The streams follow a step whose allocations are known in closed form: token ids ``4 b L`` bytes, hidden states
``b L (4096 + 2 L)`` (a term in ``L^2``: an ``L x L`` score per row), a constant workspace, and in the steady-state
step the same at the typical length ``T``. The family must write, at an untraced point, exactly the closed form, and
refuse what is not such a polynomial. :func:`tracker_figures` is checked against figures worked out by hand for a
small stream (the peaks, what is alive at them by component, the first forward's activations). The figures of real
traces against real traced streams: tests/derivations/estimate/test_gridsweep.py (slow).
"""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.derivations.allocator.affine import NotPolynomial
from ledgerspec.derivations.allocator.grid import GridFamily, Point, counted_phases, tracker_figures

WINDOWS = ["0:frozen_params", "1:adapter", "2:optimizer", "3:activations", "4:temporary", "5:optimizer"]
WINDOWS += ["6:activations", "7:temporary", "8:optimizer"]


def _micro(ev: list[Any], b: int, n: int, first: int, workspace: int = 1 << 20) -> None:
    """One micro-step's forward and backward windows at microbatch ``b`` and length ``n`` (ids from ``first``)."""
    ev.append(("phase", f"{first}:activations"))
    ev.append(("alloc", 100 * first, 4 * b * n, 0))  # token ids
    ev.append(("alloc", 100 * first + 1, b * n * (4096 + 2 * n), 0))  # hidden states and scores
    ev.append(("phase", f"{first + 1}:temporary"))
    ev.append(("alloc", 100 * first + 2, workspace, 0))
    ev.append(("alloc", 100 * first + 3, 2 * b * n * 4096, 0))  # gradients of activations in flight
    for k in (3, 2, 1, 0):
        ev.append(("free", 100 * first + k))


def stream(p: Point, off: int = 0) -> list[Any]:
    """The closed-form step at ``p`` (``off``: bytes added to one steady-state allocation, off the polynomial)."""
    ev: list[Any] = [("phase", "0:frozen_params"), ("alloc", 1, 1 << 24, 0)]
    ev += [("phase", "1:adapter"), ("alloc", 2, 1 << 16, 0), ("phase", "2:optimizer"), ("alloc", 3, 1 << 17, 0)]
    _micro(ev, p.b, p.length, 3)
    ev += [("phase", "5:optimizer"), ("alloc", 4, 1 << 10, 0), ("free", 4)]
    _micro(ev, p.b, p.typical, 6, (1 << 20) + off)
    ev += [("phase", "8:optimizer"), ("alloc", 5, 1 << 10, 0), ("free", 5)]
    return ev


GRID = [Point(b, n, t) for b in (2, 16) for n, t in ((256, 256), (1024, 512), (4096, 1024))]


def family(**changes: Any) -> GridFamily:
    return GridFamily.build({p: stream(p) for p in GRID}, WINDOWS, 1)


def test_the_grid_writes_the_closed_form_at_untraced_points_each_allocation_at_its_own_length() -> None:
    fam = family()
    for p in (Point(4, 2048, 1024), Point(8, 512, 512), Point(3, 300, 290), Point(16, 256, 1024), Point(2, 4096, 256)):
        assert fam.stream(p) == stream(p), p


def test_a_point_outside_the_traced_lengths_or_microbatches_is_refused() -> None:
    fam = family()
    with pytest.raises(NotPolynomial, match="interpolation only"):
        fam.stream(Point(4, 8192, 1024))
    one = GridFamily.build({p: stream(p) for p in GRID if p.b == 2}, WINDOWS, 1)
    assert one.stream(Point(2, 2048, 512)) == stream(Point(2, 2048, 512))
    with pytest.raises(NotPolynomial, match="only 2 traced"):
        one.stream(Point(4, 2048, 512))


def test_the_check_names_the_first_event_off_the_polynomial_and_a_changed_structure() -> None:
    fam = family()
    p = Point(4, 2048, 768)
    fam.check(p, stream(p))
    assert fam.checked_at == [p]
    with pytest.raises(NotPolynomial, match=r"event \d+ \(7:temporary\): 1048577 bytes"):
        fam.check(p, stream(p, off=1))
    with pytest.raises(NotPolynomial, match="differs in structure"):
        fam.check(p, stream(p)[:-1])
    with pytest.raises(NotPolynomial, match="differ in structure"):
        GridFamily.build({**{q: stream(q) for q in GRID}, GRID[0]: stream(GRID[0])[:-2]}, WINDOWS, 1)


def test_a_size_that_is_not_a_whole_number_of_bytes_is_refused() -> None:
    streams = {p: stream(p) for p in GRID}
    q = GRID[1]
    streams[q] = [(*e[:2], e[2] + 1, *e[3:]) if e[0] == "alloc" and e[1] == 301 else e for e in streams[q]]
    fam = GridFamily.build(streams, WINDOWS, 1)
    with pytest.raises(NotPolynomial, match="not a whole"):
        fam.stream(Point(2, 2048, 512))


def test_figures_read_off_a_stream_as_the_tracker_counts_them() -> None:
    """Worked by hand: granularity 512; categories as allocated, the gradient relabelled; two reads of the total
    in the first forward window (before it, after it)."""
    ev = [
        ("phase", "0:frozen_params"),
        ("alloc", 0, 1000, 0),  # 1024 counted
        ("phase", "1:adapter"),
        ("alloc", 2, 512, 0),
        ("phase", "2:optimizer"),
        ("alloc", 4, 100, 0),  # 512
        ("phase", "3:activations"),
        ("alloc", 6, 2048, 0),  # the batch, then the read before the forward
        ("alloc", 7, 4000, 0),  # 4096: saved for backward
        ("alloc", 8, 600, 0),  # 1024, freed within the forward
        ("free", 8),
        ("phase", "4:temporary"),
        ("alloc", 12, 512, 0),  # the gradient, relabelled when autograd stores it
        ("alloc", 13, 8192, 0),
        ("free", 13),
        ("free", 7),
        ("free", 6),
        ("phase", "5:optimizer"),
        ("alloc", 18, 1024, 0),
        ("free", 18),
        ("phase", "6:activations"),
        ("alloc", 20, 2048, 0),
        ("free", 20),
        ("phase", "7:temporary"),
        ("phase", "8:optimizer"),
    ]
    cats = {0: "frozen_params", 2: "adapter", 4: "optimizer", 6: "activations", 7: "activations", 8: "activations"}
    cats |= {12: "temporary", 13: "temporary", 18: "optimizer", 20: "activations"}
    relabels = [(13, 12, "gradients")]  # after event 12 (the 13th): the gradient is labelled
    reads = [8, 11]  # after the batch; at the end of the forward
    got = tracker_figures(ev, WINDOWS, 1, 512, (cats, relabels, reads))
    base = 1024 + 512 + 512  # frozen, adapter, optimizer state
    assert got["after_load"] == 1024 and got["after_adapter_injection"] == 1536 and got["after_optimizer_init"] == base
    assert got["forward_peak"] == base + 2048 + 4096 + 1024
    assert got["at.forward_peak.activations"] == 2048 + 4096 + 1024
    assert got["backward_peak"] == base + 2048 + 4096 + 512 + 8192
    assert got["at.backward_peak.gradients"] == 512 and got["at.backward_peak.temporary"] == 8192
    assert got["at.backward_peak.frozen_base"] == 1024 and got["at.backward_peak.optimizer"] == 512
    assert got["optimizer_step_peak"] == base + 512 + 1024
    assert got["steady_state_peak"] == base + 512 + 2048 and got["at.steady_state_peak.activations"] == 2048
    assert got["activations"] == 4096  # the saved tensor: what the forward added between the two reads
    assert counted_phases(ev, WINDOWS, 1, 512) == {k: v for k, v in got.items() if "." not in k and k != "activations"}
    with pytest.raises(ValueError, match="reads"):
        tracker_figures(ev, WINDOWS, 1, 512, (cats, relabels, [8]))
