"""A stream at another microbatch or length, from streams traced at others (allocator.affine).

The truth here is a toy step written out for any microbatch and length (fast): its streams at the values asked for
are compared with the synthesised ones event by event; what is not a polynomial (a size rounded to a power of two, a
structure that changes) is refused, never guessed. Real traces: ``tests/derivations/devices/test_along.py``.
"""

from __future__ import annotations

import pytest

from ledgerspec.derivations.allocator.affine import NotPolynomial, family, polynomial_figures
from ledgerspec.derivations.allocator.depth import canonical
from ledgerspec.derivations.allocator.replay import Event, replay


def toy(b: int, length: int = 64, scores: bool = False, pow2: bool = False, unpadded_one: bool = False) -> list[Event]:
    """A made-up step at microbatch ``b`` and ``length`` tokens: weights (fixed), hidden states ``b * L * 8`` per
    layer, eager attention scores ``b * L * L * 2`` (``scores``), a workspace rounded up to a power of two
    (``pow2``), and no mask for one row (``unpadded_one``: a batch of one row is not padded)."""
    events: list[Event] = [("phase", "0:frozen_params"), ("alloc", "w", 4096, 0), ("phase", "3:activations")]
    n = 0

    def alloc(size: int) -> str:
        nonlocal n
        n += 1
        events.append(("alloc", f"t{n}", size, 0))
        return f"t{n}"

    if not (unpadded_one and b == 1):
        mask = alloc(b * length)
    saved = []
    for _ in range(3):
        h = alloc(b * length * 8)
        if scores:
            s = alloc(b * length * length * 2)
            events.append(("free", s))
        if pow2:
            w = alloc(1 << (b * length - 1).bit_length())
            events.append(("free", w))
        saved.append(h)
    events.append(("phase", "4:temporary"))
    for h in reversed(saved):
        events.append(("free", h))
    if not (unpadded_one and b == 1):
        events.append(("free", mask))
    return events


@pytest.mark.parametrize("b", [1, 4, 5, 64])
def test_a_microbatch_from_two_others_is_its_stream(b: int) -> None:
    fam = family({2: toy(2), 3: toy(3), 7: toy(7)}, 1, "microbatch")
    assert fam.checked_at == (7,)
    assert canonical(fam.stream(b)) == canonical(toy(b))
    assert replay(fam.stream(b)).phases == replay(toy(b)).phases


def test_a_length_from_three_others_with_quadratic_scores() -> None:
    streams = {n: toy(2, n, scores=True) for n in (32, 64, 128, 256)}
    fam = family(streams, 2, "max_length")
    for n in (48, 96, 512, 1000):
        assert canonical(fam.stream(n)) == canonical(toy(2, n, scores=True))
    with pytest.raises(NotPolynomial, match="not on the degree-1 polynomial"):
        family(streams, 1, "max_length")  # a line cannot hold the scores: the fourth length says so


def test_a_size_rounded_to_a_power_of_two_is_refused_by_a_checking_point() -> None:
    with pytest.raises(NotPolynomial, match=r"event \d+ \(3:activations\)"):
        family({n: toy(2, n, pow2=True) for n in (32, 48, 64, 96)}, 2, "max_length")


def test_a_structure_that_changes_is_refused() -> None:
    with pytest.raises(NotPolynomial, match="differ in structure"):
        family({1: toy(1, unpadded_one=True), 2: toy(2, unpadded_one=True)}, 1, "microbatch")


def test_a_size_that_is_not_whole_bytes_is_refused() -> None:
    fam = family({2: [("alloc", 0, 10, 0)], 4: [("alloc", 0, 13, 0)]}, 1)
    assert fam.stream(6) == [("alloc", 0, 16, 0)]
    with pytest.raises(NotPolynomial, match="bytes at 3"):
        fam.stream(3)
    with pytest.raises(NotPolynomial, match="bytes at -10"):
        fam.stream(-10)


def test_figures_on_a_polynomial_and_off_it() -> None:
    figs = {2: {"a": 100, "b": 7}, 4: {"a": 180, "b": 7}, 8: {"a": 340, "b": 7}}
    assert polynomial_figures(figs, 16) == {"a": 660, "b": 7}
    with pytest.raises(NotPolynomial, match="figure a"):
        polynomial_figures({**figs, 8: {"a": 341, "b": 7}}, 16)
