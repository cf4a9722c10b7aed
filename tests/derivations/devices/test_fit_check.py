"""``estimate --fit`` decided on the device (issue 23, :mod:`ledgerspec.derivations.devices.fit_check`): the largest
value whose allocated peak fits is replayed through the allocator model with what lies outside the allocator, and
stepped down until one fits on the device.

The device is built so that the two answers differ: its memory lies between the allocated peaks of microbatch 3 and
4, and the bytes declared outside the allocator leave the allocator exactly what microbatch 2 reserves. Each value's
verdict is the plain ``estimate --device-memory`` of that microbatch's ledger (tests/derivations/devices/
test_prediction.py checks that verdict against hand-followed allocator streams).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ledgerspec.contract.document import from_text, load
from tests.support import CliRunner

pytest.importorskip("torch")


@pytest.mark.slow  # traces the tiny model a dozen times
def test_the_device_answer_steps_down_from_the_allocated_one(
    tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledgerspec.derivations.devices import prediction
    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.estimate.sweep import apply
    from tests.support.estimate_docs import between_3_and_4

    # the tiny step (a device of about 12 MiB) is smaller than the 20 MiB segment the cuBLAS workspaces would take:
    # the answer's stepping is checked without them (tests/derivations/allocator/test_workspaces.py checks them)
    monkeypatch.setattr(prediction, "workspaces_of", lambda doc, target: ((), ()))

    base, doc, _, memory = between_3_and_4(tmp_path)
    reserved2 = estimate_on_device(apply(doc, {"microbatch": 2}), memory)[1].replayed.free_peak_reserved
    outside = memory - reserved2  # the allocator can get exactly what microbatch 2 reserves
    path = tmp_path / "t.ledger.yaml"
    path.write_text(
        base + f"outside_allocator:\n  total: {{value: {outside}, source: ASSUMPTION, note: test}}\n", encoding="utf-8"
    )
    declared = load(path)
    want = {b: estimate_on_device(apply(declared, {"microbatch": b}), memory)[1] for b in (2, 3)}
    assert want[2].fits and not want[3].fits  # the device as built

    code, out, err = cli("estimate", path, "--fit", "microbatch", "--device-memory", str(memory))
    assert code == 0, err
    assert "largest microbatch whose allocated tensors fit" in out and ": 3 (peak" in out  # the allocated answer
    assert "on the device: microbatch 3 does NOT fit" in out and "on the device: microbatch 2 fits" in out
    assert "largest microbatch that fits on the device: 2 (the allocated tensors alone allow 3)" in out
    block = load(path).plain["x-fit"]["microbatch"]
    assert block["largest"] == 3 and block["device"]["largest"] == 2
    for b in (2, 3):
        checked = block["device"]["checked"][str(b)]
        assert (checked["fits"], checked["device_peak"]) == (want[b].fits, want[b].device_peak)
    code, report, _ = cli("report", path, "--plain")  # the report's fit table says both answers
    assert code == 0 and "on the device (allocator model + outside the allocator): largest 2;" in " ".join(
        report.split()
    )


@pytest.mark.slow
def test_the_cpu_target_keeps_the_allocated_answer(tmp_path: Path, cli: CliRunner) -> None:
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    path = tmp_path / "t.ledger.yaml"
    path.write_text(ledger_text(microbatch=1, seq=128), encoding="utf-8")
    code, out, err = cli("estimate", path, "--fit", "microbatch", "--device-memory", "64MiB", "--target", "cpu")
    assert code == 0, err
    assert "on the device" not in out and "allocated tensors only" in out
    assert "device" not in load(path).plain["x-fit"]["microbatch"]


def test_a_checked_value_at_the_edge_does_not_fit() -> None:
    """A value that completes only with the outside-allocator catalogue's typical figure (its replay with the
    catalogue's high figure ran out, :attr:`DevicePrediction.uncertain`) is at the edge: printed as not fitting, with
    why, recorded as uncertain, and the search's answer is a lower value that fits."""
    from ledgerspec.derivations.devices.fit_check import Checked, DeviceFit

    edge = Checked(4, False, 79 * 2**30, 2**28, "outside", uncertain=True)
    fit = DeviceFit("microbatch", 80 * 2**30, 4, None, [edge])
    line, answer = fit.lines()
    assert line == (
        "on the device: microbatch 4 does NOT fit, AT THE EDGE (it completes with the typical bytes outside the "
        "allocator, not with the high end of the catalogue's range), device peak 79.00 GiB of 79.25 GiB (its CUDA "
        "total; 80.00 GiB declared), margin 256.00 MiB"
    )
    assert answer == "no microbatch checked fits on the device (down to 4)"
    assert fit.to_extension()["checked"]["4"] == {
        "fits": False,
        "device_peak": 79 * 2**30,
        "margin": 2**28,
        "uncertain": True,
    }
    stepped = DeviceFit(
        "microbatch",
        80 * 2**30,
        5,
        3,
        [Checked(5, False, 81 * 2**30, -(2**30), "allocated"), edge, Checked(3, True, 70 * 2**30, 2**30, "none")],
    )
    assert stepped.lines()[-1] == "largest microbatch that fits on the device: 3 (the allocated tensors alone allow 5)"
    # a value above the answer that an allocator setting makes fit is named with it (fragmentation decided it)
    rescued = DeviceFit(
        "microbatch",
        80 * 2**30,
        8,
        6,
        [
            Checked(8, False, 84 * 2**30, -(2**30), "fragmentation"),
            Checked(6, True, 75 * 2**30, 2**30, "none"),
            Checked(7, False, 80 * 2**30, -(2**28), "fragmentation", "expandable_segments:True"),
        ],
    )
    assert rescued.lines()[-1] == (
        "largest microbatch that fits on the device: 6 (the allocated tensors alone allow 8; 7 with "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
    )
    plain = DeviceFit("microbatch", 80 * 2**30, 4, 4, [Checked(4, True, 70 * 2**30, 2**30, "none")])
    assert "AT THE EDGE" not in plain.lines()[0] and "uncertain" not in plain.to_extension()["checked"]["4"]


