"""Size flags (``--device-memory``, ``--memory-limit``): one reading, one wording, refused before any work."""

from __future__ import annotations

import argparse

import pytest

from ledgerspec.contract.units import parse_size
from ledgerspec.faces.arguments import MIN_DEVICE_MEMORY, decimal_unit_note, device_memory, positive_size
from tests.support import EXAMPLES, CliRunner


@pytest.mark.parametrize("text", ["24GiB", "80GB", "1.5 TiB", "25769803776", "1MiB", "1048576.0"])
def test_a_device_memory_is_the_bytes_the_size_denotes(text: str) -> None:
    value = device_memory(text)
    assert value == parse_size(text) and value.text == text


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("0", "must be a positive size"),
        ("-5GB", "negative size"),
        ("lots", "is not a size"),
        ("24", "did you mean 24GiB or 24GB?"),
        (str(MIN_DEVICE_MEMORY - 1), "too small for a device"),
        ("512KiB", "too small for a device; give a device's memory$"),  # no "512KiBGiB" suggestion
        ("24G", "did you mean GiB"),
        ("24Gi", "did you mean GiB"),
        ("24.5", "did you mean 24.5GiB"),
    ],
)
def test_a_bad_device_memory_is_a_usage_error(text: str, phrase: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=phrase):
        device_memory(text)


#: totals as nvidia-smi prints them (MiB), from the sources the device catalogue cites (tests/derivations/devices)
@pytest.mark.parametrize(
    ("text", "card", "mib"),
    [
        ("RTX 4090", "NVIDIA GeForce RTX 4090", 24564),
        ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090", 24576),
        ("H100", "NVIDIA H100 80GB HBM3", 81559),
        ("a100 40gb", "NVIDIA A100 40GB", 40960),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB", 81920),  # as nvidia-smi names it
        ("rtx4090", "NVIDIA GeForce RTX 4090", 24564),  # the words run together (a newcomer trial)
        ("RTX 5090", "NVIDIA GeForce RTX 5090", 32607),  # the cards people rent or buy besides the data centre's
        ("T4", "Tesla T4", 15360),
        ("L4", "NVIDIA L4", 23034),
        ("A10G", "NVIDIA A10G", 23028),
    ],
)
def test_a_card_of_the_device_catalogue_is_its_total(text: str, card: str, mib: int) -> None:
    """A newcomer typed ``--device-memory "RTX 3090"`` and got "is not a size"."""
    value = device_memory(text)
    assert (value, value.card) == (mib * 2**20, card)
    note = decimal_unit_note(value)
    assert note is not None and f"is the device catalogue's {card}" in note


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("A100", "names several cards of the device catalogue \\(NVIDIA A100 40GB, NVIDIA A100 80GB\\): say which"),
        (
            "RTX 3060",
            "is not a size; .*; or name a card of the device catalogue \\(Tesla T4, NVIDIA GeForce RTX 3090, ",
        ),
        ("A10", "names several cards of the device catalogue \\(NVIDIA A10G, NVIDIA A100 40GB, NVIDIA A100 80GB\\)"),
        ("4090", "did you mean the card 'NVIDIA GeForce RTX 4090'\\?"),  # a bare number that is one card's
    ],
)
def test_a_card_name_that_is_no_one_card_is_a_usage_error(text: str, phrase: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=phrase):
        device_memory(text)


def test_a_memory_limit_may_be_small_but_not_zero() -> None:
    assert positive_size("1536KiB") == 1536 * 1024 and positive_size("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        positive_size("0")


@pytest.mark.parametrize(
    ("text", "note"),
    [
        ("24GB", '= 22.35 GiB (decimal units); GPU memory is sold in binary units, a "24 GB" card has about 24GiB'),
        ("80 GB", "pass 80GiB"),
        ("24GiB", None),
        ("24000MB", None),  # cards are sold in GB: no note for other decimal units
        ("25769803776", None),
    ],
)
def test_decimal_units_get_a_note_binary_ones_do_not(text: str, note: str | None) -> None:
    got = decimal_unit_note(device_memory(text))
    if note is None:
        assert got is None
    else:
        assert got is not None and note in got, got


def test_estimate_prints_the_note(cli: CliRunner) -> None:
    code, _, err = cli(
        "estimate",
        EXAMPLES / "tiny" / "tiny-llama-lora.ledger.yaml",
        "--target",
        "cpu",
        "--dry-run",
        "--device-memory",
        "24GB",
    )
    assert code == 0 and "--device-memory 24GB is 24,000,000,000 B = 22.35 GiB (decimal units)" in err


def test_a_target_memory_in_gb_in_the_document_gets_the_same_note(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13: `result.target_device.memory: 24 GB` was silently 22.35 GiB (only the flag had a note)."""
    from ledgerspec.contract.document import from_text
    from ledgerspec.faces.arguments import target_memory_note

    target_memory_note(from_text("ledgerspec: ledger/v1\nresult: {target_device: {memory: 24 GB}}\n"), "f")
    err = capsys.readouterr().err
    assert "f: note: result.target_device.memory 24 GB is 24,000,000,000 B = 22.35 GiB (decimal units)" in err
    target_memory_note(from_text("ledgerspec: ledger/v1\nresult: {target_device: {memory: 24GiB}}\n"), "f")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("asked", [["--fit", "microbatch"], ["--what-if"]])
def test_grpo_refuses_the_questions_that_choose_microbatches_themselves(cli: CliRunner, asked: list[str]) -> None:
    """``--fit microbatch`` and ``--what-if`` try microbatches 1, 2, 4, ...; GRPOConfig refuses a generation batch
    that is not a multiple of num_generations (8 here), so they are refused at training.objective before any trace."""
    code, _, err = cli("estimate", EXAMPLES / "objectives" / "llama-3.1-8b-lora-grpo.ledger.yaml", *asked, "--dry-run")
    (line,) = err.strip().splitlines()
    assert code == 2 and "llama-3.1-8b-lora-grpo.ledger.yaml:50:3: usage:" in line, err
    assert f"{asked[0]}" in line and "multiple of num_generations" in line and "--sweep microbatch=" in line
