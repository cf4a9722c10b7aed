"""The microbatch x length model of a sweep (fitmodel.GridModel, search.length_design, search.sweep_rows) and the
parallel runner (search.run_estimates).

Without torch: the arithmetic against a step whose figures are known in closed form (quadratic in the length,
affine in the microbatch, the steady-state phase a function of the typical length only), by default and with the
length axis interpolated (``interpolate_lengths``, not used by the CLI: see ``search.length_design``). With torch
(slow): a sweep's modelled cells against full traces (padded with checkpointing and accumulation, a sliding
window, packed), within 0.5 %, and the premise of the length model, that the first step's figures depend on the
worst length only and the steady-state step's on the typical length only. (The microbatch line at one length is
checked against full traces across architectures, attention kernels, QLoRA and the paged optimizer in
test_fitmodel.py; here the sweep that assembles it, on fewer cases to keep the suite's time.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.contract.edit import variant
from ledgerspec.derivations.estimate.fit import PHASES
from ledgerspec.derivations.estimate.fitmodel import AT_PEAK, GridModel, GridSample, typical_key
from ledgerspec.derivations.estimate.search import length_design, padded, probe, run_estimates, sweep_rows
from ledgerspec.derivations.estimate.sweep import apply
from tests.support.estimate_docs import ledger

TOLERANCE = 0.005
GiB = 1 << 30


def _close(got: int, want: int, scale: int | None = None) -> bool:
    return abs(got - want) <= TOLERANCE * max(scale or want, 1)


# -- without torch ---------------------------------------------------------------------------------------------------
def _step(b: int, length: int, typical: int) -> dict[str, int]:
    """A step whose backward peak grows as b (L + L^2 / 512), its steady state the same in the typical length,
    with a constant part and a term in L alone (positions, rotary tables)."""
    out = {k: 4 * GiB for k in PHASES}
    for phase, n in (("backward_peak", length), ("steady_state_peak", typical)):
        grows = b * (3000 * n + 7 * n * n) + 11 * n
        out[phase] = 4 * GiB + grows
        for c in AT_PEAK:
            out[f"at.{phase}.{c}"] = 0
        out[f"at.{phase}.frozen_base"] = 4 * GiB
        out[f"at.{phase}.activations"] = grows
    out["forward_peak"] = 4 * GiB + b * 1000 * length
    return out


@dataclass
class _Est:
    figures: dict[str, int]
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def peak_allocated(self) -> int:
        return max(self.phases.values())


class _ClosedStep:
    """An estimate function over documents whose figures are :func:`_step`; it records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, doc: Document) -> _Est:
        w = config.read(doc).workload
        at = (w.microbatch or 1, w.worst or 0, w.typical or 0)
        self.calls.append(at)
        figures = _step(*at)
        return _Est(figures, {k: figures[k] for k in PHASES})


def test_the_grid_is_exact_for_quadratic_figures_and_reads_the_steady_state_at_its_own_length() -> None:
    traced = [(256, 256), (1024, 1024), (4096, 512)]
    samples = [GridSample(b, n, t, _step(b, n, t)) for n, t in traced for b in (2, 16)]
    model = GridModel(samples, padded=False)
    for b in (1, 2, 3, 8, 16, 40):
        for n, t in ((512, 512), (2048, 1024), (4096, 1024), (1500, 700), (256, 256)):
            assert model.figures(b, n, t) == _step(b, n, t), (b, n, t)
    assert model.traced(16, 4096, 512) and not model.traced(16, 4096, 1024)
    assert typical_key("steady_state_peak") and typical_key("at.steady_state_peak.activations")
    assert not typical_key("backward_peak") and not typical_key("at.backward_peak.activations")


def test_the_grid_refuses_lengths_outside_the_traced_ones_and_one_row_of_a_padded_batch() -> None:
    samples = [GridSample(b, n, n, _step(b, n, n)) for n in (256, 1024, 4096) for b in (2, 16)]
    model = GridModel(samples, padded=True)
    assert not model.can_predict(4, 8192, 1024)
    assert not model.can_predict(4, 2048, 128)
    assert not model.can_predict(1, 1024, 1024)  # one row of a padded workload: its own regime, never traced
    with pytest.raises(ValueError, match="trace it"):
        model.figures(4, 128, 128)