def test_each_checked_value_is_printed_against_the_total_its_margin_is_taken_from() -> None:
    """A card declared by its nominal size is decided against its CUDA total (an RTX 4090 declared 24 GiB: 23.64
    GiB): each line prints the total its margin is taken from (device peak + margin = that total), and says once
    that it is not the declared figure; a total equal to the declared one is printed alone."""
    from ledgerspec.derivations.devices.fit_check import Checked, DeviceFit

    declared, cuda = 24 * 2**30, 25_386_352_640  # 23.64 GiB, about an RTX 4090's CUDA total
    checked = [
        Checked(8, False, 26 * 2**30, cuda - 26 * 2**30, "allocated", device="NVIDIA GeForce RTX 4090"),
        Checked(6, True, 22 * 2**30, cuda - 22 * 2**30, "none", device="NVIDIA GeForce RTX 4090"),
    ]
    first, second, last = DeviceFit("microbatch", declared, 8, 6, checked).lines()
    assert (
        "microbatch 8 does NOT fit (its tensors alone exceed what the allocator can get beside what lies outside it), "
        "device peak 26.00 GiB of 23.64 GiB (NVIDIA GeForce RTX 4090's CUDA total; 24.00 GiB declared), 2.36 GiB over"
    ) in first
    assert "device peak 22.00 GiB of 23.64 GiB, margin 1.64 GiB" in second
    assert "largest microbatch that fits on the device: 6" in last
    line, _ = DeviceFit("microbatch", cuda, 6, 6, [checked[1]]).lines()
    assert "device peak 22.00 GiB of 23.64 GiB, margin 1.64 GiB" in line and "declared" not in line


