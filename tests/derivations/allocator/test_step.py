"""The estimate's traced step as an event stream, replayed through the allocator model (tiny Llama, CPU, fake
tensors): the replay's allocated bytes equal the tracker's, phase by phase (same events, independent bookkeeping),
and the reserve covers them."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ledgerspec.derivations.allocator.replay import replay
from ledgerspec.derivations.allocator.step import protocol_windows, replay_step, step_events
from ledgerspec.derivations.engine.protocol import PHASES
from tests.support.estimate_docs import ledger


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_replay_allocates_what_the_tracker_counted(accumulation: int) -> None:
    doc = ledger(accumulation=accumulation, microbatch=2, seq=64)
    step = step_events(doc, layers=2)
    replayed = replay_step(doc, step=step)
    assert set(replayed.phases) == set(PHASES)
    for name in PHASES:
        # the estimate's figure of this trace (the tracker's count, rounded to 512 B per storage)
        assert replayed.phases[name].allocated == step.figures[name], name
        assert replayed.phases[name].reserved >= replayed.phases[name].allocated > 0
    # window by window too: the tracker's own peak and held bytes against the replay's
    for label, (peak, held) in step.tracker_windows.items():
        phase = replayed.replay.phases[label]
        assert (phase.peak_allocated, phase.end_allocated) == (peak, held), label
    assert replayed.replay.oom is None


@pytest.mark.slow
def test_a_device_smaller_than_the_step_runs_out_where_the_reserve_does() -> None:
    step = step_events(ledger(microbatch=2, seq=64), layers=2)
    full = replay(step.events)
    tight = replay(step.events, capacity=full.peak_reserved - 1)
    assert tight.oom is not None and tight.oom.reserved + tight.oom.alloc_size > full.peak_reserved - 1
    phases = protocol_windows(step.windows, step.accumulation)
    assert any(tight.oom.phase in labels for labels in phases.values())


def test_windows_must_be_the_protocols() -> None:
    windows = ["0:frozen_params", "1:adapter", "2:optimizer", "3:activations", "4:temporary", "5:optimizer"]
    with pytest.raises(ValueError, match="unexpected protocol windows"):
        protocol_windows(windows, 1)
