"""The microbatch model (fitmodel.BatchModel) against full traces, and the searches (search.py) on it.

The model's claim is checked the way the layer extrapolation's is: every figure it predicts from two traced
microbatches is compared with a full estimate at that microbatch (several architectures, checkpointing on and off,
padded and packed batches, QLoRA), within 0.5 %; the tiny models are 2 layers deep, so that each estimate is one
full trace (see ``LAYERS``). The searches are checked against a brute-force scan of full
estimates, and, without torch, against an estimate function whose peak is known in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ledgerspec.contract.document import Document
from ledgerspec.derivations.estimate.fit import PHASES
from ledgerspec.derivations.estimate.fitmodel import AT_PEAK, BatchModel, Sample
from ledgerspec.derivations.estimate.search import design, fit_length, fit_microbatch, padded, sweep_rows
from tests.support.estimate_docs import ledger

TOLERANCE = 0.005


def _close(got: int, want: int) -> bool:
    return abs(got - want) <= TOLERANCE * max(want, 1)


# -- without torch: the arithmetic --------------------------------------------------------------------------------
def _figures(b: int, base: int = 1000, per_row: int = 300, spike: int = 0) -> dict[str, int]:
    """Figures of a step whose backward peak grows by ``per_row`` per row (and forward half as fast)."""
    out = {k: base for k in PHASES}
    out["forward_peak"] = base + per_row * b // 2 + spike
    out["backward_peak"] = base + per_row * b
    for phase in PHASES:
        for c in AT_PEAK:
            out[f"at.{phase}.{c}"] = 0
    out["at.backward_peak.frozen_base"] = base
    out["at.backward_peak.activations"] = per_row * b
    return out


def test_the_line_through_two_samples_is_exact_for_affine_figures() -> None:
    model = BatchModel([Sample(2, _figures(2)), Sample(4, _figures(4))], padded=True)
    for b in (3, 5, 17, 1000):
        assert model.figures(b) == _figures(b), b
    assert model.peak(17) == 1000 + 300 * 17 and model.peak_phase(17) == "backward_peak"
    assert model.at_peak(17)["activations"] == 300 * 17
    assert model.largest_fitting(1000 + 300 * 17) == 17 and model.largest_fitting(1000 + 300 * 17 - 1) == 16


def test_a_generation_phase_counts_in_the_peak_between_traced_microbatches() -> None:
    """GRPO's ``generation_peak`` (the KV cache of num_generations completions per prompt) can be the step's peak:
    the line between two traced microbatches keeps it, so ``--sweep``/``--devices`` never drop it."""

    def grpo(b: int) -> dict[str, int]:
        out = _figures(b)
        out["generation_peak"] = 1000 + 500 * b
        out["at.generation_peak.activations"] = 500 * b
        out["at.generation_peak.frozen_base"] = 1000
        return out

    model = BatchModel([Sample(2, grpo(2)), Sample(4, grpo(4))], padded=True)
    assert model.peak(3) == 1000 + 500 * 3 and model.peak_phase(3) == "generation_peak"
    assert model.at_peak(3)["activations"] == 500 * 3


def test_one_row_of_a_padded_workload_is_its_own_regime() -> None:
    model = BatchModel([Sample(2, _figures(2)), Sample(4, _figures(4))], padded=True)
    assert not model.can_predict(1)
    with pytest.raises(ValueError, match="trace it"):
        model.figures(1)
    assert model.largest_fitting(1000) is None  # 2 rows do not fit, and one row was never traced
    one = Sample(1, _figures(1, spike=-50))
    model = BatchModel([one, Sample(2, _figures(2)), Sample(4, _figures(4))], padded=True)
    assert model.figures(1) == dict(one.figures) and model.largest_fitting(1300) == 1
    unpadded = BatchModel([Sample(2, _figures(2)), Sample(4, _figures(4))], padded=False)
    assert unpadded.figures(1) == _figures(1)


def test_design_traces_two_padded_microbatches_and_one_row_when_swept() -> None:
    assert design([1, 2, 4, 8, 16], pads=True) == [1, 2, 16]
    assert design([2, 4, 8, 16], pads=True) == [2, 16]
    assert design([1, 2, 4, 8], pads=False) == [1, 8]
    assert design([4, 8], pads=True) == [4, 8]


@dataclass
class _Est:
    phases: dict[str, int]
    figures: dict[str, int]
    at_peak: dict[str, int] = field(default_factory=dict)

    @property
    def peak_allocated(self) -> int:
        return max(self.phases.values())


class _Closed:
    """An estimate function with a known peak: 4 GiB + 0.5 GiB per row + 1 MiB x rows x (length / 1024)^2 x 300,
    the length axis convex as attention's is; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def peak(self, b: int, length: int) -> int:
        return (4 << 30) + b * (1 << 29) + b * 300 * (1 << 20) * length * length // (1024 * 1024)

    def __call__(self, doc: Document) -> _Est:
        b = doc.get("workload", "microbatch").integer() or 1
        length = doc.get("workload", "max_length").integer() or 1024
        self.calls.append((b, length))
        p = self.peak(b, length)
        figures = {k: 4 << 30 for k in PHASES}
        figures["backward_peak"] = p
        at = {c: 0 for c in AT_PEAK}
        at["frozen_base"] = 4 << 30
        at["activations"] = p - (4 << 30)
        for c, n in at.items():
            figures[f"at.backward_peak.{c}"] = n
        phases = {k: figures[k] for k in PHASES}
        return _Est(phases, figures, at)


