"""The status ladder INSUFFICIENT DATA < CALCULATED < CANDIDATE < VALIDATED, with worked cases.

Each test starts from a document that reaches a rung and changes one thing: the rung it then
reaches, and the reason that holds it down, are what the spec says. Documents are built as Python
dicts and loaded as JSON text (JSON is YAML), so each case shows exactly what it changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from ledgerspec.checks.ladder import LADDER, supported_status
from ledgerspec.checks.validate import validate
from ledgerspec.contract.document import from_text, load
from tests.support import EXAMPLES
from tests.support.ledgers import (
    DELETE,
    GiB,
    calc,
    calculated,
    candidate,
    intake_sections,
    measured,
    status_of,
    validated,
    with_change,
)

# -- each rung is reached ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: {"ledgerspec": "ledger/v1"}, "INSUFFICIENT DATA"),
        (calculated, "CALCULATED"),
        (candidate, "CANDIDATE"),
        (validated, "VALIDATED"),
    ],
    ids=["empty", "calculated", "candidate", "validated"],
)
def test_each_rung_is_reached(build: Callable[[], dict[str, Any]], expected: str) -> None:
    status, reasons = status_of(build())
    assert status == expected
    assert (reasons == []) == (expected == "VALIDATED"), "every rung below the top says what holds it down"


def test_ladder_order() -> None:
    assert LADDER == ("INSUFFICIENT DATA", "CALCULATED", "CANDIDATE", "VALIDATED")


def test_validated_document_is_clean() -> None:
    report = validate(from_text(json.dumps({**validated(), "status": "VALIDATED"}), "<case>"))
    assert report.supported_status == "VALIDATED"
    assert [f for f in report.findings if f.severity == "error"] == []


# -- the minimum intake, one field at a time -------------------------------------------------------

MINIMUM = [
    ("identity", "model_id"),
    ("method", "kind"),
    ("method", "rank"),
    ("base_model", "loaded_dtype"),
    ("adapter", "dtype"),
    ("workload", "microbatch"),
    ("optimizer", "name"),
    ("memory_options", "gradient_checkpointing"),
]
EITHER = [
    (("identity", "revision"), ("identity", "config_sha256")),
    (("method", "target_modules"), ("method", "target_parameters")),
    (("workload", "max_length"), ("workload", "sequence_p95")),
]


@pytest.mark.parametrize(
    "how",
    [DELETE, "UNKNOWN", "CONFIGURATION-SPECIFIC", {"source": "UNKNOWN"}],
    ids=["missing", "UNKNOWN", "CONFIGURATION-SPECIFIC", "long-UNKNOWN"],
)
@pytest.mark.parametrize("path", MINIMUM, ids=".".join)
def test_each_minimum_intake_field_holds_even_a_measured_ledger_down(path: tuple[str, ...], how: Any) -> None:
    status, reasons = status_of(with_change(validated, path, how))
    assert status == "INSUFFICIENT DATA"
    assert any(".".join(path) in r for r in reasons), reasons


@pytest.mark.parametrize("pair", EITHER, ids=lambda p: " or ".join(".".join(x) for x in p))
def test_either_field_of_a_pair_is_enough(pair: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    first, second = pair
    only_second = with_change(calculated, first, DELETE)
    only_second = with_change(lambda: only_second, second, _sample(second))
    assert status_of(only_second)[0] == "CALCULATED"
    neither = with_change(lambda: with_change(calculated, first, "UNKNOWN"), second, DELETE)
    status, reasons = status_of(neither)
    assert status == "INSUFFICIENT DATA"
    assert any(".".join(first) in r and ".".join(second) in r for r in reasons), reasons


def _sample(path: tuple[str, ...]) -> Any:
    return {
        "config_sha256": "1b0c4ab7dc332885c8c62deeb46abc4c085feecd922a6ea861a65e3d2c3145b8",
        "target_parameters": ["mlp.experts.gate_up_proj"],
        "sequence_p95": 1730,
    }[path[-1]]


def test_the_articles_14b_qlora_request_is_insufficient_data() -> None:
    res = supported_status(load(EXAMPLES / "14b-qlora.intake.yaml"))
    assert res.status == "INSUFFICIENT DATA"
    for field in (
        "identity.model_id",
        "identity.revision",
        "method.rank",
        "method.target_modules",
        "base_model.quantization.type",
        "base_model.quantization.double_quant",
        "base_model.quantization.compute_dtype",
        "base_model.quantization.storage_dtype",
        "adapter.dtype",
        "workload.microbatch",
        "optimizer.name",
        "memory_options.gradient_checkpointing",
    ):
        assert any(field in r for r in res.reasons), f"{field} not among the reasons: {res.reasons}"


def test_model_and_method_alone_are_insufficient_data() -> None:
    status, reasons = status_of(
        {
            "ledgerspec": "intake/v1",
            "method": {"kind": "QLoRA"},
            "identity": {"total_parameters": {"value": 14_000_000_000, "source": "ASSUMPTION", "note": "14B"}},
        }
    )
    assert status == "INSUFFICIENT DATA"
    assert len(reasons) >= 12


# -- QLoRA: "4-bit" is not a description ---------------------------------------------------------

QUANT = {"type": "nf4", "bits": 4, "double_quant": True, "compute_dtype": "bfloat16", "storage_dtype": "uint8"}


def qlora() -> dict[str, Any]:
    d = calculated()
    d["method"]["kind"] = "QLoRA"
    d["base_model"] = {"loaded_dtype": "bfloat16", "quantized": True, "quantization": dict(QUANT)}
    d["ledger"]["frozen_base"] = calc(3_900_000_000, "packed nf4 + absmax + bf16 rest")
    return d


def test_complete_qlora_reaches_calculated() -> None:
    assert status_of(qlora())[0] == "CALCULATED"


@pytest.mark.parametrize("scheme", ["gptq", "awq", "int8"])
def test_a_base_quantized_by_another_library_needs_only_its_type(scheme: str) -> None:
    """GPTQ/AWQ checkpoints and LLM.int8 have no double quantization, compute or storage dtype to declare."""
    d = with_change(qlora, ("base_model", "quantization"), {"type": scheme})
    assert status_of(d)[0] == "CALCULATED"
    status, reasons = status_of(with_change(lambda: d, ("base_model", "quantization", "type"), "UNKNOWN"))
    assert status == "INSUFFICIENT DATA" and any("quantization.type" in r for r in reasons), reasons


@pytest.mark.parametrize("key", ["type", "double_quant", "compute_dtype", "storage_dtype"])
@pytest.mark.parametrize("how", [DELETE, "UNKNOWN"], ids=["missing", "UNKNOWN"])
def test_each_qlora_quantization_field_is_minimum_intake(key: str, how: Any) -> None:
    status, reasons = status_of(with_change(qlora, ("base_model", "quantization", key), how))
    assert status == "INSUFFICIENT DATA"
    assert any(f"base_model.quantization.{key}" in r for r in reasons), reasons


def test_quantized_base_counts_as_qlora_even_if_kind_says_lora() -> None:
    d = with_change(qlora, ("method", "kind"), "LoRA")
    assert status_of(d)[0] == "CALCULATED"
    status, reasons = status_of(with_change(lambda: d, ("base_model", "quantization", "type"), DELETE))
    assert status == "INSUFFICIENT DATA", reasons


def test_lora_needs_no_quantization_fields() -> None:
    assert "quantization" not in calculated()["base_model"]
    assert status_of(calculated())[0] == "CALCULATED"


def full() -> dict[str, Any]:
    """A full fine-tuning ledger: no adapters, so no rank, targets or adapter dtype (issue 26)."""
    d = calculated()
    d["method"] = {"kind": "full"}
    d.pop("adapter", None)
    return d


def test_full_fine_tuning_needs_no_adapter_fields() -> None:
    assert status_of(full())[0] == "CALCULATED"


@pytest.mark.parametrize("path", [("method", "kind"), ("base_model", "loaded_dtype"), ("optimizer", "name")])
def test_full_fine_tuning_keeps_the_rest_of_the_minimum_intake(path: tuple[str, ...]) -> None:
    status, reasons = status_of(with_change(full, path, "UNKNOWN"))
    assert status == "INSUFFICIENT DATA" and any(".".join(path) in r for r in reasons), reasons


def test_lora_still_needs_its_adapter_fields() -> None:
    d = with_change(full, ("method", "kind"), "LoRA")
    status, reasons = status_of(d)
    assert status == "INSUFFICIENT DATA"
    assert {r.split(" is ")[0] for r in reasons} >= {
        "minimum intake: method.rank",
        "minimum intake: method.target_modules or method.target_parameters",
        "minimum intake: adapter.dtype",
    }, reasons


def test_full_fine_tuning_of_a_quantized_base_is_refused_in_one_finding() -> None:
    d = with_change(qlora, ("method", "kind"), "full")
    found = [(f.rule, f.pointer) for f in validate(from_text(json.dumps(d), "<full>")).findings]
    assert ("LS032", "/method/kind") in found and not [r for r, _ in found if r == "LS030"], found


# -- 8-bit and paged optimizers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bits", "expected"),
    [
        ("adamw_torch", None, "CALCULATED"),
        ("adamw_8bit", None, "CALCULATED"),  # bits follow from the name
        ("paged_adamw_8bit", None, "CALCULATED"),
        ("paged_adamw_32bit", None, "CALCULATED"),
        ("paged_adamw", None, "CALCULATED"),  # transformers' name for bitsandbytes' 32-bit PagedAdamW
        ("paged_adam_9bit", None, "INSUFFICIENT DATA"),  # paged, but 8 or 32 bits?
        ("paged_adam_9bit", 8, "CALCULATED"),
        ("rmsprop_bnb", None, "INSUFFICIENT DATA"),
        ("rmsprop_bnb", 32, "CALCULATED"),
        ("paged_adam_9bit", "UNKNOWN", "INSUFFICIENT DATA"),
    ],
)
def test_optimizer_bits_follow_from_the_name_or_are_given(name: str, bits: Any, expected: str) -> None:
    opt: dict[str, Any] = {"name": name}
    if bits is not None:
        opt["bits"] = bits
    status, reasons = status_of(with_change(calculated, ("optimizer",), opt))
    assert status == expected
    if expected == "INSUFFICIENT DATA":
        assert any("optimizer.bits" in r for r in reasons), reasons


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_32bit"])
def test_bitsandbytes_optimizer_needs_the_bitsandbytes_version_to_validate(name: str) -> None:
    d = with_change(validated, ("optimizer", "name"), name)
    status, reasons = status_of(d)
    assert status == "CANDIDATE" and any("software.bitsandbytes" in r for r in reasons), reasons
    d["software"]["bitsandbytes"] = "0.50.2"
    assert status_of(d)[0] == "VALIDATED"


# -- CALCULATED needs exact resident components ----------------------------------------------------


@pytest.mark.parametrize("key", ["frozen_base", "adapter", "gradients", "optimizer"])
@pytest.mark.parametrize(
    "value",
    [DELETE, "UNKNOWN", 33554432, {"value": 33554432, "source": "ASSUMPTION", "note": "a guess"}],
    ids=["missing", "UNKNOWN", "bare-number", "ASSUMPTION"],
)
def test_each_resident_component_must_be_exact_for_calculated(key: str, value: Any) -> None:
    status, reasons = status_of(with_change(calculated, ("ledger", key), value))
    assert status == "INSUFFICIENT DATA"
    assert any(f"ledger.{key}" in r for r in reasons), reasons


@pytest.mark.parametrize("source", ["CALCULATED", "VERIFIED", "MEASURED"])
def test_exact_sources_count_for_calculated(source: str) -> None:
    d = with_change(calculated, ("ledger", "adapter"), {"value": 33554432, "source": source, "method": "x"})
    assert status_of(d)[0] == "CALCULATED"


def test_an_intake_stops_below_calculated_and_says_how_to_go_on() -> None:
    res = supported_status(load(EXAMPLES / "llama-2-7b-lora.intake.yaml"))
    assert res.status == "INSUFFICIENT DATA" and res.intake_complete
    assert any("resolve" in r for r in res.reasons)


# -- CANDIDATE -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (("result", "target_device", "memory"), DELETE, "result.target_device.memory"),
        (("ledger", "activations"), DELETE, "activation figure"),
        (("ledger", "activations"), {"value": "2GiB", "source": "ASSUMPTION", "note": "guess"}, "activation figure"),
        (("result", "target_device", "memory"), "12GiB", "does not fit"),
        (("result", "fits"), False, "result.fits"),
        (("result", "oom"), True, "result.oom is true"),
        (("x-estimate",), DELETE, "a sum of ledger components is not a peak"),
        (("x-estimate", "target"), "cpu", "x-estimate models the CPU's kernels"),
    ],
)
def test_what_holds_a_ledger_below_candidate(path: tuple[str, ...], value: Any, reason: str) -> None:
    status, reasons = status_of(with_change(candidate, path, value))
    assert status == "CALCULATED"
    assert any(reason in r for r in reasons), reasons


def test_a_measured_pilot_peak_fits_decision_uses_the_measurement() -> None:
    d = with_change(candidate, ("metrics",), {"peak_allocated": measured("20GiB")})
    d["software"] = intake_sections()["software"]
    d["measurement"] = {"device": "cuda"}
    assert status_of(d)[0] == "CANDIDATE"
    d["metrics"]["device_peak"] = measured("25GiB")  # the device-level peak is the one that must fit
    status, reasons = status_of(d)
    assert status == "CALCULATED" and any("metrics.device_peak" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("target", "fits"),
    [
        ("24GiB", True),  # 25,769,803,776 B >= 23.5 GiB
        ("24GB", False),  # 24,000,000,000 B <  23.5 GiB = 25,232,932,864 B
        ("25232932864", True),  # exactly the peak: fits
        ("25232932863B", False),
        ("25.3GB", True),
        ("25.2GB", False),
    ],
)
def test_decimal_and_binary_units_in_the_fit_decision(target: str, fits: bool) -> None:
    d = candidate()
    d["metrics"] = {"device_peak": measured("23.5GiB")}
    d["measurement"] = {"device": "cuda"}
    d["result"]["target_device"]["memory"] = target
    status, reasons = status_of(d)
    assert status == ("CANDIDATE" if fits else "CALCULATED"), reasons


def test_the_predicted_peak_decides_the_fit() -> None:
    d = candidate()
    d["result"]["target_device"]["memory"] = 18 * GiB
    assert status_of(d)[0] == "CANDIDATE"
    d["result"]["target_device"]["memory"] = 18 * GiB - 1
    assert status_of(d)[0] == "CALCULATED"


@pytest.mark.parametrize(
    "temporary", [None, {"value": "1GiB", "source": "ASSUMPTION", "note": "overhead"}, calc(GiB, "my own formula")]
)
def test_a_sum_of_components_is_never_a_peak(temporary: Any) -> None:
    """Spec: the subtotal is not the peak; components + an assumed overhead is the shortcut the method refuses."""
    d = with_change(candidate, ("x-estimate",), DELETE)
    if temporary is not None:
        d["ledger"]["temporary"] = temporary
    status, reasons = status_of(d)
    assert status == "CALCULATED"
    assert any("not a peak" in r and "ledgerspec estimate" in r for r in reasons), reasons


def test_assumption_in_an_intake_field_caps_at_candidate() -> None:
    d = with_change(validated, ("method", "alpha"), {"value": 32, "source": "ASSUMPTION", "note": "trainer default"})
    status, reasons = status_of(d)
    assert status == "CANDIDATE"
    assert any("ASSUMPTION" in r and "method.alpha" in r for r in reasons), reasons


def test_a_bare_count_in_an_intake_section_counts_as_an_assumption() -> None:
    status, reasons = status_of(with_change(validated, ("method", "trainable_parameters"), 8388608))
    assert status == "CANDIDATE"
    assert any("method.trainable_parameters" in r for r in reasons), reasons


def test_assumption_in_an_intake_field_does_not_lower_calculated() -> None:
    d = with_change(calculated, ("adapter", "dtype"), {"value": "float32", "source": "ASSUMPTION", "note": "PEFT"})
    assert status_of(d)[0] == "CALCULATED"


# -- VALIDATED -----------------------------------------------------------------------------------

PHASE_KEYS = [
    "after_load",
    "after_adapter_injection",
    "after_optimizer_init",
    "forward_peak",
    "backward_peak",
    "optimizer_step_peak",
    "steady_state_peak",
]


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        *[(("phases", k), DELETE, f"phases.{k}") for k in PHASE_KEYS],
        *[(("phases", k), calc(14 * GiB), f"phases.{k}") for k in ("forward_peak", "steady_state_peak")],
        *[(("metrics", k), DELETE, f"metrics.{k}") for k in ("peak_allocated", "peak_reserved", "device_peak")],
        (("result", "oom"), DELETE, "result.oom"),
        (("measurement", "steps"), 1, "measurement.steps"),
        (("measurement", "steps"), DELETE, "measurement.steps"),
        *[(("software", k), DELETE, f"software.{k}") for k in ("torch", "transformers", "peft")],
        (("software", "cuda"), DELETE, "software.cuda or software.rocm"),
        (("comparison",), DELETE, "comparison"),
        (("comparison", "known_explanation"), DELETE, "known_explanation"),
        (("software", "trl"), "UNKNOWN", "software.trl"),
        (("workload", "packing"), "CONFIGURATION-SPECIFIC", "workload.packing"),
        (("measurement", "device"), "cpu", "cpu"),
        (("measurement", "device"), DELETE, "measurement.device"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_what_holds_a_measured_ledger_below_validated(path: tuple[str, ...], value: Any, reason: str) -> None:
    status, reasons = status_of(with_change(validated, path, value))
    assert status == "CANDIDATE"
    assert any(reason in r for r in reasons), reasons


def test_rocm_stands_in_for_cuda() -> None:
    d = validated()
    del d["software"]["cuda"]
    d["software"]["rocm"] = "6.4"
    assert status_of(d)[0] == "VALIDATED"


def test_a_cpu_measurement_never_validates_even_when_complete() -> None:
    d = with_change(validated, ("measurement", "device"), "cpu")
    status, reasons = status_of(d)
    assert status == "CANDIDATE"
    assert reasons == ["measurement.device is cpu: a CPU run never validates GPU memory"]


def test_qlora_needs_the_bitsandbytes_version_to_validate() -> None:
    d = validated()
    d["method"]["kind"] = "QLoRA"
    d["base_model"] = {"loaded_dtype": "bfloat16", "quantized": True, "quantization": dict(QUANT)}
    status, reasons = status_of(d)
    assert status == "CANDIDATE" and any("software.bitsandbytes" in r for r in reasons), reasons
    d["software"]["bitsandbytes"] = "0.50.2"
    assert status_of(d)[0] == "VALIDATED"


# -- several GPUs: memory is per rank ------------------------------------------------------------


def multi_gpu(per_rank: Any) -> dict[str, Any]:
    d = validated()
    d["parallelism"] = {
        "gpu_count": 2,
        "strategy": "ddp",
        "parameter_placement": "replicated",
        "gradient_placement": "replicated",
        "optimizer_placement": "replicated",
    }
    if per_rank is not DELETE:
        d["parallelism"]["per_rank_peak"] = per_rank
    return d


@pytest.mark.parametrize(
    ("per_rank", "expected"),
    [
        ([measured("15GiB"), measured("15.5GiB")], "VALIDATED"),
        (DELETE, "CANDIDATE"),
        ([measured("15GiB")], "CANDIDATE"),  # one figure for two ranks
        ([measured("15GiB"), calc(15 * GiB)], "CANDIDATE"),  # one rank not measured
        ([measured("15GiB"), "UNKNOWN"], "CANDIDATE"),
        (measured("30.5GiB"), "CANDIDATE"),  # a single total summed across GPUs
        ([measured("15GiB"), {"value": "15GiB", "source": "ASSUMPTION", "note": "same as rank 0"}], "CANDIDATE"),
    ],
    ids=["one-measured-per-rank", "missing", "too-few", "one-calculated", "one-unknown", "summed-total", "one-assumed"],
)
def test_several_gpus_need_one_measured_peak_per_rank(per_rank: Any, expected: str) -> None:
    status, reasons = status_of(multi_gpu(per_rank))
    assert status == expected
    if expected == "CANDIDATE":
        assert any("per_rank_peak" in r for r in reasons), reasons


# -- activation offload --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({}, "CANDIDATE"),
        ({"host_peak": measured("30GiB")}, "CANDIDATE"),
        ({"step_time_s": measured(4.2)}, "CANDIDATE"),
        ({"host_peak": calc(30 * GiB), "step_time_s": measured(4.2)}, "CANDIDATE"),
        ({"host_peak": measured("30GiB"), "step_time_s": measured(4.2)}, "VALIDATED"),
    ],
)
def test_activation_offload_needs_host_peak_and_step_time(metrics: dict[str, Any], expected: str) -> None:
    d = validated()
    d["memory_options"].update({"activation_offload": "ON", "offload_mode": "async, pinned"})
    d["metrics"].update(metrics)
    status, reasons = status_of(d)
    assert status == expected
    if expected == "CANDIDATE":
        assert any("activation offload" in r for r in reasons), reasons


def test_offload_off_needs_neither() -> None:
    d = validated()
    d["memory_options"]["activation_offload"] = "OFF"
    assert status_of(d)[0] == "VALIDATED"


# -- the examples --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("14b-qlora.intake.yaml", "INSUFFICIENT DATA"),
        ("llama-2-7b-lora.intake.yaml", "INSUFFICIENT DATA"),
        ("llama-2-7b-qlora.intake.yaml", "INSUFFICIENT DATA"),
        ("llama-2-7b-lora.ledger.yaml", "CALCULATED"),
        ("downgraded.ledger.yaml", "CANDIDATE"),
        ("naive-article-audit.ledger.yaml", "INSUFFICIENT DATA"),
    ],
)
def test_example_supported_status(name: str, expected: str) -> None:
    assert supported_status(load(EXAMPLES / name)).status == expected


# -- the optimizer name: bits and paged must follow from it or be given ----------------------------


@pytest.mark.parametrize(
    ("optimizer", "gap"),
    [
        ({"name": "adamw_torch"}, None),
        ({"name": "paged_adamw_8bit"}, None),
        ({"name": "Lion_8bit"}, None),  # names are case-insensitive
        ({"name": "adamw_9bit"}, "did you mean 'adamw_8bit'?"),
        ({"name": "adamw_9bit", "bits": 8}, None),
        ({"name": "galore_adamw"}, "optimizer.bits does not follow from it"),
        ({"name": "galore_adamw", "bits": 32}, None),
        ({"name": "adamw_apex_8bit"}, None),  # 8 bits follow from the name
    ],
)
def test_an_unknown_optimizer_name_needs_its_bits(optimizer: dict[str, Any], gap: str | None) -> None:
    status, reasons = status_of(with_change(calculated, ("optimizer",), optimizer))
    if gap is None:
        assert status == "CALCULATED", reasons
    else:
        assert status == "INSUFFICIENT DATA"
        assert any(gap in r and "is not a known optimizer" in r for r in reasons), reasons


# -- the declared stack ----------------------------------------------------------------------------


def _on_another_stack(accepted: list[str] | None = None) -> dict[str, Any]:
    """A CANDIDATE ledger whose estimate ran bitsandbytes >= 0.43.2 while it declares 0.42.0."""
    d = candidate()
    d.setdefault("software", {})["bitsandbytes"] = "0.42.0"
    d["x-estimate"]["differences"] = {"bitsandbytes-4bit-matmul-input": {"computed_as": "newer", "bytes": 1 << 20}}
    if accepted is not None:
        d["software"]["accepted_differences"] = accepted
    return d


def test_figures_computed_on_another_stack_hold_below_candidate() -> None:
    status, reasons = status_of(_on_another_stack())
    assert status == "CALCULATED"
    assert any("bitsandbytes-4bit-matmul-input" in r for r in reasons), reasons


def test_an_accepted_stack_difference_no_longer_holds() -> None:
    assert status_of(_on_another_stack(["bitsandbytes-4bit-matmul-input"]))[0] == "CANDIDATE"


def test_a_declared_version_on_the_computed_side_holds_nothing() -> None:
    d = _on_another_stack()
    d["software"]["bitsandbytes"] = "0.43.2"
    assert status_of(d)[0] == "CANDIDATE"


# -- the estimate's device-level prediction (issue 23) ------------------------------------------------------------


def device_level(device_peak: int, memory: int = 24 * GiB, **verdict: Any) -> dict[str, Any]:
    """``candidate()`` with the device-level figures ``estimate`` writes when a verdict is asked."""
    d = candidate()
    d["result"]["target_device"]["memory"] = memory
    d["x-estimate"].update(
        {
            "peak_reserved": calc(device_peak - GiB, "allocator model"),
            "outside_allocator": {"value": GiB, "source": "ASSUMPTION", "note": "catalogue"},
            "device_peak": {"value": device_peak, "source": "ASSUMPTION", "note": "reserved + outside"},
            "verdict": {
                "compared": "x-estimate.device_peak",
                "device_memory": memory,
                "alloc_conf": "",
                "named_by": "result.target_device.name",
                "device": "RTX 4090",
                "outside_from": "catalogue",
                **verdict,
            },
        }
    )
    return d


def test_the_device_level_prediction_decides_the_fit_when_it_holds_for_the_declared_device() -> None:
    """The allocated peak (18 GiB) fits 24 GiB; the device-level peak decides: 23 GiB fits, 25 GiB does not."""
    assert status_of(device_level(23 * GiB))[0] == "CANDIDATE"
    status, reasons = status_of(device_level(25 * GiB))
    assert status == "CALCULATED"
    assert any("best peak (x-estimate.device_peak)" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("result", "target_device", "memory"), 40 * GiB),  # another device memory
        (("software", "pytorch_cuda_alloc_conf"), "expandable_segments:True"),  # other allocator settings
        (("outside_allocator",), {"total": measured("700MiB")}),  # a measured figure outside the allocator since
        (("result", "target_device", "name"), "A100 40GB"),  # another device named
    ],
)
def test_a_device_level_prediction_for_other_settings_falls_back_to_the_allocated_peak(
    path: tuple[str, ...], value: Any
) -> None:
    d = device_level(25 * GiB)
    node = d
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    res = supported_status(from_text(json.dumps(d)))
    assert res.best_peak_from == "x-estimate.peak_allocated" and res.best_peak == 18 * GiB


# -- declared kernels (issue 25) -------------------------------------------------------------------------------------


def test_a_predicted_peak_of_a_step_with_an_unmodelled_kernel_is_not_candidate() -> None:
    """The estimate ran transformers' own op where the run uses a kernel it does not model: its peak is not the
    declared step's (LS013); a modelled kernel, or a MEASURED peak (the run itself), holds nothing."""
    assert status_of(candidate())[0] == "CANDIDATE"
    status, reasons = status_of(with_change(candidate, ("software", "kernels"), {"other": ["unsloth"]}))
    assert status == "CALCULATED"
    assert reasons == [
        "CANDIDATE needs a prediction of the declared step: the estimate does not model unsloth (software.kernels, "
        "LS013); measure the run, or declare the kernels the estimate models"
    ]
    modelled = {"cross_entropy": "liger_fused_linear_cross_entropy", "norm": "liger_rms_norm"}
    assert status_of(with_change(candidate, ("software", "kernels"), modelled))[0] == "CANDIDATE"
    run = with_change(candidate, ("software", "kernels"), {"lora_projections": ["fms_fused_lora"]})
    run["metrics"] = {"peak_allocated": measured(20 * GiB)}
    assert status_of(run)[0] == "CANDIDATE"


