"""Device verdicts along the microbatch at the cost of the delta: full-depth streams traced at two microbatches, every
other one synthesised from them event by event (:mod:`ledgerspec.derivations.allocator.affine`), checked first.

``estimate --fit microbatch`` decides up to five microbatches on the device (:mod:`.fit_check`); each used to trace
its own full-depth stream (the estimate's two depth probes and a third). :class:`MicrobatchSteps` is the fit's
``estimate_fn`` as well: each estimate the search traces (:func:`step_and_estimate`) keeps its full-depth stream and
its shallowest probe's stream. The first traced microbatch of a regime learns the depth pattern from three probes;
the next one traces its two shallower probes only and is built with that pattern
(:func:`ledgerspec.derivations.allocator.depth.retarget`; its third probe is traced where its probes do not fit
it). A microbatch that was not traced is then written from two traced ones of its regime (a batch of one row is not
padded: its own structure) when

1. the two full-depth streams have one structure (the same events in the same order, each free releasing the same
   allocation; only sizes differ), and
2. the shallowest probe, traced once at a third microbatch (halfway between the two smallest traced ones of the
   regime, else the first one synthesised: the same microbatch whether a helper traced it or not), lies event by
   event on the line through the two traced microbatches nearest it: every allocation's bytes an exact affine
   function of the microbatch, and the structure the same.

Every event of the full-depth stream is an event of the probes at that depth, repeated per layer (the depth template,
:mod:`ledgerspec.derivations.allocator.depth`), so the third microbatch's probe checks each kind of event the stream
holds. Anything that does not hold raises :class:`~ledgerspec.derivations.allocator.affine.NotPolynomial`, and the
microbatch is traced as before (its stream kept: the next one may use it). ``tests/derivations/devices/test_along.py``
compares synthesised streams with real traces event by event (LoRA and QLoRA, checkpointing on and off).

With ``parallel``, a :class:`~ledgerspec.derivations.engine.beside.Helper` forked before the first trace runs the
first traced microbatch's deepest probe and the next one's second probe while this process traces the others, the
checking probe as soon as a regime has two traced microbatches (:meth:`MicrobatchSteps.prefetch_check`: ready by the
time the first one is synthesised), and half of the allocator settings a fragmentation-decided verdict tries;
:meth:`MicrobatchSteps.close` stops it. The answers are the same wherever they were computed. While the helper still
traces the checking probe, each value written is replayed and its verdict handed out
(:attr:`MicrobatchSteps.unconfirmed`); it is kept in the cache only once the check passes, and when the check fails
:meth:`MicrobatchSteps.settle` says so, and whoever used those verdicts asks again (those values are then traced).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ledgerspec.contract import config
from ledgerspec.contract.document import Document
from ledgerspec.derivations.allocator.affine import NotPolynomial, family


class MicrobatchSteps:
    """Full-depth steps of ``doc``'s microbatch variants: traced at a few, synthesised at the others."""

    def __init__(
        self,
        doc: Document,
        target: str = "cuda",
        layers: str = "auto",
        store: Any = None,
        parallel: bool = False,
        offline: bool = True,
    ) -> None:
        self.doc = doc
        self.target = target
        self.layers = layers
        self.store = store
        self.parallel = parallel
        self.offline = offline
        self.padded = config.read(doc).workload.pads_rows
        self.steps: dict[int, Any] = {}  # microbatch -> traced full-depth StepEvents
        self.estimates: dict[int, Any] = {}
        self.shallow: dict[int, list[Any]] = {}  # microbatch -> the shallowest probe's events
        self.shallow_depth: int | None = None
        self.checked: dict[int, str | None] = {}  # regime -> None (checked) or why synthesis is refused
        self.synthesised: dict[int, Any] = {}
        self.traces = 0  # full-depth traces run here
        self.notes: list[str] = []
        self.helper: Any = None  # the Helper process (parallel only; forked before the first trace)
        #: regime -> (the microbatch its line is checked at, the function that waits for that probe's stream)
        self._checking: dict[int, tuple[int, Callable[[], Any]]] = {}
        self.checked_at: dict[int, int] = {}  # regime -> the microbatch its line was checked at
        #: regime -> (the depth pattern of its first traced microbatch's three probes, where): a later microbatch of
        #: the regime traces only the two shallower probes (:func:`ledgerspec.derivations.allocator.step.full_depth`)
        self.patterns: dict[int, tuple[Any, str]] = {}
        #: (microbatch, microbatch) -> the StreamFamily of their full-depth streams (built once per pair: checking
        #: that two streams of 100,000 events have one structure costs as much as writing one)
        self.families: dict[tuple[int, int], Any] = {}
        #: (microbatch, device memory) -> (its document, its DevicePrediction): verdicts of written streams replayed
        #: while the helper still traced the probe that checks their line, kept (cached) only once that check passes
        self.unconfirmed: dict[tuple[int, int], tuple[Document, Any, bool]] = {}
        #: whether a line's check failed after verdicts written from it were handed out (:meth:`settle`)
        self.retracted = False

    def close(self) -> None:
        """Stop the helper process (if any)."""
        if self.helper is not None:
            self.helper.close()

    def __enter__(self) -> MicrobatchSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _elsewhere(self, doc: Document) -> Callable[[int], Callable[[], Any]] | None:
        """Where a traced microbatch's deepest probe runs: the helper, forked now when this process has not traced
        yet (after importing what the trace imports, so that the helper finds it imported); None: beside it in a
        child of its own, or in turn (``parallel``)."""
        from ledgerspec.derivations.allocator.step import probe_of
        from ledgerspec.derivations.engine.beside import Helper, can_fork
        from ledgerspec.derivations.estimate.estimator import prepare

        if not self.parallel:
            return None
        if self.helper is None and can_fork():
            try:
                prepare(doc, self.target, self.layers, offline=self.offline).warm()
            except Exception:  # the trace reports what fails
                return None
            self.helper = Helper()
        if self.helper is None or not self.helper.running:
            return None
        helper = self.helper
        return lambda n: helper.submit(probe_of, doc, self.target, self.layers, self.offline, n)

    # -- traces
    def _variant(self, b: int) -> Document:
        from ledgerspec.derivations.estimate.sweep import apply

        return apply(self.doc, {"microbatch": b})

    def _microbatch(self, doc: Document) -> int:
        return int(config.read(doc).workload.microbatch or 1)

    def regime(self, b: int) -> int:
        return 0 if self.padded and b == 1 else 1

    def trace(self, b: int, doc: Document | None = None, defer: bool = False) -> tuple[Any, Any]:
        """The estimate and full-depth stream of microbatch ``b``, traced (and kept). ``defer``: the stream is built
        from the probes later (:meth:`finish`; the estimate is there at once): the search needs only the estimate,
        and the next microbatch's trace builds it while the helper traces that one's second probe."""
        from ledgerspec.derivations.devices.prediction import step_and_estimate

        if b in self.steps:
            if not defer:
                self.finish()
            return self.estimates[b], self.steps[b]
        probes: dict[int | None, Any] = {}
        variant = doc if doc is not None else self._variant(b)
        elsewhere = self._elsewhere(variant)
        regime = self.regime(b)
        known = regime in self.patterns or any(
            self.regime(v) == regime and s.pending is not None for v, s in self.steps.items()
        )
        est, step = step_and_estimate(
            variant,
            self.target,
            self.layers,
            self.offline,
            self.store,
            self.parallel and not self.steps and elsewhere is None,
            None,
            probes,
            elsewhere,
            (lambda: self._pattern(regime)) if known else None,
            defer=defer,
            idle=self.finish,
        )
        self.traces += 1
        self.steps[b], self.estimates[b] = step, est
        if not defer:
            self.finish()
        depths = [n for n in probes if n is not None]
        if depths:
            self.shallow_depth = min(depths)
            self.shallow[b] = list(probes[self.shallow_depth].events)
        elif None in probes:
            self.shallow[b] = list(probes[None].events)
        self.prefetch_check(b)  # the helper is free again: the line's checking probe can start now
        return est, step

    def finish(self) -> None:
        """Build the traced streams whose building was deferred (in the order traced; what a build raises leaves that
        stream to be built again), and learn each regime's depth pattern from its first traced microbatch."""
        for b, step in self.steps.items():
            step.finish()
            regime = self.regime(b)
            if step.pattern is not None and regime not in self.patterns:
                self.patterns[regime] = (step.pattern, f"microbatch {b}")

    def _pattern(self, regime: int) -> tuple[Any, str] | None:
        """The depth pattern of ``regime`` (its first traced microbatch's stream built first, when it is not yet)."""
        self.finish()
        return self.patterns.get(regime)

    def estimate(self, doc: Document) -> Any:
        """The search's ``estimate_fn``: the plain estimate (from the cache when it holds it; else traced with its
        full-depth stream, which is kept)."""
        from ledgerspec.derivations.estimate.cache import cached
        from ledgerspec.derivations.estimate.estimator import Estimate

        question = {"target": self.target, "layers": self.layers, "offline": self.offline}
        b = self._microbatch(doc)
        return cached(
            self.store, doc, question, lambda: self.trace(b, doc, defer=True)[0], Estimate.to_cache, Estimate.from_cache
        )

    # -- synthesis
    def _pair(self, b: int) -> tuple[int, int] | None:
        same = sorted(
            (v for v in self.steps if self.regime(v) == self.regime(b) and v != b), key=lambda v: (abs(v - b), v)
        )
        return (min(same[0], same[1]), max(same[0], same[1])) if len(same) >= 2 else None

    def _shallow_at(self, b: int) -> list[Any]:
        """The shallowest probe's stream at microbatch ``b`` (one trace)."""
        from ledgerspec.derivations.allocator.step import probe_of

        return list(probe_of(self._variant(b), self.target, self.layers, self.offline, self.shallow_depth).events)

    def _check_value(self, regime: int) -> int | None:
        """Where the line of ``regime`` is checked: halfway between its two smallest traced microbatches (None:
        fewer than two, or none between them: then at the first microbatch synthesised)."""
        traced = sorted(v for v in self.steps if self.regime(v) == regime)
        if len(traced) < 2 or traced[1] - traced[0] < 2:
            return None
        return (traced[0] + traced[1]) // 2

    def prefetch_check(self, b: int) -> None:
        """Start tracing the probe that checks the line of ``b``'s regime in the helper (if there is one, and the
        line is not checked yet), so that it is ready when the first microbatch is synthesised."""
        from ledgerspec.derivations.allocator.step import probe_of

        regime = self.regime(b)
        if self.helper is None or regime in self.checked or regime in self._checking or self.shallow_depth is None:
            return
        m = self._check_value(regime)
        if m is None:
            return
        waiting = self.helper.submit(
            probe_of, self._variant(m), self.target, self.layers, self.offline, self.shallow_depth
        )
        self._checking[regime] = (m, waiting)

    def _check(self, regime: int, b: int) -> None:
        """Check the line of ``regime`` at :meth:`_check_value` (else at ``b``), with the helper's probe when it
        traced that one, else traced here: the same check either way. Raises NotPolynomial (also when the checking
        probe fails: the microbatch is then traced instead)."""
        from ledgerspec.errors import LedgerspecError

        if self.shallow_depth is None:
            raise NotPolynomial("the probes' streams were not kept")
        m = self._check_value(regime) or b
        started = self._checking.pop(regime, None)
        waiting = started[1] if started is not None and started[0] == m else None
        pair = self._pair(m)
        if pair is None or any(v not in self.shallow for v in pair):
            raise NotPolynomial("the probes' streams were not kept")
        try:
            events = list(waiting().events) if waiting is not None else self._shallow_at(m)
        except LedgerspecError as exc:
            raise NotPolynomial(f"the probe that checks the line at microbatch {m} failed: {exc.message}") from None
        self.checked_at[regime] = m
        family({**{v: self.shallow[v] for v in pair}, m: events}, 1, "microbatch")

    def synthesise(self, b: int, wait: bool = True) -> Any:
        """The full-depth stream of microbatch ``b`` written from two traced ones of its regime (checked as the
        module docstring says); raises :class:`NotPolynomial` (or ValueError without two traced microbatches).
        ``wait=False``: when the helper is still tracing the probe that checks the line, the stream is written now
        and the check is left to a later call or :meth:`settle` (which must pass before anything read off the stream
        is kept)."""
        from ledgerspec.derivations.allocator.step import StepEvents

        if b in self.synthesised:
            return self.synthesised[b]
        pair = self._pair(b)
        if pair is None:
            raise ValueError(f"no two traced microbatches in the regime of microbatch {b}")
        self.finish()
        started = time.perf_counter()
        regime = self.regime(b)
        if regime not in self.checked and (wait or regime not in self._checking or self._arrived()):
            self._settle(regime, b)
        why = self.checked.get(regime)
        if why is not None:
            raise NotPolynomial(why)
        one, two = (self.steps[v] for v in pair)
        if one.windows != two.windows:
            raise NotPolynomial("the traced microbatches ran different protocol windows")
        if pair not in self.families:
            self.families[pair] = family({v: self.steps[v].events for v in pair}, 1, "microbatch")
        events = self.families[pair].stream(b)
        step = StepEvents(
            events,
            list(one.windows),
            one.accumulation,
            {},
            layers=one.layers,
            method=f"synthesised from the full-depth streams of microbatch {pair[0]} and {pair[1]} (every "
            f"allocation affine in the microbatch, checked on the shallowest probe at {self._checked_at(regime, b)})"
            if not self.synthesised
            else f"synthesised from the full-depth streams of microbatch {pair[0]} and {pair[1]} (every allocation "
            "affine in the microbatch)",
            seconds=time.perf_counter() - started,
        )
        self.synthesised[b] = step
        return step

    def _arrived(self) -> bool:
        """Whether the helper is free: it has handed back what it was tracing (a check's probe is then read without a
        wait), or the probe was never sent to it (then it is traced here, as without a helper)."""
        return self.helper is not None and not self.helper.busy

    def _settle(self, regime: int, b: int) -> None:
        """Check the line of ``regime`` (:meth:`_check`) and keep the outcome: None, or why synthesis is refused.
        The verdicts written from that line before its check (:attr:`unconfirmed`) are then kept in the cache when it
        passes; when it fails they are dropped with their streams, and :attr:`retracted` says that they were handed
        out (:meth:`settle`)."""
        from ledgerspec.derivations.devices.prediction import keep_synthesised

        try:
            self._check(regime, b)
            self.checked[regime] = None
        except NotPolynomial as exc:
            self.checked[regime] = str(exc)
        mine = [(v, memory) for v, memory in self.unconfirmed if self.regime(v) == regime]
        for v, memory in mine:
            variant, p, from_flag = self.unconfirmed.pop((v, memory))
            if self.checked[regime] is None:
                keep_synthesised(
                    variant, memory, p, self.target, self.layers, self.offline, self.store, from_flag=from_flag
                )
            else:
                self.synthesised.pop(v, None)  # asked again, it is traced (and noted so)
                self.retracted = True

    def settle(self) -> bool:
        """Finish every line's check still waited for (the verdicts written before it then kept in the cache);
        False when a check failed after verdicts written from its line were handed out: whoever used them asks
        again (those microbatches are then traced)."""
        for regime in sorted({self.regime(v) for v, _ in self.unconfirmed}):
            if regime not in self.checked:
                self._settle(regime, min(v for v, _ in self.unconfirmed if self.regime(v) == regime))
        retracted, self.retracted = self.retracted, False
        return not retracted

    def _checked_at(self, regime: int, b: int) -> int:
        """Where the line of ``regime`` is (or will be) checked: as :meth:`_check` chooses, checked yet or not."""
        return self.checked_at.get(regime, self._check_value(regime) or b)

    def lines(self) -> list[str]:
        """How the streams checked on the device were obtained (what ``estimate --fit`` prints)."""
        out = []
        if self.synthesised:
            values = ", ".join(map(str, sorted(self.synthesised)))
            traced = ", ".join(map(str, sorted(self.steps)))
            out.append(
                f"streams on the device: microbatch {values} written from the full-depth streams traced at {traced} "
                "(every allocation affine in the microbatch, checked event by event on the shallowest probe)"
            )
        out.extend(self.notes)
        return out

    # -- verdicts
    def on_device(self, b: int, device_memory: int, from_flag: bool = False) -> Any:
        """The :class:`~ledgerspec.derivations.devices.prediction.DevicePrediction` of microbatch ``b``: from the
        cache, from its traced stream, from a synthesised one, or traced now (in that order); ``from_flag``: as
        :func:`~ledgerspec.derivations.devices.prediction.estimate_on_device` takes it."""
        from ledgerspec.derivations.devices.prediction import cached_on_device, estimate_on_device, stream_on_device

        variant = self._variant(b)
        # the optimizer state does not depend on the microbatch: any traced estimate's (the paged state's high end)
        state = next((e.components.get("optimizer") for e in self.estimates.values()), None)
        kept = cached_on_device(
            variant, device_memory, from_flag, self.target, self.layers, self.offline, self.store,
            optimizer_state=state,
        )  # fmt: skip
        if kept is not None:
            return kept
        if b not in self.steps:
            try:
                step = self.synthesise(b, wait=False)
            except (NotPolynomial, ValueError) as exc:
                if isinstance(exc, NotPolynomial):
                    # why this value cost a trace (the answer is the trace's either way)
                    self.notes.append(f"microbatch {b}: traced, its stream not written from the traced ones ({exc})")
            else:
                if self.regime(b) in self.checked:  # its line is checked: the verdict is kept at once
                    return stream_on_device(
                        variant, device_memory, lambda: step, from_flag, self.target, self.layers, self.offline,
                        self.store, helper=self.helper, optimizer_state=state,
                    )  # fmt: skip
                # replayed while the helper finishes the probe that checks the stream's line: handed out now, kept
                # once that check passes (:meth:`settle`), else dropped and the question asked again
                p = stream_on_device(
                    variant, device_memory, lambda: step, from_flag, self.target, self.layers, self.offline, None,
                    helper=self.helper, optimizer_state=state,
                )  # fmt: skip
                self.unconfirmed[(b, device_memory)] = (variant, p, from_flag)
                return p
        fn: Callable[[], tuple[Any, Any]] = lambda: self.trace(b, variant)  # noqa: E731
        _, p = estimate_on_device(
            variant,
            device_memory,
            from_flag,
            self.target,
            self.layers,
            self.offline,
            self.store,
            step_fn=fn,
            helper=self.helper,
        )
        return p


__all__ = ["MicrobatchSteps"]
