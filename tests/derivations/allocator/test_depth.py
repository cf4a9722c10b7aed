"""The full-depth event stream built from three shallow probes (:mod:`ledgerspec.derivations.allocator.depth`).

The truth is always a stream of the full depth produced independently: a toy step written out here, layer by layer,
for the construction's rules (fast), and real full-depth traces of the estimate's step for tiny models of each layer
pattern (slow): event by event the same allocations and frees, and the replay's figures the same phase by phase.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from ledgerspec.derivations.allocator.depth import NotExtensible, canonical, extend_stream
from ledgerspec.derivations.allocator.replay import Event

# -- a toy step, written out for any depth ----------------------------------------------------------------------------


def toy_step(layers: int, period: int = 1, lifetime: int = 1, quadratic: bool = False) -> list[Event]:
    """The allocation stream of a made-up training step of ``layers`` layers, as a tracker would log it.

    Layer kinds alternate with ``period`` (sizes differ by kind); the first layer keeps the embedding output alive
    (the model's forward holds it), each other layer frees its input after the residual add; backward runs the
    layers in reverse, frees what the forward saved last in first out and creates the adapters' gradients; the
    optimizer takes one norm per parameter, stacks them (a buffer that grows with the parameter count), creates its
    state per parameter and frees the gradients in parameter order. ``lifetime``: how many layers later a layer's
    kept tensor is freed (1: by the next layer). ``quadratic``: a buffer of ``layers**2`` bytes (not a pattern the
    depth repeats)."""
    events: list[Event] = []
    ids = itertools.count()

    def alloc(size: int) -> int:
        ident = next(ids)
        events.append(("alloc", ident, size, 0))
        return ident

    def free(ident: int) -> None:
        events.append(("free", ident))

    kinds = [layer % period for layer in range(layers)]
    width = [1000, 3000]
    events.append(("phase", "0:frozen_params"))
    alloc(50_000)
    for kind in kinds:
        alloc(4 * width[kind])
        alloc(4096)
    alloc(60_000)
    events.append(("phase", "1:adapter"))
    params = [(alloc(64), 64) for _ in kinds for _ in range(2)]  # lora_A, lora_B of each layer
    events.append(("phase", "2:optimizer"))
    events.append(("phase", "3:activations"))
    embedded = alloc(2048)
    hidden = embedded
    kept: list[int] = []
    saved: list[list[int]] = []
    for n, kind in enumerate(kinds):
        norm = alloc(4096)
        temp = alloc(width[kind])
        act = alloc(2 * width[kind])
        free(temp)
        out = alloc(2048)
        if n > 0:
            free(hidden)  # the input, after the residual add
        kept.append(alloc(512))
        if len(kept) > lifetime:
            free(kept.pop(0))
        saved.append([norm, act])
        hidden = out
    for k in kept:
        free(k)
    final = alloc(2048)
    free(hidden)
    logits = alloc(32_000)
    if quadratic:
        alloc(layers * layers)
    free(embedded)
    events.append(("phase", "4:temporary"))
    grad = alloc(32_000)
    free(logits)
    grad_hidden = alloc(2048)
    free(grad)
    grads: list[int] = [0] * len(params)
    for n in reversed(range(layers)):
        grads[2 * n + 1] = alloc(64)
        grads[2 * n] = alloc(64)
        grad_input = alloc(2048)
        for t in reversed(saved[n]):
            free(t)
        free(grad_hidden)
        grad_hidden = grad_input
    free(grad_hidden)
    free(final)
    events.append(("phase", "5:optimizer"))
    norms = [alloc(4) for _ in params]
    stacked = alloc(4 * len(params))
    total = alloc(4)
    free(stacked)
    for t in reversed(norms):
        free(t)
    for _, size in params:
        alloc(4)  # step
        alloc(size)  # exp_avg
        alloc(size)  # exp_avg_sq
    temps = [alloc(size) for _, size in params]
    for t in temps:
        free(t)
    free(total)
    for g in grads:
        free(g)
    return events


def built(depth: int, probes: tuple[int, int, int] = (2, 3, 4), **kw: Any) -> list[Event]:
    return extend_stream({n: toy_step(n, **kw) for n in probes}, depth)


@pytest.mark.parametrize("depth", [2, 3, 4, 5, 12, 40])
def test_the_toy_step_of_any_depth_from_three_probes(depth: int) -> None:
    assert canonical(built(depth)) == canonical(toy_step(depth))


@pytest.mark.parametrize("depth", [4, 6, 8, 14, 42])
def test_a_period_two_stack_from_probes_two_periods_apart(depth: int) -> None:
    assert canonical(built(depth, (4, 6, 8), period=2)) == canonical(toy_step(depth, period=2))


def test_a_partner_two_periods_away_is_refused_not_guessed() -> None:
    # each layer frees what the layer two before it kept: the third probe shows it, and no rule of the family (a
    # partner at most one copy away) fits it
    with pytest.raises(NotExtensible, match="follows no rule"):
        built(16, lifetime=2)


def test_what_probes_this_shallow_cannot_show() -> None:
    # kept three layers: in probes of 2, 3 and 4 layers no layer frees what another kept (the one free that would,
    # at the end of the fourth layer, sits just before the frees after the loop), so these probes are the streams
    # of a step that keeps them to the end of the forward, and the construction builds that step. The same limit
    # as the estimate's linear extrapolation: the probes must show the per-period pattern.
    for n in (2, 3, 4):
        assert canonical(toy_step(n, lifetime=3)) == canonical(toy_step(n, lifetime=99))
    assert canonical(built(16, lifetime=3)) == canonical(toy_step(16, lifetime=99))


def test_a_buffer_that_does_not_grow_by_the_same_bytes_per_period_is_refused() -> None:
    with pytest.raises(NotExtensible):
        built(16, quadratic=True)


def test_probes_that_do_not_grow_alike_are_refused() -> None:
    streams = {2: toy_step(2), 3: toy_step(3), 4: [*toy_step(4), ("alloc", 10**6, 8, 0)]}
    with pytest.raises(NotExtensible, match="not the same growth per period"):
        extend_stream(streams, 16)


def test_the_depth_must_be_whole_periods_past_the_first_probe() -> None:
    with pytest.raises(ValueError, match="whole periods"):
        extend_stream({4: toy_step(4), 6: toy_step(6), 8: toy_step(8)}, 13)
    with pytest.raises(ValueError, match="one period apart"):
        extend_stream({2: toy_step(2), 3: toy_step(3), 5: toy_step(5)}, 13)


def test_canonical_streams_ignore_ids_not_which_allocation_is_freed() -> None:
    a = [("alloc", 7, 10, 0), ("alloc", 9, 10, 0), ("free", 7)]
    b = [("alloc", 1, 10, 0), ("alloc", 2, 10, 0), ("free", 1)]
    c = [("alloc", 1, 10, 0), ("alloc", 2, 10, 0), ("free", 2)]
    assert canonical(a) == canonical(b) != canonical(c)


# -- real steps: the construction against full-depth traces ----------------------------------------------------------

#: the depth of the period-1 cases below: 4 periods past the shallowest probe (2 layers), the least depth at which
#: no two rules of the family name the same copy (a first copy + d and a last copy + d' coincide only while
#: k - 1 = d - d' <= 2, so at k <= 3 the build could pass where a deeper one finds two rules disagreeing); the
#: tiny configs' 8 layers (k = 6) only repeated the same events twice more
DEPTH = 6
REAL_CASES: dict[str, dict[str, Any]] = {
    # the plain step (LoRA on q/v, no checkpointing, one micro-step) at 32 layers: 30 periods past the shallowest
    # probe (a separate shallow case of the same step was the same branch, shallower)
    "llama-32-layers": {"arch": "tiny-llama-gqa", "seq": 32, "layers": 32},
    "llama-ckpt-accum2": {
        "arch": "tiny-llama-gqa",
        "checkpointing": True,
        "accumulation": 2,
        "microbatch": 1,
        "seq": 64,
        "layers": DEPTH,
    },
    "qwen2-accum2": {"arch": "tiny-qwen2", "seq": 128, "accumulation": 2, "layers": DEPTH},
    "mistral-ckpt": {
        "arch": "tiny-mistral",
        "checkpointing": True,
        "seq": 128,
        "targets": "all-linear",
        "layers": DEPTH,
    },
    "qwen2-qlora-nf4": {"arch": "tiny-qwen2", "quant": "nf4", "targets": "all-linear", "seq": 80, "layers": DEPTH},
    "llama-qlora-paged8bit-ckpt-accum2": {
        "arch": "tiny-llama-gqa",
        "quant": "nf4",
        "dtype": "float16",
        "checkpointing": True,
        "accumulation": 2,
        "optimizer": "paged_adamw_8bit",
        "targets": "all-linear",
        "microbatch": 1,
        "seq": 48,
        "layers": DEPTH,
    },
    "llama-custom-loop": {"arch": "tiny-llama-gqa", "loop": "custom", "seq": 64, "layers": DEPTH},
    # Gemma2's sliding/full pattern (period 2, probes 4, 6, 8): a 10-layer copy of the tiny config, so that the
    # stream is built a period past the third probe
    "gemma2-accum2": {"arch": "tiny-gemma2", "attention": "eager", "seq": 128, "accumulation": 2, "layers": 10},
    "gemma2-flash-ckpt": {
        "arch": "tiny-gemma2",
        "attention": "flash_attention_2",
        "seq": 128,
        "checkpointing": True,
        "layers": 10,
    },
}
#: the cases other tests of this module read too: each in one xdist group with them, so it is traced once
SHARED = {"llama-ckpt-accum2", "qwen2-accum2"}
REAL = [
    pytest.param(name, id=name, marks=[pytest.mark.xdist_group(f"depth-{name}")] if name in SHARED else [])
    for name in REAL_CASES
]


@pytest.fixture(scope="module")
def real_steps() -> Any:
    """``steps(name)``: the real case's ledger, its stream built from the probes (:func:`full_depth_events`) and its
    full-depth trace (every layer traced), each traced once in this module for every test that reads the case."""
    seen: dict[str, tuple[Any, Any, Any]] = {}

    def steps(name: str) -> tuple[Any, Any, Any]:
        if name not in seen:
            pytest.importorskip("torch")
            from ledgerspec.derivations.allocator.step import full_depth_events, step_events
            from tests.support.estimate_docs import ledger

            doc = ledger(**REAL_CASES[name])  # with ``layers``: over a copy of the tiny config that deep
            seen[name] = (doc, full_depth_events(doc), step_events(doc, layers=None))
        return seen[name]

    return steps


@pytest.mark.slow
@pytest.mark.parametrize("case", REAL)
def test_the_stream_built_from_probes_is_the_full_depth_trace(case: str, real_steps: Any) -> None:
    from ledgerspec.derivations.allocator.step import replay_step

    doc, step, full = real_steps(case)
    assert step.fallback is None and step.method.startswith("built from the probes"), step.method
    assert full.method == f"traced with {full.layers} decoder layers"  # every layer, not built
    assert step.layers == full.layers and step.windows == full.windows
    assert canonical(step.events) == canonical(full.events)
    ours, truth = replay_step(doc, step=step), replay_step(doc, step=full)
    assert ours.phases == truth.phases
    for name, figures in truth.phases.items():
        assert figures.allocated == full.figures[name], name  # the trace's own count at full depth


@pytest.mark.slow
@pytest.mark.xdist_group("depth-llama-ckpt-accum2")  # the case's streams, traced once
def test_the_first_oom_at_full_depth_is_the_full_traces(real_steps: Any) -> None:
    # what reserved_step(doc, capacity=...) replays: the stream built from the probes (full_depth_events)
    from ledgerspec.derivations.allocator.step import replay_step

    doc, built, full = real_steps("llama-ckpt-accum2")
    truth = replay_step(doc, step=full)
    capacity = max(p.reserved for p in truth.phases.values()) - 1
    tight = replay_step(doc, capacity=capacity, step=built)
    expected = replay_step(doc, capacity=capacity, step=full)
    assert tight.oom is not None and tight.oom == expected.oom
    assert tight.oom.free_unusable == tight.oom.reserved - tight.oom.allocated
    assert tight.oom.reserved + tight.oom.alloc_size > capacity
    roomy = replay_step(doc, capacity=capacity + 1, step=built)
    assert roomy.fits and roomy.phases == truth.phases


@pytest.mark.slow
def test_streams_the_probes_cannot_give_are_traced_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.allocator import step as step_module
    from tests.support.estimate_docs import ledger

    def refuse(shallow: Any, second: Any, third: Any) -> Any:
        raise NotExtensible("a free follows no rule of the depth pattern")

    monkeypatch.setattr(step_module, "template", refuse)
    doc = ledger(seq=32, layers=DEPTH)  # probes of 2, 3 and 4 layers, then the fallback's full trace
    step = step_module.full_depth_events(doc)
    assert step.fallback is not None and f"traced all {DEPTH} layers instead" in step.fallback
    assert "\n" not in step.fallback and "follows no rule" in step.fallback
    assert canonical(step.events) == canonical(step_module.step_events(doc, layers=None).events)


@pytest.mark.slow
@pytest.mark.xdist_group("depth-llama-ckpt-accum2")  # the case's streams, traced once
def test_a_deferred_stream_is_built_when_finished_and_is_the_same(real_steps: Any) -> None:
    """``full_depth(defer=True)`` traces the three probes and gives the estimate's figures at once; the stream (and
    its depth pattern) only when :meth:`StepEvents.finish` is called: then the stream built at once, and the full
    trace's. A step sent to another process is finished first."""
    import pickle

    from ledgerspec.derivations.allocator.step import full_depth_from
    from ledgerspec.derivations.estimate.estimator import prepare

    doc, built, full = real_steps("llama-ckpt-accum2")
    later = full_depth_from(prepare(doc, "cuda"), defer=True)
    assert later.events == [] and later.pattern is None and later.pending is not None
    assert later.estimate_figures == built.estimate_figures and later.figures == built.figures
    sent = pickle.loads(pickle.dumps(later))
    assert later.pending is None and later.pattern is not None and sent.events == later.events
    assert later.method == built.method and canonical(later.events) == canonical(full.events)


