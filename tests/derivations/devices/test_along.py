"""Device verdicts along the microbatch from two traced streams (:mod:`ledgerspec.derivations.devices.along`), and
streams along the length (:mod:`ledgerspec.derivations.allocator.affine`), against real traces of tiny models.

The truth is always a real trace at the value asked for, made without the synthesis: the whole step's stream traced
at full depth (event by event the same allocations and frees), the plain estimate's phase figures (the tracker's own
count: the synthesised stream's replay must give them to the byte), and ``--fit``'s checks traced one by one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.derivations.allocator.depth import canonical
from tests.support import one_worker_each

pytestmark = pytest.mark.slow

CASES = {
    "lora": {"arch": "tiny-llama-gqa", "seq": 32},
    "lora-ckpt": {"arch": "tiny-llama-gqa", "seq": 32, "checkpointing": True},
    "qlora": {"arch": "tiny-qwen2", "quant": "nf4", "targets": "all-linear", "seq": 32},
    "qlora-ckpt-paged8bit": {
        "arch": "tiny-llama-gqa",
        "quant": "nf4",
        "checkpointing": True,
        "optimizer": "paged_adamw_8bit",
        "targets": "all-linear",
        "seq": 32,
    },
}


#: the depth of the cases' models (copies of the tiny configs): the least at which a full-depth stream is built from
#: the three probes (2, 3 and 4 layers) rather than traced, as the 8-layer configs' streams were; what is synthesised
#: along the microbatch is that built stream, and the truth, the full trace at microbatch 7, is 3 layers shorter
LAYERS = 5


@pytest.fixture(scope="module", params=one_worker_each("along", list(CASES), list(CASES)))
def traced(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """The case's ledger and its :class:`MicrobatchSteps` with microbatches 2 and 3 traced (as the search would)."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from tests.support.estimate_docs import ledger

    doc = ledger(layers=LAYERS, **CASES[request.param])
    steps = MicrobatchSteps(doc)
    for b in (2, 3):
        steps.trace(b)
    return doc, steps


def test_a_synthesised_microbatch_is_the_full_depth_trace_and_the_estimate(traced: tuple[Any, Any]) -> None:
    from ledgerspec.derivations.allocator.step import replay_step, step_events
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.sweep import apply

    doc, steps = traced
    b = 7
    ours = steps.synthesise(b)
    assert ours.method.startswith("synthesised from the full-depth streams of microbatch 2 and 3"), ours.method
    assert all(steps.steps[v].method.startswith("built from the probes") for v in (2, 3))
    variant = apply(doc, {"microbatch": b})
    truth = step_events(variant, layers=None)  # every layer traced at microbatch 7
    assert ours.windows == truth.windows
    assert canonical(ours.events) == canonical(truth.events)
    replayed = replay_step(variant, step=ours)
    assert replayed.phases == replay_step(variant, step=truth).phases
    plain = estimate(variant)  # the tracker's own figures at microbatch 7
    for name, figures in replayed.phases.items():
        assert figures.allocated == plain.phases[name], name


def test_the_second_microbatch_is_built_from_two_probes_and_the_first_ones_depth_pattern(
    traced: tuple[Any, Any],
) -> None:
    """The first microbatch traced learns the depth pattern from three probes; the second traces only the two
    shallower ones and is built with that pattern: the full-depth trace at that microbatch, event by event."""
    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.estimate.sweep import apply

    doc, steps = traced
    built = steps.steps[3]
    assert built.method.startswith("built from the probes with 2 and 3 decoder layers and the depth pattern"), (
        built.method
    )
    assert built.method.endswith(f"at microbatch 2, extended to {LAYERS}"), built.method
    truth = step_events(apply(doc, {"microbatch": 3}), layers=None)
    assert built.windows == truth.windows
    assert canonical(built.events) == canonical(truth.events)