def test_fit_microbatch_takes_two_estimates_and_is_exact_on_a_line() -> None:
    doc = ledger(microbatch=2, seq=1024)
    fn = _Closed()
    memory = 24 << 30
    answer = fit_microbatch(doc, memory, fn)
    brute = max(b for b in range(1, 200) if fn.peak(b, 1024) <= memory)
    assert answer.largest == brute and answer.above == brute + 1
    assert answer.peak == fn.peak(brute, 1024) and answer.peak_above == fn.peak(brute + 1, 1024)
    assert len(fn.calls) == 2 and answer.oom_phase_above == "backward"
    assert answer.how(answer.largest) in ("traced", "model")


def test_fit_length_brackets_and_traces_the_answer_and_the_step_above() -> None:
    doc = ledger(microbatch=4, seq=1024)
    fn = _Closed()
    memory = 24 << 30
    answer = fit_length(doc, memory, fn, step=64)
    brute = max(n * 64 for n in range(1, 400) if fn.peak(4, n * 64) <= memory)
    assert answer.largest == brute and answer.above == brute + 64
    assert answer.how(brute) == "traced" and answer.how(brute + 64) == "traced"
    assert answer.peak == fn.peak(4, brute) and len(fn.calls) <= 8, fn.calls


def test_nothing_fits_is_said_with_the_smallest_peak() -> None:
    doc = ledger(microbatch=2, seq=1024)
    fn = _Closed()
    answer = fit_microbatch(doc, 1 << 30, fn)
    assert answer.largest is None and (1, 1024) in fn.calls  # one row traced before saying no
    assert "no microbatch fits" in answer.sentence()


def test_a_sweep_traces_two_microbatches_per_length() -> None:
    doc = ledger(microbatch=2, seq=1024)
    fn = _Closed()
    points = [{"microbatch": b, "max_length": n} for b in (2, 4, 6, 8, 16) for n in (256, 512, 1024, 2048, 4096)]
    rows, traced = sweep_rows(doc, points, fn)
    assert traced == 10 and len(fn.calls) == 10
    for row in rows:
        assert row.peak == fn.peak(row.point["microbatch"], row.point["max_length"]), row.point


# -- with torch: the model against full traces ----------------------------------------------------------------------
CASES: dict[str, dict[str, Any]] = {
    "llama-gqa": {"arch": "tiny-llama-gqa"},
    "llama-ckpt-accum": {"arch": "tiny-llama-gqa", "checkpointing": True, "accumulation": 2},
    "qwen2-ckpt": {"arch": "tiny-qwen2", "checkpointing": True},
    "mistral-window": {"arch": "tiny-mistral"},
    "gemma2-eager": {"arch": "tiny-gemma2", "attention": "eager"},
    "qlora-nf4": {"arch": "tiny-llama-gqa", "quant": "nf4", "checkpointing": True},
    "paged-8bit": {"arch": "tiny-llama-gqa", "extra": "", "optimizer": "paged_adamw_8bit"},
}
#: the case the brute-force scan reads too: in one xdist group with it, so each microbatch is estimated once
SCANNED = "qwen2-ckpt"