def test_a_deferred_build_that_fails_is_left_to_be_built_again() -> None:
    """What a deferred build raises reaches whoever finishes the step, and the step stays unbuilt (never an empty
    stream taken for a built one): the next finish builds it."""
    from ledgerspec.derivations.allocator.step import StepEvents

    tries: list[int] = []
    built = StepEvents([("alloc", 1, 512, 0), ("free", 1)], ["w:frozen_params"], 1, {}, method="built")

    def build() -> StepEvents:
        tries.append(len(tries))
        if len(tries) == 1:
            raise ValueError("the first build fails")
        return built

    later = StepEvents([], ["w:frozen_params"], 1, {}, method="to be built", pending=build)
    with pytest.raises(ValueError, match="first build"):
        later.finish()
    assert later.pending is build and later.events == []
    assert later.finish() is later and later.pending is None
    assert later.events == built.events and later.method == "built" and tries == [0, 1]
    assert later.finish().events == built.events and tries == [0, 1]  # built once


@pytest.mark.slow
def test_a_deferred_stream_the_probes_cannot_give_is_traced_in_full_when_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.allocator import step as step_module
    from ledgerspec.derivations.estimate.estimator import prepare
    from tests.support.estimate_docs import ledger

    def refuse(shallow: Any, second: Any, third: Any) -> Any:
        raise NotExtensible("a free follows no rule of the depth pattern")

    monkeypatch.setattr(step_module, "template", refuse)
    doc = ledger(seq=32, layers=DEPTH)
    step = step_module.full_depth_from(prepare(doc, "cuda"), defer=True)
    assert step.fallback is None and step.events == []
    step.finish()
    assert step.fallback is not None and f"traced all {DEPTH} layers instead" in step.fallback
    assert canonical(step.events) == canonical(step_module.step_events(doc, layers=None).events)


