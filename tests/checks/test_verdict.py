"""The verdict (FITS / DOES NOT FIT / UNKNOWN on the target device) and the grouped next steps: checks/verdict.py."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.checks.ladder import supported_status
from ledgerspec.checks.verdict import DOES_NOT_FIT, FITS, UNKNOWN, next_status, next_steps, verdict
from ledgerspec.contract.document import from_text
from tests.support import EXAMPLES

BASE = """ledgerspec: ledger/v1
result:
  target_device: {name: RTX 4090, memory: 24GiB}
"""


def _verdict(text: str) -> object:
    doc = from_text(text)
    return verdict(doc, supported_status(doc))


def test_a_predicted_peak_that_fits_says_by_how_much() -> None:
    v = _verdict(BASE + "x-estimate:\n  peak_allocated: {value: 15GiB, source: CALCULATED, method: m}\n")
    assert v.answer == FITS and v.provenance == "predicted" and v.headroom == 9 * 2**30  # type: ignore[attr-defined]
    assert v.sentence().startswith(  # type: ignore[attr-defined]
        "FITS on RTX 4090 (24.00 GiB): predicted peak 15.00 GiB (x-estimate.peak_allocated), headroom 9.00 GiB"
    )


def test_a_prediction_over_the_device_names_the_phase_that_runs_out() -> None:
    text = BASE + (
        "x-estimate:\n  peak_allocated: {value: 30GiB, source: CALCULATED, method: m}\n"
        "  phases: {after_load: 4294967296, forward_peak: 21474836480, backward_peak: 32212254720}\n"
    )
    v = _verdict(text)
    assert v.answer == DOES_NOT_FIT and v.oom_phase == "backward"  # type: ignore[attr-defined]
    assert "6.00 GiB over; predicted to run out of memory in phase backward" in v.sentence()  # type: ignore[attr-defined]


def test_a_measured_peak_beats_the_prediction_and_a_measured_oom_does_not_fit() -> None:
    text = BASE + (
        "metrics:\n  device_peak: {value: 20GiB, source: MEASURED}\n"
        "x-estimate:\n  peak_allocated: {value: 30GiB, source: CALCULATED, method: m}\n"
    )
    v = _verdict(text)
    assert v.answer == FITS and v.provenance == "measured" and v.peak_field == "metrics.device_peak"  # type: ignore[attr-defined]
    ran = _verdict("ledgerspec: ledger/v1\nresult: {oom: true, oom_phase: forward, target_device: {memory: 24GiB}}\n")
    assert ran.answer == DOES_NOT_FIT and "ran out of memory in phase forward" in ran.sentence()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("ledgerspec: ledger/v1\n", "no target device"),
        (BASE, "no peak figure yet"),
        (BASE + "x-estimate:\n  target: cpu\n  peak_allocated: {value: 1GiB, source: CALCULATED, method: m}\n", "CPU"),
    ],
)
def test_unknown_says_what_is_missing(text: str, why: str) -> None:
    v = _verdict(text)
    assert v.answer == UNKNOWN and why in v.sentence()  # type: ignore[attr-defined]


def test_next_steps_fold_the_reasons_into_one_line_per_kind() -> None:
    doc = from_text((EXAMPLES / "14b-qlora.intake.yaml").read_text(encoding="utf-8"), "x.intake.yaml")
    reasons = supported_status(doc).reasons
    steps = next_steps(reasons, "x.intake.yaml")
    assert len(steps) < len(reasons) and sum(len(s.reasons) for s in steps) == len(reasons)
    assert steps[0].line().startswith("fill the minimum intake (identity.model_id")
    est = next_steps(["CANDIDATE needs a peak figure: a predicted peak"], "my.ledger.yaml")
    assert est[0].line().endswith("`ledgerspec estimate my.ledger.yaml`")  # the file named, not FILE
    assert next_status("CALCULATED") == "CANDIDATE" and next_status("VALIDATED") is None


DEVICE = (
    BASE
    + """software:
  pytorch_cuda_alloc_conf: ""