def test_length_design_traces_three_lengths_and_spreads_the_typical_lengths_over_them() -> None:
    def typical(n: int) -> int:
        return min(1024, n)

    lengths = [256, 512, 1024, 2048, 4096]
    # 512 is needed as a typical length (max_length 512): the longest trace carries it
    # by default every length is traced, with its own typical length
    assert length_design(lengths, typical, decoupled=True) == [(n, min(n, 1024)) for n in lengths]
    assert length_design(lengths, typical, decoupled=True, interpolate=True) == [(256, 256), (1024, 1024), (4096, 512)]
    assert length_design(lengths, typical, decoupled=False, interpolate=True) == [
        (256, 256),
        (1024, 1024),
        (4096, 1024),
    ]
    assert length_design([512, 2048, 4096], typical, True, True) == [(512, 512), (2048, 1024), (4096, 1024)]
    # more typical lengths than traces: the shortest, the longest and one in the middle
    assert length_design([128, 256, 512, 1024, 2048], lambda n: n, decoupled=True, interpolate=True) == [
        (128, 128),
        (512, 512),
        (2048, 2048),
    ]


def test_a_probe_sets_the_typical_length_apart_from_the_worst_one() -> None:
    doc = variant(ledger(microbatch=2, seq=1024), {("workload", "sequence_p50"): 1024})
    d = probe(doc, 4, 4096, 512, {})
    w = config.read(d).workload
    assert (w.microbatch, w.worst, w.typical) == (4, 4096, 512)
    assert config.read(probe(doc, 4, 2048, None, {})).workload.typical == 1024
    packed = variant(doc, {("workload", "packing"): True})
    with pytest.raises(ValueError, match="cannot trace typical length"):
        probe(packed, 4, 4096, 512, {})


def test_a_5x5_sweep_traces_two_microbatches_per_length_or_three_lengths_on_request() -> None:
    doc = variant(ledger(microbatch=2, seq=1024), {("workload", "sequence_p50"): 1024})
    points = [{"microbatch": b, "max_length": n} for b in (2, 4, 6, 8, 16) for n in (256, 512, 1024, 2048, 4096)]
    fn = _ClosedStep()
    rows, traced = sweep_rows(doc, points, fn)
    assert traced == 10 and len(fn.calls) == 10
    for row in rows:
        b, n = row.point["microbatch"], row.point["max_length"]
        want = _step(b, n, min(n, 1024))
        assert row.phases == {k: want[k] for k in PHASES}, row.point
    assert sum(r.traced for r in rows) == 10
    fn = _ClosedStep()
    rows, traced = sweep_rows(doc, points, fn, interpolate_lengths=True)
    assert traced == 6 and len(fn.calls) == 6
    assert sorted(fn.calls) == sorted((b, n, t) for n, t in ((256, 256), (1024, 1024), (4096, 512)) for b in (2, 16))
    for row in rows:
        b, n = row.point["microbatch"], row.point["max_length"]
        want = _step(b, n, min(n, 1024))
        assert row.phases == {k: want[k] for k in PHASES}, row.point
    assert sum(r.traced for r in rows) == 4  # (2|16) x (256|1024); 4096 was traced at typical length 512


def test_a_sweep_with_one_row_of_a_padded_workload_traces_it_at_each_length() -> None:
    doc = variant(ledger(microbatch=2, seq=1024), {("workload", "sequence_p50"): 1024})
    fn = _ClosedStep()
    points = [{"microbatch": b, "max_length": n} for b in (1, 2, 4, 8, 16) for n in (256, 512, 1024, 2048, 4096)]
    rows, traced = sweep_rows(doc, points, fn, interpolate_lengths=True)
    assert traced == 9 and {c[0] for c in fn.calls} == {1, 2, 16}
    for row in rows:
        b, n = row.point["microbatch"], row.point["max_length"]
        want = _step(b, n, min(n, 1024))
        assert row.peak == max(want[k] for k in PHASES), row.point


def test_an_axis_the_sweep_does_not_vary_stays_as_declared() -> None:
    doc = variant(ledger(microbatch=2, seq=1024), {("workload", "global_batch"): 16})
    seen: list[tuple[bool, int | None, bool | None]] = []

    def fn(d: Document) -> _Est:
        seen.append(
            (
                d.get("workload", "global_batch").present,
                d.get("workload", "max_length").integer(),
                d.get("memory_options", "gradient_checkpointing").switch(),
            )
        )
        return _ClosedStep()(d)

    _, traced = sweep_rows(doc, [{"gradient_checkpointing": v} for v in (True, False)], fn)
    assert traced == 2 and sorted(seen) == [(True, 1024, False), (True, 1024, True)]
    seen.clear()
    sweep_rows(doc, [{"microbatch": b} for b in (2, 4)], fn)
    assert {s[0] for s in seen} == {False}  # a swept microbatch drops the global batch, as sweep.apply does


def _figures_of(doc: Document) -> _Est:
    w = config.read(doc).workload
    if w.microbatch == 3:
        raise RuntimeError("three rows fail")
    figures = _step(w.microbatch or 1, w.worst or 0, w.typical or 0)
    return _Est(figures, {k: figures[k] for k in PHASES})


