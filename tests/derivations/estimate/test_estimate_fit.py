"""Fit verdicts, the predicted OOM phase and the sweep grid: pure arithmetic on given numbers."""

from __future__ import annotations

import pytest

from ledgerspec.contract.document import from_text
from ledgerspec.derivations.estimate import sweep
from ledgerspec.derivations.estimate.fit import PHASES, fit
from ledgerspec.errors import LedgerspecError

GiB = 2**30
# a typical step: load 14 GiB, adapters and optimizer tiny, forward 18, backward 21, optimizer step 15, steady 21.5
STEP = dict(
    zip(PHASES, [14 * GiB, 14 * GiB + 1, 14 * GiB + 2, 18 * GiB, 21 * GiB, 15 * GiB, 21 * GiB + GiB // 2], strict=True)
)


@pytest.mark.parametrize(
    ("device", "fits", "phase"),
    [
        (24 * GiB, True, None),
        (21 * GiB + GiB // 2, True, None),  # exactly the peak fits
        (21 * GiB + GiB // 4, False, "later_iteration"),  # only the steady-state step goes over
        (20 * GiB, False, "backward"),
        (16 * GiB, False, "forward"),
        (14 * GiB + 1, False, "optimizer_init"),
        (13 * GiB, False, "load"),
    ],
)
def test_first_phase_over_the_device(device: int, fits: bool, phase: str | None) -> None:
    v = fit(STEP, device)
    assert (v.fits, v.oom_phase) == (fits, phase)
    assert v.headroom == device - (21 * GiB + GiB // 2)


def test_sentences() -> None:
    assert "headroom" in fit(STEP, 24 * GiB).sentence()
    assert "phase backward" in fit(STEP, 20 * GiB).sentence()


DOC = from_text("""ledgerspec: ledger/v1
workload:
  max_length: 2048
  sequence_p50: 900
  sequence_p95: 1800
  microbatch: 1
  global_batch: 16
memory_options:
  gradient_checkpointing: true
""")


def test_axes_grid_and_apply() -> None:
    axes = sweep.parse_axes(["microbatch=1,2", "max_length=1024,4096", "gradient_checkpointing=on,OFF"])
    points = sweep.grid(axes)
    assert len(points) == 8 and points[0] == {"microbatch": 1, "max_length": 1024, "gradient_checkpointing": True}
    d = sweep.apply(DOC, {"microbatch": 2, "max_length": 1024, "gradient_checkpointing": False})
    assert d.get("workload", "microbatch").integer() == 2
    assert d.get("memory_options", "gradient_checkpointing").switch() is False
    assert d.get("workload", "sequence_p95").integer() == 1024  # clipped to the new max_length
    assert d.get("workload", "sequence_p50").integer() == 900
    assert not d.get("workload", "global_batch").present  # no stale global batch
    assert DOC.get("workload", "microbatch").integer() == 1  # the original is untouched


def test_largest_fitting_prefers_tokens_then_no_checkpointing() -> None:
    rows = [
        ({"microbatch": 1, "gradient_checkpointing": True}, 10),
        ({"microbatch": 1, "gradient_checkpointing": False}, 14),
        ({"microbatch": 2, "gradient_checkpointing": True}, 13),
        ({"microbatch": 2, "gradient_checkpointing": False}, 20),
    ]
    assert sweep.largest_fitting(rows, DOC, 16) == rows[2]
    assert sweep.largest_fitting(rows, DOC, 9) is None
    assert sweep.largest_fitting(rows, DOC, 20) == rows[3]


@pytest.mark.parametrize("spec", ["microbatch", "microbatch=", "microbatch=a", "unknown=1", "rank=0"])
def test_bad_axes(spec: str) -> None:
    with pytest.raises(LedgerspecError):
        sweep.parse_axes([spec])
