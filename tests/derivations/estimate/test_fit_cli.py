"""``ledgerspec estimate --fit / --devices / --sweep -v`` on the tiny model: one command answers each question."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support import EXAMPLES, CliRunner

TINY = EXAMPLES / "tiny" / "tiny-llama-lora.ledger.yaml"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "tiny" / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / TINY.name
    shutil.copy(TINY, path)
    return path


def test_a_bad_sweep_value_is_one_plain_line(cli: CliRunner, tiny: Path) -> None:
    """Issue 13: `--sweep microbatch=a` printed Python's "invalid literal for int() with base 10"."""
    code, _, err = cli("estimate", tiny, "--sweep", "microbatch=a")
    assert (
        code == 2 and err.strip() == "ledgerspec: estimate: --sweep microbatch: 'a' is not a whole number (e.g. 1,2,4)"
    )
    assert "int()" not in err


def test_fit_needs_a_device_and_asks_one_question_at_a_time(cli: CliRunner, tiny: Path) -> None:
    code, _, err = cli("estimate", tiny, "--fit", "microbatch")
    assert code == 2 and "--fit needs a device memory" in err and "--device-memory" in err
    code, _, err = cli("estimate", tiny, "--fit", "microbatch", "--devices", "--device-memory", "1GiB")
    assert code == 2 and "ask one at a time" in err
    for fit in ((), ("--fit", "max_length")):  # --exact alone was accepted and did nothing
        code, out, err = cli("estimate", tiny, "--exact", *fit, "--device-memory", "1GiB")
        assert code == 2 and out == "" and "--exact traces the answer of --fit microbatch" in err


@pytest.mark.slow
def test_fit_microbatch_answers_and_records_it(cli: CliRunner, tiny: Path) -> None:
    code, out, err = cli(
        "estimate", tiny, "--fit", "microbatch", "max_length", "--device-memory", "8MiB", "--target", "cpu"
    )
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("largest microbatch whose allocated tensors fit 8.00 MiB: ") and "does not fit" in first
    assert "largest max_length whose allocated tensors fit 8.00 MiB: " in out
    fit = load(tiny).get("x-fit").raw
    assert set(fit) >= {"microbatch", "max_length", "inputs", "source"}
    mb = fit["microbatch"]
    assert mb["peak"] <= 8 * 2**20 < mb["peak_above"] and mb["above"] == mb["largest"] + 1
    assert len(mb["traced"]) == 2
    ml = fit["max_length"]
    assert ml["peak"] <= 8 * 2**20 < ml["peak_above"] and ml["above"] == ml["largest"] + 64
    assert ml["largest"] in ml["traced"] and ml["above"] in ml["traced"]