def test_run_estimates_in_two_processes_returns_what_a_serial_run_does() -> None:
    doc = ledger(microbatch=2, seq=256)
    docs = [apply(doc, {"microbatch": b}) for b in (1, 2, 4, 5)]
    assert run_estimates(docs, _figures_of, jobs=2) == run_estimates(docs, _figures_of, jobs=1)
    # a failure in a worker is run again in this process, which reports it as a serial run does
    with pytest.raises(RuntimeError, match="three rows fail"):
        run_estimates([*docs, apply(doc, {"microbatch": 3})], _figures_of, jobs=2)


# -- with torch: the model against full traces -----------------------------------------------------------------------
LENGTHS = (64, 256)
P50 = 100
#: the padded case, checkpointed and accumulating, that the premise test reads too (one trace, its xdist group)
PADDED = {"arch": "tiny-llama-gqa", "checkpointing": True, "accumulation": 2}
CASES = [
    pytest.param(PADDED, id="llama-sdpa-ckpt-accum", marks=pytest.mark.xdist_group("sweep-grid-padded")),
    pytest.param({"arch": "tiny-mistral", "checkpointing": True}, id="mistral-window-ckpt"),
    pytest.param({"arch": "tiny-llama-gqa", "packing": True}, id="llama-packed"),
]
#: modelled cells checked against a full trace (the typical length is min(100, max_length))
CHECKED = [(3, 64), (7, 256)]


#: the depth of the tiny models here: the sweep models the batch and the length, not the depth (each figure read
#: off the estimates as they are), and at 2 layers (one layer feeding the next) the plain estimate traces every layer
#: (one trace, "the model is shallow enough") where the 8-layer configs traced two probes of 2 and 3 layers: the
#: same figures of the same step, each from a full trace, in 2 layers' work instead of 5
LAYERS = 2


def _doc(params: dict[str, Any]) -> Document:
    params = dict(params)
    packing = params.pop("packing", False)
    doc = ledger(seq=512, layers=LAYERS, **params)
    return variant(doc, {("workload", "sequence_p50"): P50, ("workload", "packing"): packing})


@pytest.fixture(scope="module")
def estimates() -> Any:
    """``estimate`` remembering each document it was asked (by its whole content) for this module's tests: the sweep
    and the premise test trace the same variant (microbatch 2, 64 tokens, typical 64) once."""
    seen: dict[str, Any] = {}

    def estimate(doc: Document) -> Any:
        import json

        from ledgerspec.derivations.estimate.estimator import estimate as traced

        key = json.dumps(doc.plain, sort_keys=True, default=str)
        if key not in seen:
            seen[key] = traced(doc)
        return seen[key]

    return estimate


@pytest.mark.slow
@pytest.mark.parametrize("params", CASES)
def test_a_sweep_matches_full_traces_within_half_a_percent(params: dict[str, Any], estimates: Any) -> None:
    """A microbatch x max_length sweep, its rows against full estimates of the cells the model gave."""
    pytest.importorskip("torch")
    estimate = estimates

    doc = _doc(params)
    points = [{"microbatch": b, "max_length": n} for b in (1, 2, 3, 7, 8) for n in LENGTHS]
    rows, traced = sweep_rows(doc, points, estimate)
    assert traced == (6 if padded(doc) else 4)  # (1,) 2 and 8 rows at each length
    by_point = {(r.point["microbatch"], r.point["max_length"]): r for r in rows}
    for b, n in CHECKED:
        row = by_point[(b, n)]
        assert not row.traced
        full = estimate(apply(doc, {"microbatch": b, "max_length": n}))
        for phase, want in full.phases.items():
            assert _close(row.phases[phase], want), (b, n, phase, row.phases[phase], want)
        assert _close(row.peak, full.peak_allocated)
        if row.peak_phase == full.peak_phase:
            for comp, want in full.at_peak.items():
                assert _close(row.at_peak[comp], want, full.peak_allocated), (b, n, comp)


@pytest.mark.slow
@pytest.mark.xdist_group("sweep-grid-padded")  # its (2, 64, 64) is the sweep's trace
def test_the_first_step_reads_the_worst_length_only_and_the_steady_state_the_typical_only(estimates: Any) -> None:
    """The premise of tracing a typical length apart from its worst one (``interpolate_lengths``): figure by
    figure, a trace at (L, t) has the first step's figures of (L, L) and the steady state's of (t, t)."""
    pytest.importorskip("torch")
    estimate = estimates

    doc = _doc(PADDED)
    mixed = estimate(probe(doc, 2, 256, 64, {})).figures
    worst = estimate(probe(doc, 2, 256, 256, {})).figures
    typical = estimate(probe(doc, 2, 64, 64, {})).figures
    for k, v in mixed.items():
        assert v == (typical[k] if typical_key(k) else worst[k]), k
