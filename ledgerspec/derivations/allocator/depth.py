"""The allocation event stream of a model's full depth, built from the streams of three shallow probes.

A step's event stream (:mod:`.replay`: allocations, frees, phase markers) grows with the number of decoder layers:
each added layer period adds the same events at the same places. :func:`extend_stream` takes the streams of three
probes ``n``, ``n + p`` and ``n + 2p`` layers deep (``p`` the period of the layer pattern) and writes the stream of
any depth ``n + k p``, event by event, or raises :class:`NotExtensible` when the probes do not follow that pattern.

The construction, in four steps, each checked:

1. **Slots.** The three streams are aligned at once: the shallowest is walked event by event, and at a few places
   (the *slots*) the second stream holds a *body* of extra events and the third the same body twice. An event of
   the shallowest stream matches its counterparts when the kinds agree (an allocation on the same stream, a free of
   an allocation as many phase windows back, the same marker) and the sizes (of the allocation, of what the free
   releases) make an arithmetic progression over the three probes (the same size three times, or a buffer that grows
   by the same bytes per period, such as a stack of per-parameter norms); a body repeats exactly. Where the walk
   stops matching, a slot opens (the latest place first, the longest body first, backtracking when the rest does
   not align); a forward or backward window has one slot (its layer blocks), an optimizer window one per foreach
   kernel or per-parameter loop. Nothing here knows about layers: a body may start in the middle of one.
2. **References.** Which allocation each free releases, at depth ``k`` periods past the shallowest probe, for an
   event of the shallow stream (``old``) or copy ``c`` of a slot's body: always the same old allocation, or offset
   ``o`` of copy ``idx`` of a slot's body with ``idx`` one of ``c + d`` (the same order: a forward layer's
   temporaries), ``k - 1 - c + d`` (the reverse order: backward releasing what the forward saved, last in first
   out), ``d`` or ``k - 1 + d`` (for an old event: the first or last copy), ``d`` in -1, 0, 1 (the neighbouring
   layer: a layer's input is the previous layer's output), and an old allocation in its place where ``idx`` falls
   outside the copies, by how far (the layers before the first copy are layers of the shallow stream). Every rule
   that agrees with the observations of the three probes (one for a copy of the second, two for the third; an old
   free's in all three) is kept. With ``|d| <= 1`` each rule names a copy of the third probe for some ``c``, so a
   rule is never kept on fallbacks alone.
3. **Which copies.** A slot opened at the latest place makes the last of its run of equal blocks the copies: the
   top layers in a forward window, the bottom ones in a backward window, and the backward frees of what the forward
   saved then have no partner one copy away. Moving a slot back by whole bodies changes no stream, only which of the
   shallow stream's blocks count as copies; while some free follows no rule, the slots those frees touch are moved
   back one at a time, and a move that leaves fewer such frees is kept. A free that still follows no rule stops the
   construction.
4. **Check.** The template built at ``k`` = 0, 1, 2 must give back the three probes' streams exactly (event by
   event, each free releasing the same allocation); at the depth asked for, the rules kept for each free must name
   the same allocation, and it must be alive.

:func:`retarget` carries a template to the two shallower probes of another step of the same structure (another
microbatch: the same events, only sizes differ), so that step needs no third probe.

What it assumes: that the probes already show the per-period pattern and deeper stacks only repeat it, as linear
extrapolation of the figures assumes (:mod:`ledgerspec.derivations.estimate.extrapolate`). A pattern the probes
show but the family cannot express (a partner two copies away, a size that does not grow by the same bytes per
period, bodies that do not repeat) raises :class:`NotExtensible`; one the probes cannot show is not seen: if every
layer freed what the layer three before it kept, probes of 2, 3 and 4 layers would be the streams of a step that
keeps those tensors to the end, and that step is what would be built. The tests compare the result with full-depth
traces of tiny models of each pattern and with a toy step written out for any depth
(``tests/derivations/allocator/test_depth.py``); every real step traced so far releases a layer's tensors within
its own period, the next one, or in a run of per-layer frees (backward, the optimizer), never later.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ledgerspec.derivations.allocator.replay import Event

#: how many gap openings the alignment may try before it gives up (a stream that does not fit the pattern)
SEARCH_BUDGET = 200_000
#: the copy offsets a reference rule may use (see the module docstring)
OFFSETS = (-1, 0, 1)


class NotExtensible(ValueError):
    """The probes' streams do not extend to a deeper stream by repeating per-period blocks (one line: why)."""


