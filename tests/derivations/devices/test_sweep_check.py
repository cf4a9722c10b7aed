"""``estimate --sweep`` and ``--what-if`` decided on the device (issue 23,
:mod:`ledgerspec.derivations.devices.sweep_check`): the configurations whose allocated peak fits are replayed, best
first, through the allocator model with what lies outside the allocator, until one fits on the device.

The device is built as in test_fit_check.py: its memory lies between the allocated peaks of microbatch 3 and 4, and
the bytes declared outside the allocator leave the allocator more than microbatch 3's tensors but less than it
reserves (then: less than its tensors, so that it is ruled out without a replay). Each
configuration's verdict is the plain ``estimate --device-memory`` of that configuration's ledger
(tests/derivations/devices/test_prediction.py checks that verdict against hand-followed allocator streams).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import from_text, load
from ledgerspec.contract.units import format_size
from tests.support import CliRunner

GiB = 2**30


def _checked(point: dict[str, Any], fits: bool, peak: float, total: float, **kw: Any) -> Any:
    from ledgerspec.derivations.devices.fit_check import Checked

    return Checked(point, fits, int(peak * GiB), int((total - peak) * GiB), kw.pop("by", "none"), **kw)


def test_the_lines_name_each_configuration_checked_and_the_answer_on_the_device() -> None:
    from ledgerspec.derivations.devices.sweep_check import ConfigurationsOnDevice

    over = {"microbatch": 8, "gradient_checkpointing": True}
    under = {"microbatch": 4, "gradient_checkpointing": False}
    result = ConfigurationsOnDevice(
        24 * GiB,
        over,
        under,
        [
            _checked(over, False, 25, 23.5, by="fragmentation", setting="expandable_segments:True"),
            _checked(under, True, 20, 23.5),
        ],
    )
    first, second, answer, instead = result.lines()
    assert first == (
        "on the device: microbatch=8, gradient_checkpointing=on does NOT fit (fragmentation decides), device peak "
        "25.00 GiB of 23.50 GiB (its CUDA total; 24.00 GiB declared), 1.50 GiB over; with "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits"
    )
    assert second == (
        "on the device: microbatch=4, gradient_checkpointing=off fits, device peak 20.00 GiB of 23.50 GiB, "
        "margin 3.50 GiB"
    )
    assert answer == (
        "largest configuration that fits on the device: microbatch=4, gradient_checkpointing=off "
        "(device peak 20.00 GiB)"
    )
    assert instead == (
        "  with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: microbatch=8, gradient_checkpointing=on fits instead "
        "(above)"
    )
    block = result.to_extension()
    assert block["largest"] == under
    assert [c["fits"] for c in block["checked"]] == [False, True]
    assert block["checked"][0]["fits_with"] == "expandable_segments:True"


def test_an_answer_at_the_edge_and_none_that_fits_are_said() -> None:
    from ledgerspec.derivations.devices.sweep_check import ConfigurationsOnDevice

    point, lower = {"microbatch": 2}, {"microbatch": 1}
    edge = ConfigurationsOnDevice(
        80 * GiB,
        point,
        lower,
        [_checked(point, False, 79, 79.25, uncertain=True), _checked(lower, True, 60, 79.25)],
    )
    assert edge.lines()[-3] == (
        "on the device: microbatch=2 does NOT fit, AT THE EDGE (it completes with the typical bytes outside the "
        "allocator, not with the high end of the catalogue's range), device peak 79.00 GiB of 79.25 GiB (its CUDA "
        "total; 80.00 GiB declared), margin 256.00 MiB"
    )
    assert edge.lines()[-1] == "largest configuration that fits on the device: microbatch=1 (device peak 60.00 GiB)"
    assert edge.to_extension()["checked"][0]["uncertain"] is True
    none = ConfigurationsOnDevice(
        80 * GiB, point, None, [_checked({"microbatch": b}, False, 90, 80) for b in (6, 5, 4, 3, 2)], left=1
    )
    assert none.lines()[-1] == (
        "no configuration checked fits on the device (5 replayed; 1 more whose allocated tensors fit not checked: "
        "narrow the sweep to them, or `--fit microbatch` searches below on the device)"
    )
    assert none.to_extension()["largest"] is None and none.to_extension()["not_checked"] == 1


def test_the_check_follows_the_tables_order_and_stops_at_the_first_that_fits(monkeypatch: Any) -> None:
    """Best first as the table names its answer (most tokens, then checkpointing off, then the lower peak), never a
    configuration whose allocated tensors do not fit, at most TRIES, with ``from_flag`` handed to the verdict."""
    from ledgerspec.derivations.devices import prediction, sweep_check
    from ledgerspec.derivations.estimate.sweep import describe
    from tests.support.predictions import fake_prediction

    asked: list[tuple[str, bool]] = []
    fitting = {"microbatch=2, max_length=64"}

    def fake(doc: Any, memory: int, from_flag: bool = False, **_: Any) -> tuple[None, Any]:
        read = {k: doc.get("workload", k).integer() for k in ("microbatch", "max_length")}
        point = f"microbatch={read['microbatch']}, max_length={read['max_length']}"
        asked.append((point, from_flag))
        return None, fake_prediction(point in fitting)

    monkeypatch.setattr(prediction, "estimate_on_device", fake)
    from tests.support.estimate_docs import ledger_text

    doc = from_text(ledger_text(), "t.ledger.yaml")
    rows = [
        ({"microbatch": 1, "max_length": 64}, 10 * GiB),
        ({"microbatch": 2, "max_length": 64}, 20 * GiB),
        ({"microbatch": 1, "max_length": 128}, 19 * GiB),  # as many tokens as 2 x 64, a lower peak: checked first
        ({"microbatch": 4, "max_length": 128}, 200 * GiB),  # its allocated tensors do not fit: never checked
    ]
    result = sweep_check.check_configurations(doc, rows, 100 * GiB, from_flag=True)
    assert asked == [("microbatch=1, max_length=128", True), ("microbatch=2, max_length=64", True)]
    assert describe(result.best or {}) == "microbatch=2, max_length=64" and result.left == 0
    asked.clear()
    fitting.clear()
    many = [({"microbatch": b, "max_length": 64}, b * GiB) for b in range(1, 9)]
    result = sweep_check.check_configurations(doc, many, 100 * GiB)
    assert [a for a, _ in asked] == [f"microbatch={b}, max_length=64" for b in (8, 7, 6, 5, 4)]
    assert result.best is None and result.left == 3 and not any(flag for _, flag in asked)


def test_a_configuration_whose_tensors_exceed_what_the_allocator_can_get_is_not_replayed(monkeypatch: Any) -> None:
    """The allocator can get the device's CUDA total less what lies outside it (known without a trace): a
    configuration whose allocated peak is above that cannot fit, and is said so without a replay."""
    from ledgerspec.derivations.devices import prediction, sweep_check
    from ledgerspec.derivations.devices.outside import estimate, stack_of
    from tests.support.estimate_docs import ledger_text

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("replayed")

    monkeypatch.setattr(prediction, "estimate_on_device", refuse)
    doc = from_text(ledger_text(), "t.ledger.yaml")
    outside = estimate(stack_of(doc)).typical  # an unnamed device of 2 GiB: the catalogue's figure for an unknown GPU
    above = int((2 * GiB - outside) * 1.01)  # over what the allocator can get by more than a model's tolerance
    rows = [({"microbatch": b}, peak) for b, peak in ((1, above), (2, 2 * GiB))]
    result = sweep_check.check_configurations(doc, rows, 2 * GiB)
    assert result.best is None and [p for p, *_ in result.beyond] == [{"microbatch": 2}, {"microbatch": 1}]
    first, last = result.lines()
    assert first == (
        "on the device: does NOT fit, not replayed (their allocated tensors alone exceed what the allocator can get, "
        f"{format_size(2 * GiB - outside)} (2.00 GiB less {format_size(outside)} outside it)): "
        f"microbatch=2 (2.00 GiB); microbatch=1 ({format_size(above)})"
    )
    assert last == "no configuration checked fits on the device (2 ruled out without a replay)"
    small = sweep_check.check_configurations(doc, [({"microbatch": 1}, 2**20)], 2**20)
    assert f"(what lies outside the allocator, {format_size(outside)}, fills the device's 1.00 MiB)" in small.lines()[0]


def test_a_modelled_peak_within_its_tolerance_of_what_the_allocator_can_get_is_replayed(monkeypatch: Any) -> None:
    """A table's peak may come from the microbatch model (within 0.5 % of full traces): one above what the allocator
    can get by less than that is replayed, not ruled out."""
    from ledgerspec.derivations.devices import prediction, sweep_check
    from ledgerspec.derivations.devices.outside import estimate, stack_of
    from tests.support.estimate_docs import ledger_text
    from tests.support.predictions import fake_prediction

    replayed: list[int] = []

    def verdict(doc: Any, *_: Any, **__: Any) -> Any:
        replayed.append(doc.get("workload", "microbatch").integer())
        return None, fake_prediction(False, 3 * GiB, -GiB, capacity=GiB)

    monkeypatch.setattr(prediction, "estimate_on_device", verdict)
    doc = from_text(ledger_text(), "t.ledger.yaml")
    capacity = 2 * GiB - estimate(stack_of(doc)).typical
    rows = [({"microbatch": 1}, int(capacity * 1.004)), ({"microbatch": 2}, int(capacity * 1.006))]
    result = sweep_check.check_configurations(doc, rows, 2 * GiB)
    assert replayed == [1] and [p for p, *_ in result.beyond] == [{"microbatch": 2}]


@pytest.mark.slow  # traces the tiny model about ten times
def test_the_sweeps_answer_steps_down_to_what_fits_on_the_device(
    tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from ledgerspec.derivations.devices import prediction
    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.estimate.sweep import apply
    from tests.support.estimate_docs import between_3_and_4

    # the tiny step (a device of about 12 MiB) is smaller than the 20 MiB segment the cuBLAS workspaces would take:
    # the answer's stepping is checked without them (tests/derivations/allocator/test_workspaces.py checks them)
    monkeypatch.setattr(prediction, "workspaces_of", lambda doc, target: ((), ()))

    base, doc, allocated, memory = between_3_and_4(tmp_path)
    reserved3 = estimate_on_device(apply(doc, {"microbatch": 3}), memory)[1].replayed.free_peak_reserved
    # the allocator can get more than microbatch 3's tensors, less than it reserves: replayed, and it runs out
    outside = memory - (allocated[3] + reserved3) // 2
    path = tmp_path / "t.ledger.yaml"
    path.write_text(
        base + f"outside_allocator:\n  total: {{value: {outside}, source: ASSUMPTION, note: test}}\n", encoding="utf-8"
    )
    declared = load(path)
    want = {b: estimate_on_device(apply(declared, {"microbatch": b}), memory, True)[1] for b in (2, 3)}
    assert want[2].fits and not want[3].fits  # the device as built

    code, out, err = cli("estimate", path, "--sweep", "microbatch=1,2,3,4", "--device-memory", str(memory))
    assert code == 0, err
    assert "largest configuration whose allocated tensors fit" in out and ": microbatch=3 (predicted peak" in out
    assert "on the device: microbatch=3 does NOT fit" in out and "on the device: microbatch=2 fits" in out
    assert "on the device: microbatch=1" not in out  # the check stops at the first that fits
    assert "largest configuration that fits on the device: microbatch=2 (device peak" in out
    assert f"device peak {format_size(want[2].device_peak)}" in out
    assert "(allocated tensors only: the CUDA context" not in out  # the table's answer is named for what it counts

    code, out, _ = cli("estimate", path, "--sweep", "microbatch=3,4", "--device-memory", str(memory))
    assert code == 1  # the allocated tensors of microbatch 3 fit, the device does not: as an estimate that does not fit
    assert "no configuration checked fits on the device (1 replayed)" in out

    capacity = int(allocated[3] / 1.01)  # below microbatch 3's tensors by more than a modelled peak's tolerance
    path.write_text(base + f"outside_allocator:\n  total: {{value: {memory - capacity}, source: ASSUMPTION}}\n")
    assert want[2].peak_reserved < capacity  # microbatch 2 still fits there
    code, out, _ = cli("estimate", path, "--sweep", "microbatch=1,2,3,4", "--device-memory", str(memory))
    assert code == 0 and "on the device: does NOT fit, not replayed (their allocated tensors alone exceed" in out
    assert f"): microbatch=3 ({format_size(allocated[3])})" in out and "on the device: microbatch=3" not in out
    assert "largest configuration that fits on the device: microbatch=2" in out

    code, out, _ = cli(
        "estimate", path, "--sweep", "microbatch=1,2,3,4", "--device-memory", str(memory), "--target", "cpu"
    )
    assert code == 0 and "on the device" not in out and "largest configuration that fits" in out