x-estimate:
  peak_allocated: {value: 20GiB, source: CALCULATED, method: m}
  phases: {forward_peak: 21474836480}
  device_memory: 25769803776
  fits: false
  oom_phase: backward
  peak_reserved: {value: 23GiB, source: CALCULATED, method: allocator model}
  outside_allocator: {value: 1GiB, source: ASSUMPTION, note: catalogue}
  device_peak: {value: 24.5GiB, source: ASSUMPTION, note: reserved + outside}
  verdict:
    device_memory: 25769803776
    alloc_conf: ""
    named_by: result.target_device.name
    device: RTX 4090
    outside_from: catalogue
    decided_by: fragmentation
    fragmentation: 1GiB
    setting: {conf: "expandable_segments:True", margin: 512MiB}
"""
)


def test_the_device_level_prediction_is_what_the_verdict_compares() -> None:
    """The allocated peak (20 GiB) fits 24 GiB; the allocator replay and the bytes outside it do not: the verdict says
    which figure, by how much, the replay's phase, the fragmentation and the setting that would change it."""
    v = _verdict(DEVICE)
    assert v.answer == DOES_NOT_FIT and v.peak_field == "x-estimate.device_peak"  # type: ignore[attr-defined]
    assert v.headroom == -(2**29) and v.oom_phase == "backward"  # type: ignore[attr-defined]
    text = v.sentence()  # type: ignore[attr-defined]
    assert "predicted peak 24.50 GiB (x-estimate.device_peak), 512.00 MiB over" in text
    assert "reserved 23.00 GiB (allocator model) + 1.00 GiB outside the allocator (ASSUMPTION)" in text
    assert "allocated 20.00 GiB" in text and "decided by fragmentation (1.00 GiB free but unusable" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits, margin 512.00 MiB" in text


def test_a_generation_over_the_device_runs_out_in_a_forward() -> None:
    """GRPO's generation comes before the step's forward: when its peak alone is over the device, the predicted
    out-of-memory phase is the generation's (a forward, in the spec's words), not the later backward."""
    text = BASE + (
        "x-estimate:\n  peak_allocated: {value: 30GiB, source: CALCULATED, method: m}\n"
        "  phases: {after_load: 4294967296, generation_peak: 27917287424, forward_peak: 21474836480, "
        "backward_peak: 26843545600}\n"
    )
    v = _verdict(text)
    assert v.answer == DOES_NOT_FIT and v.oom_phase == "forward"  # type: ignore[attr-defined]


def test_a_margin_inside_the_catalogues_range_is_at_the_edge_and_does_not_fit() -> None:
    """23.5 GiB predicted on 24 GiB completes with the catalogue's typical 1 GiB outside the allocator; the estimate
    found that with its high end (2 GiB) the replay runs out: at the edge, the verdict is DOES NOT FIT (its headroom
    the typical figure's), and it says why."""
    fits = DEVICE.replace("24.5GiB, source: ASSUMPTION", "23.5GiB, source: ASSUMPTION").replace(
        "    decided_by: fragmentation\n", "    decided_by: none\n    uncertain: true\n    outside_high: 2GiB\n"
    )
    v = _verdict(fits)
    assert v.answer == DOES_NOT_FIT and v.peak_field == "x-estimate.device_peak"  # type: ignore[attr-defined]
    assert v.headroom == 2**29  # type: ignore[attr-defined]
    text = v.sentence()  # type: ignore[attr-defined]
    assert "headroom 512.00 MiB" in text
    assert "AT THE EDGE: it completes only with the typical bytes outside the allocator" in text
    assert "with the catalogue's high end (2.00 GiB) the allocator model runs out of memory" in text
    plain = _verdict(fits.replace("uncertain: true", "uncertain: false"))
    assert plain.answer == FITS and "AT THE EDGE" not in plain.sentence()  # type: ignore[attr-defined]
    bare: Any = _verdict(fits.replace("    outside_high: 2GiB\n", ""))  # the high end not recorded: still said
    assert bare.answer == DOES_NOT_FIT
    assert "with the catalogue's high end the allocator model runs out" in bare.sentence()
    # a setting the estimate replayed against the high end (at_high) and found to complete there is named; one tried
    # against the typical figure only is not (it says nothing about the high end)
    assert "it completes with the high end too" not in text
    named: Any = _verdict(fits.replace("margin: 512MiB}", "margin: 512MiB, at_high: true}"))
    assert named.answer == DOES_NOT_FIT
    assert (
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it completes with the high end too, margin 512.00 MiB "
        "there" in named.sentence()
    )