def test_a_microbatch_whose_probes_do_not_fit_the_pattern_traces_its_third_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the second microbatch's probes do not take the first one's pattern, its third probe is traced and the
    stream built from its own three probes (saying why): still the full-depth trace."""
    from ledgerspec.derivations.allocator import step as step_module
    from ledgerspec.derivations.allocator.depth import NotExtensible
    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from ledgerspec.derivations.estimate.sweep import apply
    from tests.support.estimate_docs import ledger

    def refuse(*args: Any) -> Any:
        raise NotExtensible("refused for the test")

    doc = ledger(layers=LAYERS, **CASES["lora"])
    steps = MicrobatchSteps(doc)
    steps.trace(2)
    monkeypatch.setattr(step_module, "retarget", refuse)
    _, built = steps.trace(3)
    assert built.method == (
        f"built from the probes with 2, 3 and 4 decoder layers, extended to {LAYERS} "
        "(the depth pattern of microbatch 2 did not fit: refused for the test)"
    )
    assert canonical(built.events) == canonical(step_events(apply(doc, {"microbatch": 3}), layers=None).events)


def test_a_stream_of_another_structure_does_not_take_the_pattern() -> None:
    """A pattern learned on one structure refuses the probes of another (here: another model's)."""
    from ledgerspec.derivations.allocator.depth import NotExtensible, retarget, template

    def probe(layers: int, size: int) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = [("phase", "forward")]
        for i in range(layers):  # each layer keeps one activation until the backward
            out.append(("alloc", f"a{i}", size, 0))
        out.append(("phase", "backward"))
        out.extend(("free", f"a{i}") for i in reversed(range(layers)))
        return out

    pattern = template(probe(2, 8), probe(3, 8), probe(4, 8))
    moved = retarget(pattern, probe(2, 24), probe(3, 24))  # another microbatch: three times the bytes
    assert [e[2] for e in moved.stream(4) if e[0] == "alloc"] == [24] * 6
    with pytest.raises(NotExtensible, match="differ in structure"):
        retarget(pattern, probe(3, 8), probe(4, 8))


def test_a_pattern_whose_blocks_were_told_apart_only_by_equal_sizes_is_refused() -> None:
    """Every layer keeps ``s`` bytes but the last ``t``: where ``s == t`` the slot may sit after the last layer
    (its block looks like the others), and another microbatch with ``s != t`` would then repeat the last layer's
    block. Such a step is refused (its third probe is traced), and the one where the sizes agree is taken."""
    from ledgerspec.derivations.allocator.depth import NotExtensible, retarget, template

    def probe(layers: int, s: int, t: int) -> list[tuple[Any, ...]]:  # each layer's bytes freed first in, first out
        out: list[tuple[Any, ...]] = [("phase", "forward")]
        out.extend(("alloc", f"a{i}", s if i < layers - 1 else t, 0) for i in range(layers))
        out.append(("phase", "backward"))
        out.extend(("free", f"a{i}") for i in range(layers))
        return out

    pattern = template(probe(2, 8, 8), probe(3, 8, 8), probe(4, 8, 8))
    with pytest.raises(NotExtensible, match="grows with the depth here"):
        retarget(pattern, probe(2, 24, 16), probe(3, 24, 16))
    truth = template(probe(2, 24, 16), probe(3, 24, 16), probe(4, 24, 16)).stream(3)
    assert [e[2] for e in truth if e[0] == "alloc"] == [24, 24, 24, 24, 16]
    told = template(probe(2, 8, 4), probe(3, 8, 4), probe(4, 8, 4))  # sizes that tell the last layer apart
    assert [e[2] for e in retarget(told, probe(2, 24, 16), probe(3, 24, 16)).stream(3) if e[0] == "alloc"] == [
        24,
        24,
        24,
        24,
        16,
    ]


def test_one_row_of_a_padded_batch_is_never_synthesised_from_two(traced: tuple[Any, Any]) -> None:
    """A batch of one row is not padded: its own structure. Where rows are padded it is its own regime (no two
    traced microbatches in it); where they are not, it may be synthesised only if the check passes, and then it is
    the trace."""
    from ledgerspec.derivations.allocator.affine import NotPolynomial
    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.estimate.sweep import apply

    doc, steps = traced
    if steps.padded:
        with pytest.raises(ValueError, match="no two traced microbatches"):
            steps.synthesise(1)
        return
    try:
        ours = steps.synthesise(1)
    except NotPolynomial:
        return
    assert canonical(ours.events) == canonical(step_events(apply(doc, {"microbatch": 1}), layers=None).events)


#: the device memory of the ``--fit`` checks: with the bytes outside the allocator, ``lora-ckpt``'s allocated answer
#: (4096) does not fit in it
FIT_MEMORY = 1000 * 2**20
#: what the ``--fit`` checks' ledger declares outside the allocator: the catalogue's typical figure for an unnamed
#: device, declared (no range), so that a value whose replay completes fits (the catalogue's range, 768 MiB to
#: 1.75 GiB, is wider than this tiny model's whole step: every value would be at the edge)
FIT_OUTSIDE = "outside_allocator:\n  total: {value: 768MiB, source: ASSUMPTION, note: the catalogue's typical figure}\n"


def fit_doc() -> Any:
    """``lora-ckpt``'s ledger with :data:`FIT_OUTSIDE`, in tests/data/estimate/ as :func:`ledger` places it."""
    from ledgerspec.contract.document import from_text
    from tests.support.estimate_docs import DATA, ledger_text

    return from_text(ledger_text(**CASES["lora-ckpt"]) + FIT_OUTSIDE, str(DATA / "test.ledger.yaml"))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fit_checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any, Any]:
    """``lora-ckpt``'s ``--fit microbatch`` checked on a device of :data:`FIT_MEMORY`, in this process, without a
    helper, into an empty cache: (ledger, cache, its :class:`MicrobatchSteps`, the :class:`DeviceFit`); the two
    tests that read it run on one worker (their ``xdist_group``), so it is computed once."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from ledgerspec.derivations.devices.fit_check import check_on_device
    from ledgerspec.derivations.estimate.cache import EstimateCache
    from ledgerspec.derivations.estimate.search import fit_microbatch

    doc = fit_doc()
    store = EstimateCache(tmp_path_factory.mktemp("fit") / "cache")
    along = MicrobatchSteps(doc, store=store)
    checked = check_on_device(doc, fit_microbatch(doc, FIT_MEMORY, along.estimate), FIT_MEMORY, along=along)
    assert along.helper is None
    return doc, store, along, checked


@pytest.mark.xdist_group("along-fit-checked")
def test_fit_checks_from_synthesised_streams_are_the_traced_checks(fit_checked: tuple[Any, Any, Any, Any]) -> None:
    """``estimate --fit microbatch`` on the device: each value checked from a synthesised stream gives the verdict,
    device peak and margin that tracing each value gives; asked again, every answer comes from the cache."""
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from ledgerspec.derivations.devices.fit_check import check_on_device
    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.estimate.search import fit_microbatch
    from ledgerspec.derivations.estimate.sweep import apply

    doc, store, along, ours = fit_checked
    memory = FIT_MEMORY
    assert not any(c.cached for c in ours.checked)  # computed, into the empty cache
    # traced: the search's two microbatches and one row (its own regime); the others synthesised
    assert along.traces <= 3 and len(along.synthesised) >= 2, (along.traces, along.notes)
    again = MicrobatchSteps(doc, store=store)
    checked = check_on_device(doc, fit_microbatch(doc, memory, again.estimate), memory, along=again)
    assert again.traces == 0 and not again.synthesised
    assert [c.__dict__ | {"cached": False} for c in checked.checked] == [
        c.__dict__ | {"cached": False} for c in ours.checked
    ]
    assert all(c.cached for c in checked.checked)
    # the truth for the first and the last value written (the others as the first test checks streams): that
    # microbatch traced and replayed on its own
    written = [c for c in ours.checked if c.value in along.synthesised]
    for c in {written[0].value: written[0], written[-1].value: written[-1]}.values():
        _, p = estimate_on_device(apply(doc, {"microbatch": c.value}), memory)
        assert p.replayed.stream.startswith("built from the probes"), p.replayed.stream
        assert (c.fits, c.device_peak, c.margin, c.decided_by) == (p.fits, p.device_peak, p.margin, p.decided_by)


def _check_off_the_line(steps: Any, regime: int, waited: list[int]) -> int:
    """Make the probe that checks ``regime``'s line (as if a helper were tracing it) one byte off the line: it is
    handed back only when waited for (``waited`` gets the number of verdicts handed out by then). Returns the index
    of the event off the line."""
    from ledgerspec.derivations.allocator.step import probe_of
    from ledgerspec.derivations.estimate.sweep import apply

    m = steps._check_value(regime)
    probe = probe_of(apply(steps.doc, {"microbatch": m}), "cuda", "auto", True, steps.shallow_depth)
    first = next(i for i, e in enumerate(probe.events) if e[0] == "alloc")
    off = list(probe.events)
    off[first] = (*off[first][:2], off[first][2] + 1, *off[first][3:])

    class Waiting:  # what the helper's probe hands back
        events = off

    def wait() -> Any:
        waited.append(len(steps.unconfirmed))
        return Waiting

    steps._checking[regime] = (m, wait)
    return first


def test_values_replayed_before_their_lines_check_are_traced_when_the_check_fails(tmp_path: Path) -> None:
    """Written values are replayed and their verdicts handed out while the helper still traces the probe that checks
    their line; they are kept in the cache only once that check passes. When that probe is off the line, the check
    says so (:meth:`MicrobatchSteps.settle` is False), nothing written is kept, and the value asked again is traced."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from ledgerspec.derivations.devices.prediction import cached_on_device
    from ledgerspec.derivations.estimate.cache import EstimateCache
    from ledgerspec.derivations.estimate.sweep import apply
    from tests.support.estimate_docs import ledger

    doc = ledger(layers=LAYERS, **CASES["lora"])
    store = EstimateCache(tmp_path / "cache")
    steps = MicrobatchSteps(doc, store=store)
    for b in (2, 6):
        steps.trace(b)
    memory = 1000 * 2**20
    waited: list[int] = []
    first = _check_off_the_line(steps, steps.regime(5), waited)
    written = {b: steps.on_device(b, memory) for b in (5, 3)}  # the check's microbatch is 4
    # both handed out before the check was waited for
    assert waited == [] and sorted(steps.unconfirmed) == [(3, memory), (5, memory)]
    assert all(p.replayed.stream.startswith("synthesised") for p in written.values())
    assert all(cached_on_device(apply(doc, {"microbatch": b}), memory, store=store) is None for b in written)
    assert steps.settle() is False and waited == [2]
    assert not steps.unconfirmed and not steps.synthesised
    again = steps.on_device(5, memory)
    assert 5 in steps.steps and again.replayed.stream.startswith("built from the probes"), again.replayed.stream
    assert any(
        n.startswith(f"microbatch 5: traced, its stream not written from the traced ones (event {first} ")
        for n in steps.notes
    ), steps.notes
    kept = cached_on_device(apply(doc, {"microbatch": 5}), memory, store=store)
    assert kept is not None and kept.replayed.stream == again.replayed.stream  # the traced verdict, not the written
    assert steps.settle() is True


