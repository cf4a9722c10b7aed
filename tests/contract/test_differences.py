"""The table of known stack differences (docs: "The step users run", "Declared stack") and how a declared version
is placed on one side of each: pure contract, no torch."""

from __future__ import annotations

import pytest

from ledgerspec.contract.differences import BY_ID, KNOWN, NEWER, OLDER, stack_differences, version_tuple
from ledgerspec.contract.document import from_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.43.2", (0, 43, 2)),
        ("4.48", (4, 48, 0)),
        ("5", (5, 0, 0)),
        ("5.0.0rc1", (5, 0, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("v0.42.0", (0, 42, 0)),
        ("1.2.3.4", (1, 2, 3, 4)),
        ("latest", None),
        ("", None),
    ],
)
def test_version_tuple_reads_the_leading_release_numbers(text: str, expected: tuple[int, ...] | None) -> None:
    assert version_tuple(text) == expected


@pytest.mark.parametrize(
    ("difference", "version", "side"),
    [
        ("bitsandbytes-4bit-matmul-input", "0.42.0", OLDER),
        ("bitsandbytes-4bit-matmul-input", "0.43.1", OLDER),
        ("bitsandbytes-4bit-matmul-input", "0.43.2", NEWER),  # PR #1270 landed in 0.43.2
        ("bitsandbytes-4bit-matmul-input", "0.50.2", NEWER),
        ("transformers-moe-fused-experts", "4.48", OLDER),
        ("transformers-moe-fused-experts", "4.57.1", OLDER),
        ("transformers-moe-fused-experts", "5.0.0rc1", NEWER),
        ("transformers-moe-fused-experts", "main", None),
        # a window: 4.38 and 4.39 built the explicit causal mask, 4.37 and 4.40 did not (transformers#30010)
        ("transformers-sdpa-explicit-causal-mask", "4.37.2", NEWER),
        ("transformers-sdpa-explicit-causal-mask", "4.38.0", OLDER),
        ("transformers-sdpa-explicit-causal-mask", "4.39.3", OLDER),
        ("transformers-sdpa-explicit-causal-mask", "4.40.0", NEWER),
        ("transformers-sdpa-explicit-causal-mask", "5.25.0", NEWER),
        ("transformers-sdpa-explicit-causal-mask", "main", None),
    ],
)
def test_each_version_falls_on_one_side(difference: str, version: str, side: str | None) -> None:
    assert BY_ID[difference].side(version) == side


def test_every_known_difference_names_an_upstream_source_and_a_version() -> None:
    for d in KNOWN:
        assert d.sources and all(s for s in d.sources)
        assert version_tuple(d.changed_in) is not None
        if d.introduced_in is not None:  # a window opens (at a version that reads) before it closes
            start, end = version_tuple(d.introduced_in), version_tuple(d.changed_in)
            assert start is not None and end is not None and start < end
        assert d.older != d.newer


def _doc(declared: str, entry: str, accepted: str = "") -> str:
    return (
        "ledgerspec: ledger/v1\n"
        f"software:\n  transformers: '{declared}'\n{accepted}"
        "x-resolve:\n  differences:\n"
        f"    transformers-moe-fused-experts: {entry}\n"
    )


def test_a_difference_carries_its_size_and_names_both_sides() -> None:
    doc = from_text(_doc("4.48", "{computed_as: newer, bytes: -66923511808}"))
    [diff] = stack_differences(doc, ())
    assert (diff.record, diff.declared, diff.computed_as, diff.bytes, diff.accepted) == (
        "x-resolve",
        "4.48",
        NEWER,
        -66923511808,
        False,
    )
    message = diff.message()
    assert "transformers >= 5.0.0" in message and "declares 4.48" in message and "-62.33 GiB" in message


@pytest.mark.parametrize(
    "entry",
    [
        "{computed_as: sideways}",  # not a side
        "[newer]",  # not a mapping
        "{computed_as: older}",  # the declared version is on the computed side
    ],
)
def test_unreadable_or_agreeing_records_are_not_differences(entry: str) -> None:
    assert stack_differences(from_text(_doc("4.48", entry)), ()) == []


def test_an_unknown_id_or_an_undeclared_package_is_not_a_difference() -> None:
    text = (
        "ledgerspec: ledger/v1\nx-estimate:\n  differences:\n    transformers-moe-fused-experts: {computed_as: newer}\n"
    )
    text = text.replace("x-estimate", "x-resolve")
    assert stack_differences(from_text(text), ()) == []
    text = _doc("4.48", "{computed_as: newer}").replace("transformers-moe-fused-experts:", "no-such-difference:")
    assert stack_differences(from_text(text), ()) == []


def test_a_non_integer_size_is_dropped_not_trusted() -> None:
    [diff] = stack_differences(from_text(_doc("4.48", "{computed_as: newer, bytes: true}")), ())
    assert diff.bytes is None


def test_accepted_ids_are_marked() -> None:
    [diff] = stack_differences(from_text(_doc("4.48", "{computed_as: newer}")), ("transformers-moe-fused-experts",))
    assert diff.accepted


def test_a_window_names_its_versions_on_both_sides() -> None:
    text = (
        "ledgerspec: ledger/v1\nsoftware:\n  transformers: '4.39.1'\n"
        "x-estimate:\n  differences:\n    transformers-sdpa-explicit-causal-mask: {computed_as: newer}\n"
    )
    [diff] = stack_differences(from_text(text), ())
    message = diff.message()
    assert "computed with transformers < 4.38.0 or >= 4.40.0" in message
    assert "declares 4.39.1: there Llama and Gemma models" in message and "memory-efficient kernel" in message
    assert "ledgerspec does not model 4.38.0 <= transformers < 4.40.0" in message
    assert stack_differences(from_text(text.replace("4.39.1", "4.40.0")), ()) == []
    assert stack_differences(from_text(text.replace("4.39.1", "4.37.2")), ()) == []