# -- streams --------------------------------------------------------------------------------------------------------


@dataclass
class _Stream:
    """One probe's events with their references resolved to event indices."""

    events: list[Event]
    kinds: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # an allocation's bytes; a free: its target's bytes
    targets: list[int] = field(default_factory=list)  # a free: the index of its allocation; else -1
    sigs: list[tuple[Any, ...]] = field(default_factory=list)  # what the alignment compares, sizes apart
    exact: list[tuple[Any, ...]] = field(default_factory=list)  # the signature with the size: bodies repeat exactly

    @classmethod
    def parse(cls, events: Sequence[Event]) -> _Stream:
        s = cls(list(events))
        where: dict[Any, int] = {}
        window = 0
        windows: list[int] = []
        for n, e in enumerate(s.events):
            kind = e[0]
            windows.append(window)
            if kind == "alloc":
                if e[1] in where:
                    raise NotExtensible(f"event {n}: id {e[1]!r} allocated twice")
                where[e[1]] = n
                s.kinds.append("alloc")
                s.sizes.append(int(e[2]))
                s.targets.append(-1)
                s.sigs.append(("a", int(e[3]) if len(e) > 3 else 0))
            elif kind == "free":
                t = where.pop(e[1], None)
                if t is None:
                    raise NotExtensible(f"event {n}: a free of {e[1]!r}, which is not allocated")
                s.kinds.append("free")
                s.sizes.append(s.sizes[t])
                s.targets.append(t)
                s.sigs.append(("f", window - windows[t], s.sigs[t][1], *e[2:]))
            else:
                if kind == "phase":
                    window += 1
                s.kinds.append("fixed")
                s.sizes.append(0)
                s.targets.append(-1)
                s.sigs.append(("x", *e))
        s.exact = [(*sig, size) for sig, size in zip(s.sigs, s.sizes, strict=True)]
        return s

    def __len__(self) -> int:
        return len(self.events)