def test_a_device_prediction_of_other_outside_allocator_parts_is_not_compared() -> None:
    """The estimate records the parts of ``outside_allocator`` its figure took from the ledger (``outside_held``):
    a part edited since (here NCCL's buffers, 420 MiB then, 600 MiB now) makes that device-level prediction one of
    other inputs, as an edited ``total`` does; the verdict falls back to the allocated peak and says why. An
    estimate that records no parts (older ledgers) is read as before."""
    held = DEVICE.replace(
        "    outside_from: catalogue\n", "    outside_from: catalogue\n    outside_held: {nccl: 420MiB}\n"
    )
    same = held + "outside_allocator:\n  nccl: {value: 420MiB, source: ASSUMPTION, note: our NCCL log}\n"
    v: Any = _verdict(same)
    assert v.peak_field == "x-estimate.device_peak"
    edited: Any = _verdict(same.replace("nccl: {value: 420MiB", "nccl: {value: 600MiB"))
    assert edited.peak_field == "x-estimate.peak_allocated"
    assert "other outside_allocator parts" in edited.sentence()
    older: Any = _verdict(DEVICE + "outside_allocator:\n  nccl: {value: 600MiB, source: ASSUMPTION, note: n}\n")
    assert older.peak_field == "x-estimate.device_peak"


def test_without_a_device_level_prediction_for_this_device_the_verdict_says_allocated_only() -> None:
    v = _verdict(DEVICE.replace('  pytorch_cuda_alloc_conf: ""', "  pytorch_cuda_alloc_conf: max_split_size_mb:128"))
    assert v.answer == FITS and v.peak_field == "x-estimate.peak_allocated"  # type: ignore[attr-defined]
    assert v.oom_phase is None  # type: ignore[attr-defined]
    assert "allocated tensors only" in v.sentence() and "other allocator settings" in v.sentence()  # type: ignore[attr-defined]


def test_a_device_level_prediction_is_compared_with_the_cuda_total_it_was_decided_against() -> None:
    """23.75 GiB predicted on a 24 GiB RTX 4090 whose CUDA total is 23.64 GiB (PyTorch's out-of-memory messages in
    3DTopia/Phidias-Diffusion#8, TMElyralab/MuseTalk#76): it does not fit, and the verdict says against what; the
    same ledger estimated before `cuda_total` was recorded reads as it did (against the declared 24 GiB)."""
    cuda = round(23.64 * 2**30)
    fits = DEVICE.replace("24.5GiB, source: ASSUMPTION", "23.75GiB, source: ASSUMPTION")
    old = _verdict(fits)
    assert old.answer == FITS and old.peak_field == "x-estimate.device_peak"  # type: ignore[attr-defined]
    note = "an RTX 4090's CUDA total is 23.64 GiB, not the declared 24.00 GiB"
    new = fits.replace(
        "    device_memory: 25769803776\n    alloc_conf",
        f'    device_memory: 25769803776\n    cuda_total: {cuda}\n    cuda_total_note: "{note}"\n    alloc_conf',
    )
    v = _verdict(new)
    assert v.answer == DOES_NOT_FIT and v.headroom == cuda - round(23.75 * 2**30)  # type: ignore[attr-defined]
    assert note in v.sentence()  # type: ignore[attr-defined]
    from ledgerspec.checks.ladder import DEVICE_PEAK, compared_total

    assert compared_total(from_text(new), 24 * 2**30, DEVICE_PEAK) == cuda  # what the status ladder compares too
    assert compared_total(from_text(new), 24 * 2**30, "x-estimate.peak_allocated") == 24 * 2**30


def test_a_prediction_of_inputs_edited_since_answers_nothing() -> None:
    """The bundled estimated ledger fits; edited after its estimate (the microbatch raised from 1 to 8), the same
    predicted peak is of other inputs: the ladder stops counting it (LS006), and the verdict is UNKNOWN, naming the
    out-of-date figure and the command that renews it, not a FITS of a step the ledger no longer declares."""
    text = (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").read_text(encoding="utf-8")
    assert "\n  microbatch: 1\n" in text
    fresh = _verdict(text)
    assert fresh.answer == FITS  # type: ignore[attr-defined]
    edited = _verdict(text.replace("\n  microbatch: 1\n", "\n  microbatch: 8\n"))
    assert edited.answer == UNKNOWN  # type: ignore[attr-defined]
    assert edited.sentence() == (  # type: ignore[attr-defined]
        "UNKNOWN: the predicted peak 14.79 GiB (x-estimate.device_peak) is of inputs edited since: run "
        "`ledgerspec estimate FILE` again"
    )
