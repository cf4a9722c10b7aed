"""The step's stream in the estimate cache: a device asked about first costs a replay, not three traces, and the
answer is the one a fresh trace gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from ledgerspec.derivations.allocator import stream_cache
from ledgerspec.derivations.allocator.step import StepEvents

MiB = 2**20


def test_a_stream_comes_back_event_for_event() -> None:
    windows = ["0:frozen_params", "1:adapter", "2:optimizer", "3:activations", "4:temporary", "5:optimizer"]
    events = [("phase", w) for w in windows[:3]] + [("alloc", 7, 512, 0), ("free", 7)] + [("phase", windows[3])]
    step = StepEvents(events, windows, 1, {"forward_peak": 512}, {"3:activations": (512, 0)}, 32, "traced")
    data = stream_cache.encode(step)
    assert data is not None
    back = stream_cache.decode(data)
    assert back.events == events and back.windows == windows and back.tracker_windows == {"3:activations": (512, 0)}
    assert (back.figures, back.layers, back.method) == ({"forward_peak": 512}, 32, "traced")


def test_a_stream_with_an_event_the_form_does_not_keep_is_not_stored() -> None:
    # a replay-side event (a cuBLAS workspace: a tuple id, a fifth element) never belongs to a traced stream
    odd = StepEvents([("alloc", ("cublas-workspace", 0), 8_519_680, 0, False)], ["0:frozen_params"], 1, {})
    assert stream_cache.encode(odd) is None
    with pytest.raises(ValueError):
        stream_cache.decode({"format": stream_cache.FORMAT + 1})


@pytest.mark.slow  # traces a model
def test_a_second_device_replays_the_kept_stream_and_answers_as_a_fresh_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer asked about 24 GB right after 24 GiB and waited 5.6 s again: the traces do not depend on the
    device. Now the second device is answered from the kept stream (nothing traced) with the verdict a run without
    the cache gives."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices import prediction as P
    from ledgerspec.derivations.estimate import estimator
    from ledgerspec.derivations.estimate.cache import EstimateCache
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    path = tmp_path / "t.ledger.yaml"
    path.write_text(ledger_text(microbatch=2, seq=128))
    store = EstimateCache(tmp_path / "cache")
    first_est, _ = P.estimate_on_device(load(path), 24 * 2**30, from_flag=True, store=store)
    fresh_est, fresh = P.estimate_on_device(load(path), 80 * 2**30, from_flag=True)  # no cache: traced
    traced = estimator.prepare

    def no_trace(*args: object, **kwargs: object) -> object:
        raise AssertionError("traced again")

    monkeypatch.setattr(estimator, "prepare", no_trace)
    est, again = P.estimate_on_device(load(path), 80 * 2**30, from_flag=True, store=store)
    monkeypatch.setattr(estimator, "prepare", traced)
    assert not again.cached  # a new device question: replayed, from the stream kept for the first
    assert est.cached_from == first_est.seconds  # the trace's seconds, not the look-up's
    # asked again: the device answer itself from the cache, still saying how long the trace took
    third, _ = P.estimate_on_device(load(path), 80 * 2**30, from_flag=True, store=store)
    assert third.cached_from == first_est.seconds
    assert est.phases == fresh_est.phases == first_est.phases
    assert (again.fits, again.device_peak, again.margin, again.peak_reserved) == (
        fresh.fits,
        fresh.device_peak,
        fresh.margin,
        fresh.peak_reserved,
    )
    assert {k: (v.reserved, v.device) for k, v in again.phases.items()} == {
        k: (v.reserved, v.device) for k, v in fresh.phases.items()
    }