@pytest.mark.slow
def test_devices_answers_which_server_and_records_it(cli: CliRunner, tiny: Path) -> None:
    code, out, err = cli("estimate", tiny, "--devices")
    assert code == 0, err
    assert "NVIDIA GeForce RTX 4090" in out and "AMD Instinct MI300X" in out
    # decided on the device: usable is what the allocator can get there, the largest microbatch an upper bound
    assert "usable = what the caching allocator can get there" in out and "usable memory =" not in out
    rows = load(tiny).get("x-devices", "rows").raw
    assert {r["name"] for r in rows} >= {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    assert all(r["fits"] and r["largest_microbatch"] >= 1 for r in rows)
    _, report, _ = cli("report", "--plain", tiny)
    assert "which device (estimate --devices)" in report
    # decided on the device: the bound and the device peak, in the report as on the command line
    assert "<= " in report and "largest microbatch (allocated)" not in report and "device peak" in report
    from ledgerspec.faces.report.data import DeviceRow
    from ledgerspec.faces.report.terminal import device_head

    older = DeviceRow("a card", 1, 2**30, "1 GB", 2**29, True, 2**29, 3)  # an x-devices block without the bound
    assert device_head(older.largest_at_most)[-1] == "largest microbatch (allocated)" and older.largest_text == "3"
    # issue 23: decided on the device, each row as `estimate --device-memory` decides for that device
    assert "device peak" in out and "decided on the device" in out
    for r in rows:
        # against the card's CUDA total (its catalogue capacity), not nvidia-smi's total
        assert r["device_peak"] > r["peak"] and r["headroom"] == r["capacity"] - r["device_peak"]
        assert r["capacity"] <= r["total"]
    from ledgerspec.derivations.devices.prediction import estimate_on_device

    rtx = next(r for r in rows if r["name"] == "NVIDIA GeForce RTX 4090")
    _, single = estimate_on_device(load(tiny), rtx["total"], from_flag=True)  # the catalogue names the same card
    assert single.target.name == rtx["name"] and single.device_peak == rtx["device_peak"]
    assert single.cuda_total == rtx["capacity"] < rtx["total"] and single.margin == rtx["headroom"]
    assert single.replayed.capacity == rtx["memory"] and rtx["largest_at_most"] is True  # "the X GiB it can get"
    assert f"<= {rtx['largest_microbatch']}" in out


@pytest.mark.slow
def test_sweep_rows_explain_themselves(cli: CliRunner, tiny: Path) -> None:
    code, out, _ = cli(
        "estimate", tiny, "--sweep", "microbatch=1,2,3,4", "gradient_checkpointing=on,off", "-v", "--target", "cpu"
    )
    assert code == 0
    assert "what is alive at each peak" in out and "(model)" in out and "(traced)" in out
    assert "activations" in out and "(8 configurations from 6 traced estimates" in out


def test_devices_asked_again_is_read_from_the_cache(
    cli: CliRunner, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeated ``--devices`` costs no trace: its answer (device verdicts included, whose streams are not cached) is
    kept under the ledger's inputs and the catalogue's figures; a changed catalogue asks again."""
    import ledgerspec.derivations.devices.prediction as prediction

    monkeypatch.setenv("LEDGERSPEC_CACHE_DIR", str(tmp_path / "cache"))
    code, first, err = cli("estimate", tiny, "--devices", "--dry-run")
    assert code == 0, err

    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced again")

    monkeypatch.setattr(prediction, "step_and_estimate", no_trace)
    code, again, err = cli("estimate", tiny, "--devices", "--dry-run")
    assert code == 0, err
    table = [line for line in first.splitlines() if "NVIDIA" in line or "AMD" in line]
    assert table and table == [line for line in again.splitlines() if "NVIDIA" in line or "AMD" in line]
    mine = tmp_path / "my-devices.yaml"
    mine.write_text(
        "devices:\n  - {name: My Card, vendor_memory: 8 GB, total: 8000000000, source: a test}\n", encoding="utf-8"
    )
    code, _, err = cli("estimate", tiny, "--devices", mine, "--dry-run")  # another catalogue: traced (and refused here)
    assert code != 0 and "traced again" in err


@pytest.mark.slow
def test_a_card_named_on_the_command_line_is_the_card_decided_on(cli: CliRunner, tiny: Path) -> None:
    """``--device-memory "RTX 3090"`` on a ledger declaring an RTX 4090 (``software.gpu_name``): the 3090's total,
    24 GiB, is one of the 4090's nominal memories, so the total alone named the 4090 (found by a fresh-eyes review).
    The card asked about is the one decided on, and recorded as the target device."""
    text = tiny.read_text(encoding="utf-8")
    assert "\nsoftware:\n" in text
    tiny.write_text(text.replace("\nsoftware:\n", "\nsoftware:\n  gpu_name: NVIDIA GeForce RTX 4090\n", 1), "utf-8")
    code, out, err = cli("estimate", tiny, "--device-memory", "RTX 3090")
    assert code == 0, err
    assert "is the device catalogue's NVIDIA GeForce RTX 3090, 24.00 GiB" in err
    assert "on the device: NVIDIA GeForce RTX 3090 (sm_86)" in out and "RTX 4090" not in out
    target = load(tiny).get("result", "target_device").raw
    assert dict(target) == {"name": "NVIDIA GeForce RTX 3090", "memory": 24 * 2**30}