def test_a_card_the_catalogue_chose_for_the_memory_is_named_and_a_fit_at_the_limit_is_said() -> None:
    """``--device-memory 80GiB`` names the catalogue's card nearest to it (the plain estimate's choice): the first
    line says which card's CUDA total the margin is taken from. A value that fits only once the allocator has freed
    its cached blocks and retried (its cache fills the device, the margin is then no safety margin) says so."""
    from ledgerspec.derivations.devices.fit_check import Checked, DeviceFit

    cuda = int(79.25 * 2**30)
    checked = [
        Checked(20, True, cuda - 2**20, 2**20, "none", device="NVIDIA A100-SXM4-80GB", named_by="catalogue",
                at_limit=True),
    ]  # fmt: skip
    line, answer = DeviceFit("microbatch", 80 * 2**30, 20, 20, checked).lines()
    assert line == (
        "on the device: microbatch 20 fits only at the limit (the allocator's cache fills the device: it frees its "
        "cached blocks and retries), device peak 79.25 GiB of 79.25 GiB (NVIDIA A100-SXM4-80GB's CUDA total, the "
        "catalogue's card nearest to 80.00 GiB; 80.00 GiB declared), margin 1.00 MiB"
    )
    assert answer == "largest microbatch that fits on the device: 20 (as the allocated tensors allow)"
    both = Checked(20, False, cuda - 2**20, 2**20, "outside", uncertain=True, at_limit=True)
    (line, _) = DeviceFit("microbatch", cuda, 20, None, [both]).lines()
    assert "microbatch 20 does NOT fit, AT THE EDGE" in line and "at the limit" not in line
    block = DeviceFit("microbatch", 80 * 2**30, 20, 20, checked).to_extension()  # what report's fit row names
    assert (block["card"], block["cuda_total"]) == ("NVIDIA A100-SXM4-80GB", cuda)


def test_a_device_memory_asked_with_the_flag_names_the_device_as_the_plain_estimate_does(monkeypatch: Any) -> None:
    """``--fit --device-memory 80GiB`` on a ledger that declares a 24 GiB card: each value is decided as ``estimate
    --device-memory 80GiB`` decides it (the catalogue's card of that memory and its CUDA total), so the check hands
    ``from_flag`` to the verdict, traced or from the microbatch streams."""
    from types import SimpleNamespace

    from ledgerspec.derivations.devices import fit_check, prediction
    from tests.support.estimate_docs import ledger_text
    from tests.support.predictions import fake_prediction

    asked: list[bool] = []

    def verdict(*args: Any, **kwargs: Any) -> Any:
        asked.append(bool(args[2] if len(args) > 2 else kwargs.get("from_flag", False)))
        return None, fake_prediction(True, 1, 1, capacity=2)

    class Along:
        def on_device(self, value: int, memory: int, from_flag: bool = False) -> Any:
            return verdict(None, memory, from_flag)[1]

        def settle(self) -> bool:
            return True

    monkeypatch.setattr(prediction, "estimate_on_device", verdict)
    doc = from_text(ledger_text(), "t.ledger.yaml")
    answer = SimpleNamespace(name="max_length", largest=64, peaks={32: 1, 64: 2})
    for flag in (True, False):
        fit_check.check_on_device(doc, answer, 2**30, from_flag=flag)
        fit_check.check_on_device(doc, SimpleNamespace(**{**vars(answer), "name": "microbatch"}), 2**30,
                                  along=Along(), from_flag=flag)  # fmt: skip
    assert asked == [True, True, False, False]


@pytest.mark.slow  # one tiny estimate on the device
def test_a_synthesised_verdict_for_a_flagged_memory_is_kept_under_the_question_it_answers(tmp_path: Path) -> None:
    """A verdict written from the microbatch streams before their check is kept in the cache once the check passes
    (``keep_synthesised``) under the question that asks it again: with ``--device-memory 80GiB`` on a ledger that
    declares a 24 GiB RTX 4090 the device is the catalogue's 80 GiB card (its CUDA total), not the RTX 4090 at 80 GiB,
    so the flag is part of the question."""
    from ledgerspec.derivations.devices.prediction import cached_on_device, estimate_on_device, keep_synthesised
    from ledgerspec.derivations.estimate.cache import EstimateCache
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    text = ledger_text() + "result:\n  target_device: {name: NVIDIA GeForce RTX 4090, memory: 24GiB}\n"
    doc = from_text(text, str(tmp_path / "t.ledger.yaml"))
    memory = 80 * 2**30
    _, flagged = estimate_on_device(doc, memory, True)
    _, declared = estimate_on_device(doc, memory, False)
    assert flagged.cuda_total < memory == declared.cuda_total  # two devices: the question differs
    store = EstimateCache(tmp_path / "cache")
    keep_synthesised(doc, memory, flagged, store=store, from_flag=True)
    kept = cached_on_device(doc, memory, True, store=store)
    assert kept is not None and kept.device_peak == flagged.device_peak and kept.cuda_total == flagged.cuda_total
    assert cached_on_device(doc, memory, False, store=store) is None