def canonical(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    """``events`` with ids replaced by order: an allocation is ``("alloc", bytes, stream)``, a free ``("free", n)``
    with ``n`` the ordinal of the allocation it releases; two streams are the same when these lists are equal."""
    order: dict[Any, int] = {}
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e[0] == "alloc":
            order[e[1]] = len(order)
            out.append(("alloc", int(e[2]), int(e[3]) if len(e) > 3 else 0))
        elif e[0] == "free":
            out.append(("free", order[e[1]], *e[2:]))
        else:
            out.append(tuple(e))
    return out


# -- 1. slots -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Extra events before event ``at`` of the shallow stream: ``length`` events of the second stream from
    ``start2`` (the third holds them twice from ``start3``)."""

    at: int
    start2: int
    start3: int
    length: int


class _Aligner:
    def __init__(self, a: _Stream, b: _Stream, c: _Stream) -> None:
        self.a, self.b, self.c = a, b, c
        self.delta = len(b) - len(a)
        if len(c) - len(b) != self.delta or self.delta < 0:
            raise NotExtensible(
                f"the probes' streams have {len(a)}, {len(b)} and {len(c)} events: not the same growth per period"
            )
        self.failed: set[tuple[int, int]] = set()
        self.budget = SEARCH_BUDGET

    def matches(self, i: int, g: int) -> bool:
        a, b, c = self.a, self.b, self.c
        j, k = i + g, i + 2 * g
        if j >= len(b) or k >= len(c):
            return False
        sig = a.sigs[i]
        if sig != b.sigs[j] or sig != c.sigs[k]:
            return False
        if sig[0] == "x":
            return True
        s1, s2, s3 = a.sizes[i], b.sizes[j], c.sizes[k]
        return s2 - s1 == s3 - s2

    def gaps(self, i: int, g: int) -> Iterator[int]:
        """The body lengths a slot before shallow event ``i`` (``g`` extra events so far) can have, longest first."""
        b, c = self.b.exact, self.c.exact
        j, k = i + g, i + 2 * g
        most = self.delta - g
        common = 0
        while common < most and b[j + common] == c[k + common] and b[j + common][0] != "x":
            common += 1
        for n in range(common, 0, -1):
            if c[k : k + n] == c[k + n : k + 2 * n]:
                yield n

    def options(self, i: int, g: int) -> Iterator[tuple[int, int]]:
        """From shallow event ``i`` with ``g`` extra events so far: the places ``(pos, body length)`` where the next
        slot may open after the events that match, the latest place first, the longest body first; ``(m, 0)``:
        the end, everything aligned."""
        m = len(self.a)
        j = i
        while j < m and self.matches(j, g):
            j += 1
        for pos in range(j, i - 1, -1):
            if pos == m and g == self.delta:
                yield pos, 0
                continue
            if (pos, g) in self.failed:
                continue
            self.budget -= 1
            if self.budget < 0:
                raise NotExtensible("the probes' streams do not align within the search budget")
            for n in self.gaps(pos, g):
                yield pos, n

    def solve(self) -> list[_Slot]:
        """The slots, depth first with backtracking (an explicit stack: a stream may have hundreds of slots)."""
        stack: list[tuple[int, int, list[_Slot], Iterator[tuple[int, int]]]] = [(0, 0, [], self.options(0, 0))]
        while stack:
            i, g, slots, options = stack[-1]
            step = next(options, None)
            if step is None:
                stack.pop()
                self.failed.add((i, g))
                continue
            pos, n = step
            if n == 0:
                return slots
            if (pos, g + n) in self.failed:
                continue
            slot = _Slot(pos, pos + g, pos + 2 * g, n)
            stack.append((pos, g + n, [*slots, slot], self.options(pos, g + n)))
        raise NotExtensible("the probes' streams do not align as the shallowest plus repeated blocks")

    def shifted(self, slot: _Slot, t: int, g: int) -> _Slot | None:
        """``slot`` (``g`` extra events before it) opened ``t`` events earlier, if the streams still align so."""
        at = slot.at - t
        moved = _Slot(at, at + g, at + 2 * g, slot.length)
        n = slot.length
        b, c = self.b.exact, self.c.exact
        if b[moved.start2 : moved.start2 + n] != c[moved.start3 : moved.start3 + n]:
            return None
        if c[moved.start3 : moved.start3 + n] != c[moved.start3 + n : moved.start3 + 2 * n]:
            return None
        if not all(self.matches(x, g + n) for x in range(at, slot.at)):
            return None
        return moved

    def reach(self, slots: list[_Slot]) -> list[int]:
        """How many whole bodies each slot may move back (not past the slot before it)."""
        out = []
        g = 0
        for s, slot in enumerate(slots):
            floor = slots[s - 1].at if s else 0
            blocks = 0
            while slot.at - (blocks + 1) * slot.length >= floor:
                if self.shifted(slot, (blocks + 1) * slot.length, g) is None:
                    break
                blocks += 1
            out.append(blocks)
            g += slot.length
        return out

    def moved(self, slots: list[_Slot], shifts: Sequence[int]) -> list[_Slot]:
        """``slots`` each moved back by ``shifts`` bodies (as :meth:`reach` allows)."""
        out = []
        g = 0
        for slot, blocks in zip(slots, shifts, strict=True):
            moved = self.shifted(slot, blocks * slot.length, g) if blocks else slot
            assert moved is not None
            out.append(moved)
            g += slot.length
        return out


# -- 2. references --------------------------------------------------------------------------------------------------

#: where a free's allocation is: ("old", shallow index) or ("new", slot, copy, offset)
Where = tuple[Any, ...]


@dataclass
class _Template:
    a: _Stream
    slots: list[_Slot]
    pos2: list[int]  # shallow index -> index in the second stream
    pos3: list[int]
    where2: list[Where]  # index in the second stream -> which event of the template it is
    where3: list[Where]

    @classmethod
    def build(cls, a: _Stream, b: _Stream, c: _Stream, slots: list[_Slot]) -> _Template:
        pos2: list[int] = []
        pos3: list[int] = []
        where2: list[Where] = [()] * len(b)
        where3: list[Where] = [()] * len(c)
        g = 0
        at: dict[int, list[int]] = {}
        for s, slot in enumerate(slots):
            at.setdefault(slot.at, []).append(s)
        for i in range(len(a) + 1):
            for s in at.get(i, []):
                slot = slots[s]
                for o in range(slot.length):
                    where2[slot.start2 + o] = ("new", s, 0, o)
                    for copy in (0, 1):
                        where3[slot.start3 + copy * slot.length + o] = ("new", s, copy, o)
                g += slot.length
            if i < len(a):
                pos2.append(i + g)
                pos3.append(i + 2 * g)
                where2[i + g] = ("old", i)
                where3[i + 2 * g] = ("old", i)
        return cls(a, slots, pos2, pos3, where2, where3)


@dataclass(frozen=True)
class _Rule:
    """Where a free's allocation is at ``k`` periods past the shallow probe, for copy ``c`` (old events: None)."""

    fixed: int | None = None  # an old allocation, always
    slot: int = -1
    offset: int = -1
    form: str = ""  # "same": c + d, "reverse": k - 1 - c + d, "first": d, "last": k - 1 + d
    d: int = 0
    #: the old allocations in the place of copies before the first (by how far before) and after the last
    below: tuple[tuple[int, int], ...] = ()
    above: tuple[tuple[int, int], ...] = ()

    def index(self, c: int | None, k: int) -> int:
        if self.form == "same":
            assert c is not None
            return c + self.d
        if self.form == "reverse":
            assert c is not None
            return k - 1 - c + self.d
        if self.form == "first":
            return self.d
        return k - 1 + self.d

    def target(self, c: int | None, k: int) -> Where | None:
        if self.fixed is not None:
            return ("old", self.fixed)
        idx = self.index(c, k)
        if idx < 0:
            old = dict(self.below).get(-idx)
        elif idx >= k:
            old = dict(self.above).get(idx - k + 1)
        else:
            return ("new", self.slot, idx, self.offset)
        return None if old is None else ("old", old)

    def fit(self, observations: list[tuple[int, int | None, Where]]) -> _Rule | None:
        """This rule with its fallbacks learned from ``observations`` ``(k, c, where)``, or None if one disagrees."""
        below, above = dict(self.below), dict(self.above)
        for k, c, seen in observations:
            if self.fixed is not None:
                if seen != ("old", self.fixed):
                    return None
                continue
            idx = self.index(c, k)
            if 0 <= idx < k:
                if seen != ("new", self.slot, idx, self.offset):
                    return None
                continue
            if seen[0] != "old":
                return None
            side, far = (below, -idx) if idx < 0 else (above, idx - k + 1)
            if side.setdefault(far, seen[1]) != seen[1]:
                return None
        return replace(self, below=tuple(sorted(below.items())), above=tuple(sorted(above.items())))


def _rules(observations: list[tuple[int, int | None, Where]], old: bool) -> list[_Rule]:
    """Every rule of the family that agrees with ``observations``."""
    candidates: list[_Rule] = []
    news = {(w[1], w[3]) for _, _, w in observations if w[0] == "new"}
    olds = {w[1] for _, _, w in observations if w[0] == "old"}
    if old and not news and len(olds) == 1:
        candidates.append(_Rule(fixed=next(iter(olds))))
    if len(news) == 1:
        slot, offset = next(iter(news))
        forms = ("first", "last") if old else ("same", "reverse")
        candidates.extend(_Rule(slot=slot, offset=offset, form=f, d=d) for f in forms for d in OFFSETS)
    return [r for r in (c.fit(observations) for c in candidates) if r is not None]


# -- 3. the stream at depth k -----------------------------------------------------------------------------------------


@dataclass
class DepthTemplate:
    """The three probes' streams as a template: the shallow stream, its slots, the rule of every free."""

    shallow: _Stream
    slots: list[_Slot]
    bodies: list[list[int]]  # per slot: the second stream's event indices of its body
    second: _Stream
    old_sizes: list[int]  # per shallow event: the bytes added per period (0 for most)
    old_rules: dict[int, list[_Rule]]
    new_rules: dict[tuple[int, int], list[_Rule]]

    def stream(self, k: int) -> list[Event]:
        """The events ``k`` periods past the shallow probe (fresh ids: the event's index, as the tracker numbers
        them). Raises :class:`NotExtensible` where the rules disagree or a free would release nothing alive."""
        if k < 0:
            raise ValueError("k must be >= 0")
        a, b = self.shallow, self.second
        out: list[Event] = []
        ids: dict[Where, int] = {}
        live: set[int] = set()
        at: dict[int, list[int]] = {}
        for s, slot in enumerate(self.slots):
            at.setdefault(slot.at, []).append(s)

        def emit(where: Where, event: Event, rules: list[_Rule], c: int | None) -> None:
            kind = event[0]
            if kind == "alloc":
                ident = len(out)
                ids[where] = ident
                live.add(ident)
                size = int(event[2]) + (k * self.old_sizes[where[1]] if where[0] == "old" else 0)
                out.append(("alloc", ident, size, *event[3:]))
            elif kind == "free":
                targets = {r.target(c, k) for r in rules}
                if len(targets) != 1 or None in targets:
                    raise NotExtensible(f"event {len(out)}: which allocation a free releases is ambiguous at depth")
                (target,) = targets
                assert target is not None
                ident = ids.get(target, -1)
                if ident not in live:
                    raise NotExtensible(f"event {len(out)}: a free of an allocation that is not alive at depth")
                live.discard(ident)
                out.append(("free", ident, *event[2:]))
            else:
                out.append(tuple(event))

        for i in range(len(a) + 1):
            for s in at.get(i, []):
                body = self.bodies[s]
                for copy in range(k):
                    for o, n in enumerate(body):
                        emit(("new", s, copy, o), b.events[n], self.new_rules.get((s, o), []), copy)
            if i < len(a):
                emit(("old", i), a.events[i], self.old_rules.get(i, []), None)
        return out


@dataclass
class _Fit:
    slots: list[_Slot]
    t: _Template
    old_rules: dict[int, list[_Rule]]
    new_rules: dict[tuple[int, int], list[_Rule]]
    #: the frees no rule fits: ("old", shallow index) or ("new", slot, offset), with the places they touch
    failures: list[tuple[Where, set[int]]]


Observations = tuple[tuple[int, int | None, Where], ...]


def _fit(
    a: _Stream, b: _Stream, c: _Stream, slots: list[_Slot], known: dict[tuple[bool, Observations], list[_Rule]]
) -> _Fit:
    """The rules of every free for these slots, and the frees no rule fits (with the shallow events and slots their
    observations touch: where moving a slot may help). ``known``: rules already worked out, by observations."""
    t = _Template.build(a, b, c, slots)
    where2, where3, pos2, pos3 = t.where2, t.where3, t.pos2, t.pos3
    old_rules: dict[int, list[_Rule]] = {}
    new_rules: dict[tuple[int, int], list[_Rule]] = {}
    failures: list[tuple[Where, set[int]]] = []

    def rules(obs: Observations, old: bool) -> list[_Rule]:
        key = (old, obs)
        found = known.get(key)
        if found is None:
            found = known[key] = _rules(list(obs), old)
        return found

    def touched(obs: Observations) -> set[int]:
        return {w[1] if w[0] == "old" else -1 - w[1] for _, _, w in obs}  # shallow index, or -1 - slot

    at, bt, ct = a.targets, b.targets, c.targets
    for i, kind in enumerate(a.kinds):
        if kind != "free":
            continue
        obs: Observations = ((0, None, ("old", at[i])), (1, None, where2[bt[pos2[i]]]), (2, None, where3[ct[pos3[i]]]))
        found = rules(obs, True)
        if found:
            old_rules[i] = found
        else:
            failures.append((("old", i), touched(obs) | {i}))
    for s, slot in enumerate(slots):
        n = slot.length
        for o in range(n):
            if b.kinds[slot.start2 + o] != "free":
                continue
            obs = (
                (1, 0, where2[bt[slot.start2 + o]]),
                (2, 0, where3[ct[slot.start3 + o]]),
                (2, 1, where3[ct[slot.start3 + n + o]]),
            )
            found = rules(obs, False)
            if found:
                new_rules[(s, o)] = found
            else:
                failures.append((("new", s, o), touched(obs) | {-1 - s}))
    return _Fit(slots, t, old_rules, new_rules, failures)


def _search(aligner: _Aligner, slots: list[_Slot]) -> _Fit:
    """Move slots back by whole bodies until every free follows a rule.

    The alignment opens every slot at the latest place, so its copies are the last of its run of blocks: the top
    layers in a forward window, the bottom ones in a backward window. A free of the backward window that releases
    what a forward copy saved then has no partner at a copy distance of one. Moving a slot back by whole bodies
    does not change the stream, only which of the shallow stream's blocks are called copies; this tries, one slot
    at a time, the moves of the slots the unfitted frees touch, and keeps a move that leaves fewer of them."""
    a, b, c = aligner.a, aligner.b, aligner.c
    reach = aligner.reach(slots)
    shifts = [0] * len(slots)
    known: dict[tuple[bool, Observations], list[_Rule]] = {}
    best = _fit(a, b, c, slots, known)
    tried: set[tuple[int, ...]] = {tuple(shifts)}
    while best.failures:
        votes: dict[int, int] = {}
        for _, places in best.failures:
            near: set[int] = set()
            for place in places:
                if place < 0:
                    near.add(-1 - place)
                else:
                    near.update(s for s, slot in enumerate(best.slots) if _near(slot, place, reach[s]))
            for s in near:
                votes[s] = votes.get(s, 0) + 1
        improved = None
        for s in sorted(votes, key=lambda s: (-votes[s], s)):  # the slot most unfitted frees touch first
            for blocks in range(reach[s] + 1):
                trial = list(shifts)
                trial[s] = blocks
                if tuple(trial) in tried:
                    continue
                tried.add(tuple(trial))
                fit = _fit(a, b, c, aligner.moved(slots, trial), known)
                if len(fit.failures) < len(best.failures):
                    improved = (trial, fit)
                    break
            if improved is not None:
                break
        if improved is None:
            break
        shifts, best = improved
    return best


def _near(slot: _Slot, place: int, blocks: int) -> bool:
    """Whether shallow event ``place`` lies where moving ``slot`` changes which events are copies."""
    return slot.at - (blocks + 1) * slot.length <= place < slot.at + (blocks + 1) * slot.length


def template(shallow: Sequence[Event], second: Sequence[Event], third: Sequence[Event]) -> DepthTemplate:
    """The template of three probes' streams one period apart (see the module docstring); raises
    :class:`NotExtensible` when they do not fit the pattern."""
    a, b, c = _Stream.parse(shallow), _Stream.parse(second), _Stream.parse(third)
    aligner = _Aligner(a, b, c)
    fit = _search(aligner, aligner.solve())
    if fit.failures:
        where = fit.failures[0][0]
        what = f"event {where[1]} of the shallowest probe" if where[0] == "old" else "a free repeated per period"
        raise NotExtensible(f"{what}: its free follows no rule of the depth pattern ({len(fit.failures)} such frees)")
    slots, t = fit.slots, fit.t
    old_sizes = [0] * len(a)
    for i in range(len(a)):
        if a.kinds[i] == "alloc":
            old_sizes[i] = b.sizes[t.pos2[i]] - a.sizes[i]
    bodies = [list(range(slot.start2, slot.start2 + slot.length)) for slot in slots]
    out = DepthTemplate(a, slots, bodies, b, old_sizes, fit.old_rules, fit.new_rules)
    for k, probe in enumerate((shallow, second, third)):
        if canonical(out.stream(k)) != canonical(probe):
            raise NotExtensible(f"the template does not give back probe {k + 1}'s stream")
    return out


def _second_positions(length: int, slots: Sequence[_Slot]) -> list[int]:
    """Where each event of a shallow stream of ``length`` events is in the second probe's (as
    :meth:`_Template.build` places it)."""
    at: dict[int, int] = {}
    for slot in slots:
        at[slot.at] = at.get(slot.at, 0) + slot.length
    out: list[int] = []
    g = 0
    for i in range(length):
        g += at.get(i, 0)
        out.append(i + g)
    return out


def retarget(pattern: DepthTemplate, shallow: Sequence[Event], second: Sequence[Event]) -> DepthTemplate:
    """``pattern`` (learned from three probes) over the two shallower probes of another step of the same structure
    (another microbatch of the same regime): its slots, bodies and reference rules, which name events by their
    place, with the sizes of ``shallow`` and ``second``. The two streams must be, event by event, those the pattern
    was learned from apart from sizes (the same kinds, streams, phase windows, and each free releasing the
    allocation at the same place), and an event of the shallow stream must grow with the depth here exactly where
    it grew there; else :class:`NotExtensible`. The alignment placed the pattern's slots by comparing sizes: where
    blocks of equal sizes made a slot's place ambiguous (any of them gives those three probes), another step whose
    sizes tell those blocks apart pairs a shallow event with a second-probe event of another size, which then seems
    to grow with the depth; such a step is refused (its third probe is traced). What this
    does not see is a third probe of this step: that deeper stacks repeat the same blocks was seen on the step the
    pattern comes from, and its sizes here follow from the two probes as :func:`template`'s do. (That the result
    gives back the two probes, checked last, holds by construction once the rest does: a guard against a bug.)"""
    a, b = _Stream.parse(shallow), _Stream.parse(second)
    if (a.sigs, a.targets, b.sigs, b.targets) != (
        pattern.shallow.sigs,
        pattern.shallow.targets,
        pattern.second.sigs,
        pattern.second.targets,
    ):
        raise NotExtensible("the probes' streams differ in structure from those the depth pattern was learned from")
    pos2 = _second_positions(len(a), pattern.slots)
    old_sizes = [b.sizes[pos2[i]] - a.sizes[i] if a.kinds[i] == "alloc" else 0 for i in range(len(a))]
    for i, (was, now) in enumerate(zip(pattern.old_sizes, old_sizes, strict=True)):
        if (was == 0) != (now == 0):
            raise NotExtensible(
                f"event {i} of the shallowest probe {'grows' if now else 'stays'} with the depth here but "
                f"{'grew' if was else 'stayed'} where the depth pattern was learned: its layer blocks may repeat "
                "elsewhere here"
            )
    out = replace(pattern, shallow=a, second=b, old_sizes=old_sizes)
    for k, probe in enumerate((shallow, second)):
        if canonical(out.stream(k)) != canonical(probe):
            raise NotExtensible(f"the depth pattern does not give back probe {k + 1}'s stream")
    return out


def extend_stream(streams: Mapping[int, Sequence[Event]], layers: int) -> list[Event]:
    """The event stream of ``layers`` decoder layers from three probes' streams ``{n: events}`` (depths ``n``,
    ``n + p``, ``n + 2p``; ``layers - n`` a multiple of ``p``). Raises :class:`NotExtensible`."""
    depths = sorted(streams)
    if len(depths) != 3 or depths[2] - depths[1] != depths[1] - depths[0] or depths[1] <= depths[0]:
        raise ValueError(f"three probes one period apart are needed, not {depths}")
    n1, n2, _ = depths
    period = n2 - n1
    steps, rest = divmod(layers - n1, period)
    if rest or steps < 0:
        raise ValueError(f"{layers} layers is not {n1} plus whole periods of {period}")
    return template(*(streams[n] for n in depths)).stream(steps)


__all__ = ["DepthTemplate", "NotExtensible", "canonical", "extend_stream", "retarget", "template"]
