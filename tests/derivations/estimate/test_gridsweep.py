"""A microbatch x length sweep written from a traced grid's streams (estimate/gridsweep.py) against plain estimates
traced at the written points: every phase and every component alive at the peak, to the byte.

The independent truth is the plain estimate (:func:`ledgerspec.derivations.estimate.estimator.estimate`), which traces
the point itself with the tracker's own bookkeeping; the sweep traces a 2 x 3 grid and one check probe and writes the
other points' streams. The case: a tiny Llama, padded batches, checkpointing on, a typical length (``sequence_p50``)
below the longest lengths, so the steady-state step follows another length than the first. The arithmetic without
torch: tests/derivations/allocator/test_grid.py.
"""

from __future__ import annotations

import pytest

from ledgerspec.contract.edit import variant
from ledgerspec.derivations.estimate.estimator import estimate
from ledgerspec.derivations.estimate.gridsweep import grid_sweep_rows
from ledgerspec.derivations.estimate.search import probe
from ledgerspec.derivations.estimate.sweep import grid, parse_axes
from tests.support.estimate_docs import ledger


@pytest.mark.slow
def test_written_points_equal_plain_estimates_traced_there() -> None:
    doc = variant(ledger(microbatch=2, seq=512, checkpointing=True), {("workload", "sequence_p50"): 256})
    points = grid(parse_axes(["microbatch=2,3,4", "max_length=128,256,384,512"]))
    result = grid_sweep_rows(doc, points, "cuda", "auto", estimate, jobs=1)
    assert result is not None and result.notes == []
    assert (result.estimates, result.checks) == (6, 1)  # microbatch 2 and 4 at 128, 256 and 512; a check at 3 x 384
    rows = {(r.point["microbatch"], r.point["max_length"]): r for r in result.rows}
    written = sorted(k for k, r in rows.items() if not r.traced)
    assert written == [(2, 384), (3, 128), (3, 256), (3, 384), (3, 512), (4, 384)]
    # along the length (the first step at 384, the steady state at 256), and along both at the check point
    for b, n in ((2, 384), (3, 384)):
        est = estimate(probe(doc, b, n, None, {}))
        row = rows[(b, n)]
        assert row.phases == {k: est.figures[k] for k in row.phases}, (b, n)
        assert row.at_peak == dict(est.at_peak), (b, n)
        assert row.peak == est.peak_allocated