#: the depth of the tiny models here: the microbatch model's claim is about the batch, not the depth (each figure
#: affine in the rows, read off the estimates; how the estimate reaches the depth is not what it models), and at 2
#: layers (one layer feeding the next) the plain estimate traces every layer (one trace, "the model is shallow
#: enough") where the 8-layer configs traced two probes of 2 and 3 layers: the same figures of the same step, each
#: from a full trace, in 2 layers' work instead of 5 (Gemma2: one sliding and one full layer, instead of probes of 4
#: and 6)
LAYERS = 2


def _doc(params: dict[str, Any]) -> Document:
    return ledger(seq=128, layers=LAYERS, **params)


@pytest.fixture(scope="module")
def traced() -> Any:
    """``traced(case, b)``: the case's full estimate at microbatch ``b``, estimated once in this module for every
    test that reads it."""
    seen: dict[tuple[str, int], Any] = {}

    def get(name: str, b: int) -> Any:
        if (name, b) not in seen:
            pytest.importorskip("torch")
            from ledgerspec.derivations.estimate.estimator import estimate
            from ledgerspec.derivations.estimate.sweep import apply

            seen[name, b] = estimate(apply(_doc(CASES[name]), {"microbatch": b}))
        return seen[name, b]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, id=n, marks=[pytest.mark.xdist_group("fitmodel-scan")] if n == SCANNED else []) for n in CASES],
)
def test_the_model_matches_full_traces_within_half_a_percent(name: str, traced: Any) -> None:
    traces = {b: traced(name, b) for b in (1, 2, 4, 3, 7)}
    model = BatchModel([Sample(b, traces[b].figures) for b in (1, 2, 4)], padded(_doc(CASES[name])))
    for b in (3, 7):
        full = traces[b]
        for phase, want in full.phases.items():
            assert _close(model.phases(b)[phase], want), (b, phase, model.phases(b)[phase], want)
        assert _close(model.peak(b), full.peak_allocated)
        if model.peak_phase(b) == full.peak_phase:  # the split of the peak into components, when it is one moment
            for comp, want in full.at_peak.items():
                assert abs(model.at_peak(b)[comp] - want) <= TOLERANCE * full.peak_allocated, (b, comp)


@pytest.mark.slow
@pytest.mark.xdist_group("fitmodel-scan")  # reads the model test's traces of its case
def test_fit_microbatch_agrees_with_a_scan_of_full_traces(traced: Any) -> None:
    """The answer of two estimates equals the largest fitting microbatch of a brute-force scan (a checkpointed
    step: the scan shares its estimates with the model test's case)."""
    peaks = {b: traced(SCANNED, b).peak_allocated for b in range(1, 13)}
    memory = (peaks[9] + peaks[10]) // 2  # 9 fits, 10 does not
    asked: list[int] = []

    def estimate(doc: Document) -> Any:  # the scan's estimate of the same document (only the microbatch differs)
        b = doc.get("workload", "microbatch").integer()
        assert b is not None
        asked.append(b)
        return traced(SCANNED, b)

    answer = fit_microbatch(_doc(CASES[SCANNED]), memory, estimate)
    assert answer.largest == 9 and answer.above == 10
    assert _close(answer.peak or 0, peaks[9]) and _close(answer.peak_above or 0, peaks[10])
    assert len(answer.traced) == 2 and sorted(asked) == answer.traced


def test_the_core_fit_refuses_grpo_as_the_cli_does() -> None:
    """``fit_microbatch`` and the default what-if grid choose microbatches themselves: called from Python on a GRPO
    ledger they refuse in the same one line at training.objective, before any estimate is asked."""
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.estimate.search import fit_microbatch
    from ledgerspec.derivations.estimate.whatif import what_if
    from ledgerspec.errors import LedgerspecError
    from tests.support import EXAMPLES

    doc = load(EXAMPLES / "objectives" / "llama-3.1-8b-lora-grpo.ledger.yaml")

    def never(*_a: object, **_k: object) -> object:
        raise AssertionError("estimated")

    for ask, question in (
        (lambda: fit_microbatch(doc, 80 * 2**30, never), "--fit microbatch"),
        (lambda: what_if(doc, never), "--what-if"),
    ):
        with pytest.raises(LedgerspecError) as e:
            ask()
        assert e.value.line == 50 and e.value.message.startswith(f"{question} chooses microbatches itself")