def test_a_fit_check_whose_line_fails_after_its_verdicts_were_used_is_asked_again(tmp_path: Path) -> None:
    """``--fit microbatch`` on the device, with the probe that checks the line off it and handed back only at the
    end: the search went on with the written verdicts, then asks again, and every value it finally reports was traced
    and is the answer tracing every value gives (an independent run, each value traced on its own)."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices.along import MicrobatchSteps
    from ledgerspec.derivations.devices.fit_check import check_on_device
    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.estimate.search import fit_microbatch
    from ledgerspec.derivations.estimate.sweep import apply

    doc = fit_doc()
    steps = MicrobatchSteps(doc)
    answer = fit_microbatch(doc, FIT_MEMORY, steps.estimate)
    assert answer.largest is not None
    regime = steps.regime(answer.largest)
    waited: list[int] = []
    _check_off_the_line(steps, regime, waited)
    checked = check_on_device(doc, answer, FIT_MEMORY, along=steps)
    assert waited and waited[0] >= 1, waited  # verdicts were handed out before the check
    assert not steps.synthesised and all(c.value in steps.steps for c in checked.checked)
    for c in checked.checked:
        _, p = estimate_on_device(apply(doc, {"microbatch": c.value}), FIT_MEMORY)
        assert (c.fits, c.device_peak, c.margin, c.decided_by) == (p.fits, p.device_peak, p.margin, p.decided_by)


def test_a_length_from_three_traced_lengths_is_the_trace() -> None:
    """Along ``max_length`` each allocation is a polynomial of degree 2 at lengths that are powers of two (eager
    attention.s ``L x L`` mask); the shallowest probe's streams at 32, 64 and 128 tokens define it, 256 checks it,
    and 512 is the trace. At 48 tokens a workspace SDPA rounds up to a power of two leaves the polynomial: refused."""
    pytest.importorskip("torch")
    from ledgerspec.derivations.allocator.affine import NotPolynomial, family
    from ledgerspec.derivations.allocator.step import step_events
    from ledgerspec.derivations.estimate.sweep import apply
    from tests.support.estimate_docs import ledger

    doc = ledger(arch="tiny-llama-gqa", attention="sdpa", checkpointing=True, microbatch=2, seq=512)

    def probe(n: int) -> list[Any]:
        return step_events(apply(doc, {"max_length": n}), layers=2).events

    streams = {n: probe(n) for n in (32, 64, 128, 256)}
    fam = family(streams, 2, "max_length")
    assert canonical(fam.stream(512)) == canonical(probe(512))
    with pytest.raises(NotPolynomial):
        family({**streams, 48: probe(48)}, 2, "max_length")


@pytest.mark.xdist_group("along-fit-checked")
def test_with_a_helper_process_the_checks_are_the_same(fit_checked: tuple[Any, Any, Any, Any]) -> None:
    """In a fresh process (nothing traced yet, as the CLI) the microbatch streams use a helper process: each traced
    microbatch's deepest probe, the probe that checks the line and (where fragmentation decides) half of the allocator
    settings tried run there.
    Every check equals the one computed in turn (in this test's process)."""
    import os

    from ledgerspec.derivations.engine import beside
    from tests.support import python_json

    if not hasattr(os, "fork") or beside.usable_cpus() < 2:
        pytest.skip("a helper process needs fork and a second CPU")

    memory = FIT_MEMORY
    code = (
        "import json\n"
        "from ledgerspec.derivations.devices.along import MicrobatchSteps\n"
        "from ledgerspec.derivations.devices.fit_check import check_on_device\n"
        "from ledgerspec.derivations.engine import beside\n"
        "from ledgerspec.derivations.estimate.search import fit_microbatch\n"
        "from tests.derivations.devices.test_along import fit_doc\n"
        "assert beside.can_fork()\n"
        "doc = fit_doc()\n"
        "with MicrobatchSteps(doc, parallel=True) as along:\n"
        f"    checked = check_on_device(doc, fit_microbatch(doc, {memory}, along.estimate), {memory}, along=along)\n"
        "    print(json.dumps({'helper': along.helper is not None and along.helper.running,\n"
        "                      'checked_at': along.checked_at, 'synthesised': sorted(along.synthesised),\n"
        "                      'checked': [c.__dict__ for c in checked.checked]}))\n"
    )
    there = python_json(code)
    assert there["helper"] and there["synthesised"], there
    _doc, _store, along, checked = fit_checked  # computed in turn, in this process
    assert there["checked"] == [c.__dict__ for c in checked.checked]
    assert there["synthesised"] == sorted(along.synthesised)
    # the line was checked at the same microbatch (traced ahead of time by the helper there, here when needed)
    assert there["checked_at"] == {str(k): v for k, v in along.checked_at.items()} and along.checked_at