@pytest.mark.slow
def test_a_stack_too_shallow_for_a_third_probe_is_traced_in_full() -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.allocator.step import full_depth_events
    from tests.support.estimate_docs import ledger

    step = full_depth_events(ledger(arch="tiny-gemma2", attention="eager", seq=32))  # 8 layers, probes 4 and 6
    assert step.fallback is None and step.layers == 8
    assert step.method == "traced with all 8 decoder layers (a third probe would be as deep)"


@pytest.mark.slow
@pytest.mark.xdist_group("depth-qwen2-accum2")  # the case's streams, traced once
def test_the_built_streams_figures_are_the_estimates(real_steps: Any) -> None:
    # the estimate extrapolates its probes' figures linearly; the built stream, replayed (as reserved_step replays
    # it), counts the same bytes
    from ledgerspec.derivations.allocator.step import replay_step
    from ledgerspec.derivations.estimate.estimator import estimate

    doc, built, _ = real_steps("qwen2-accum2")
    replayed, est = replay_step(doc, step=built), estimate(doc)
    assert replayed.step.method.startswith("built from the probes") and est.plan.probes == (2, 3)
    assert {name: f.allocated for name, f in replayed.phases.items()} == est.phases
    assert all(f.allocator_allocated >= f.allocated for f in replayed.phases.values())
