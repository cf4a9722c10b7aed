"""Several GPUs: the `parallelism` section, LS060 and the VALIDATED rule for ``gpu_count > 1`` (spec).

Spec: LS060 (error when measured, else warning): ``gpu_count > 1`` without placements and one
``per_rank_peak`` per rank; a single summed "total" across GPUs. VALIDATED with ``gpu_count > 1`` needs one
MEASURED ``per_rank_peak`` per rank. Documents are dicts loaded as JSON text (JSON is YAML).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ledgerspec.checks.findings import ERROR, WARNING
from ledgerspec.checks.validate import validate
from ledgerspec.contract.document import from_text
from tests.support.ledgers import validated

PLACED = {"parameter_placement": "sharded", "gradient_placement": "sharded", "optimizer_placement": "sharded"}


def measured(value: Any) -> dict[str, Any]:
    return {"value": value, "source": "MEASURED"}


def multi(
    gpus: int, per_rank: Any = None, placements: dict[str, str] | None = None, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    d: dict[str, Any] = copy.deepcopy(base) if base is not None else {"ledgerspec": "ledger/v1"}
    section: dict[str, Any] = {"gpu_count": gpus, "strategy": "fsdp2", **(PLACED if placements is None else placements)}
    if per_rank is not None:
        section["per_rank_peak"] = per_rank
    d["parallelism"] = section
    return d


def ls060(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    report = validate(from_text(json.dumps(d), "<case>"))
    return [(f.severity, f.pointer, f.message) for f in report.findings if f.rule == "LS060"]


def status(d: dict[str, Any]) -> tuple[str | None, list[str]]:
    report = validate(from_text(json.dumps(d), "<case>"))
    return report.supported_status, list(report.reasons)


# -- LS060 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "per_rank"),
    [
        (1, None),
        (2, [{"value": "20GiB", "source": "CALCULATED", "method": "shard"}] * 2),
        (3, [{"value": "20GiB", "source": "CALCULATED", "method": "shard"}] * 3),
    ],
    ids=["one-gpu", "two-ranks-two-figures", "three-ranks-three-figures"],
)
def test_ls060_quiet(gpus: int, per_rank: Any) -> None:
    assert ls060(multi(gpus, per_rank)) == []


def test_ls060_quiet_without_a_gpu_count() -> None:
    assert ls060({"ledgerspec": "ledger/v1", "parallelism": {"gpu_count": "UNKNOWN"}}) == []


@pytest.mark.parametrize("missing", ["parameter_placement", "gradient_placement", "optimizer_placement"])
def test_ls060_names_each_missing_placement(missing: str) -> None:
    placements = {k: v for k, v in PLACED.items() if k != missing}
    hits = ls060(multi(2, [measured("1GiB")] * 2, placements))
    assert len(hits) == 1
    severity, pointer, message = hits[0]
    assert (severity, pointer) == (WARNING, "/parallelism/gpu_count")
    assert f"parallelism.{missing}" in message
    assert all(f"parallelism.{k}" not in message for k in PLACED if k != missing)


def test_ls060_placement_unknown_counts_as_missing() -> None:
    hits = ls060(multi(2, [measured("1GiB")] * 2, {**PLACED, "optimizer_placement": "UNKNOWN"}))
    assert [h[1] for h in hits] == ["/parallelism/gpu_count"] and "optimizer_placement" in hits[0][2]


@pytest.mark.parametrize(
    ("per_rank", "fragment"),
    [
        (None, "without parallelism.per_rank_peak"),
        ([measured("40GiB")], "1 figures for 2 ranks"),
        ([measured("40GiB")] * 3, "3 figures for 2 ranks"),
        (measured("80GiB"), "single figure"),
        ("80GB", "single figure"),
    ],
    ids=["missing", "too-few", "too-many", "summed-long-form", "summed-plain"],
)
def test_ls060_per_rank_peak_shape(per_rank: Any, fragment: str) -> None:
    hits = ls060(multi(2, per_rank))
    assert len(hits) == 1 and fragment in hits[0][2], hits


def test_ls060_is_a_warning_before_and_an_error_once_measured() -> None:
    before = multi(2, [measured("40GiB")])
    assert [h[0] for h in ls060(before)] == [WARNING]
    after = copy.deepcopy(before)
    after["software"] = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "cuda": "12.8"}
    after["metrics"] = {"peak_allocated": measured("40GiB")}
    after["measurement"] = {"device": "cuda"}
    assert [h[0] for h in ls060(after)] == [ERROR]


def test_ls060_flags_metrics_peak_that_is_the_sum_of_ranks() -> None:
    d = multi(2, [measured("40GiB"), measured("41GiB")])
    d["metrics"] = {"peak_allocated": measured("81GiB")}  # "81 GB on 2 GPUs": the sum, not the worst rank
    assert ls060(d)


def test_per_rank_items_without_source_are_ls004() -> None:
    report = validate(from_text(json.dumps(multi(2, ["40GiB", "41GiB"])), "<case>"))
    pointers = {f.pointer for f in report.findings if f.rule == "LS004"}
    assert pointers == {"/parallelism/per_rank_peak/0", "/parallelism/per_rank_peak/1"}


def test_x_per_rank_extension_is_accepted() -> None:
    d = multi(2, None)
    d["parallelism"]["x-per-rank"] = {
        "world_size": 2,
        "ranks": [{"rank": 0, "adapter": {"value": 100, "source": "CALCULATED", "method": "shard"}}],
    }
    report = validate(from_text(json.dumps(d), "<case>"))
    assert not [f for f in report.findings if "x-per-rank" in f.pointer]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two"])
def test_gpu_count_must_be_a_positive_integer(bad: Any) -> None:
    report = validate(from_text(json.dumps(multi(2, None) | {"parallelism": {"gpu_count": bad}}), "<case>"))
    assert any(f.rule == "schema" and f.pointer.startswith("/parallelism/gpu_count") for f in report.findings)


# -- VALIDATED with several GPUs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "per_rank", "expected"),
    [
        (3, [measured("15GiB"), measured("15GiB"), measured("14GiB")], "VALIDATED"),
        (3, [measured("15GiB"), measured("15GiB")], "CANDIDATE"),
        (2, [measured("15GiB"), measured("15GiB"), measured("14GiB")], "CANDIDATE"),
        (2, [measured("15GiB"), {"value": "15GiB", "source": "CALCULATED", "method": "shard"}], "CANDIDATE"),
        (2, [measured("15GiB"), {"value": "15GiB", "source": "ASSUMPTION", "note": "same as rank 0"}], "CANDIDATE"),
        (2, measured("30GiB"), "CANDIDATE"),
        (2, None, "CANDIDATE"),
    ],
    ids=["3-of-3", "2-of-3", "3-for-2", "one-calculated", "one-assumed", "summed", "missing"],
)
def test_validated_needs_one_measured_peak_per_rank(gpus: int, per_rank: Any, expected: str) -> None:
    got, reasons = status(multi(gpus, per_rank, base=validated()))
    assert got == expected, reasons
    if expected != "VALIDATED":
        assert any("per_rank_peak" in r for r in reasons), reasons


def test_single_gpu_validates_without_per_rank_peaks() -> None:
    assert status(multi(1, None, base=validated()))[0] == "VALIDATED"