def test_a_device_verdict_at_the_edge_holds_candidate() -> None:
    """A predicted device-level peak that completes only with the outside-allocator catalogue's typical figure (the
    estimate's replay with the catalogue's high figure ran out: ``x-estimate.verdict.uncertain``) does not fit: the
    status stays CALCULATED (even beside ``result.fits: false``, which the estimate writes then), and the reason says
    what would decide it. A verdict that no longer holds
    (predicted for another device memory) holds nothing: the allocated peak is compared instead."""
    text = (EXAMPLES / "llama-2-7b-lora.estimated.ledger.yaml").read_text()
    assert supported_status(from_text(text)).status == "CANDIDATE"
    assert "\n    uncertain: false\n" in text  # the bundled estimate's own device verdict, not at the edge
    uncertain = text.replace("\n    uncertain: false\n", "\n    uncertain: true\n", 1)
    res = supported_status(from_text(uncertain))
    assert res.best_peak_from == "x-estimate.device_peak" and res.status == "CALCULATED"
    assert any("AT THE EDGE" in h and "measure outside_allocator" in h for h in res.reasons)
    written = supported_status(from_text(uncertain.replace("  fits: true\n", "  fits: false\n", 1)))
    assert written.status == "CALCULATED" and any("AT THE EDGE" in h for h in written.reasons)
    assert supported_status(from_text(uncertain.replace("uncertain: true", "uncertain: false"))).status == "CANDIDATE"
    stale = uncertain.replace("    device_memory: 25769803776", "    device_memory: 85899345920", 1)
    assert supported_status(from_text(stale)).status == "CANDIDATE"
