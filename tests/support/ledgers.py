"""Ledgers built as Python dicts, one rung of the status ladder each (the worked cases of the ladder's tests and the
spec's): a test starts from one and changes one thing, so each case shows exactly what it changes."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from ledgerspec.checks.ladder import supported_status
from ledgerspec.contract.document import from_text

GiB = 2**30
#: a value for :func:`with_change` that deletes the key
DELETE = object()

M = {"source": "MEASURED"}


def measured(value: Any) -> dict[str, Any]:
    return {"value": value, **M}


def calc(value: Any, how: str = "by hand") -> dict[str, Any]:
    return {"value": value, "source": "CALCULATED", "method": how}


def intake_sections() -> dict[str, Any]:
    """The minimum intake, complete, for a LoRA run (plus a few non-minimum fields)."""
    return {
        "identity": {"model_id": "meta-llama/Llama-2-7b-hf", "revision": "01c7f73d771dfac7d292323805ebc428287df4f9"},
        "software": {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "cuda": "12.8"},
        "method": {
            "kind": "LoRA",
            "rank": 16,
            "alpha": 32,
            "target_modules": ["q_proj", "v_proj"],
            "trainable_parameters": calc(8388608),
        },
        "base_model": {"loaded_dtype": "bfloat16"},
        "adapter": {"dtype": "float32"},
        "workload": {"max_length": 2048, "sequence_p50": 612, "sequence_p95": 1730, "packing": False, "microbatch": 1},
        "optimizer": {"name": "adamw_torch"},
        "memory_options": {"gradient_checkpointing": True},
    }


def calculated() -> dict[str, Any]:
    return {
        "ledgerspec": "ledger/v1",
        **intake_sections(),
        "gradients": {"parameters": calc(8388608), "dtype": "float32"},
        "ledger": {
            "frozen_base": calc(13476831744),
            "adapter": calc(33554432),
            "gradients": calc(33554432),
            "optimizer": calc(67108864),
        },
    }


def candidate() -> dict[str, Any]:
    d = calculated()
    d["ledger"]["activations"] = calc(2 * GiB, "ledgerspec estimate")
    d["x-estimate"] = {"peak_allocated": calc(18 * GiB, "ledgerspec estimate")}
    d["result"] = {"target_device": {"name": "RTX 4090", "memory": "24GiB"}}
    return d


def validated() -> dict[str, Any]:
    d = candidate()
    d["ledger"]["activations"] = measured(2 * GiB)
    d["ledger"]["temporary"] = measured(GiB // 2)
    d["phases"] = {
        k: measured(v * GiB)
        for k, v in (
            ("after_load", 13),
            ("after_adapter_injection", 13),
            ("after_optimizer_init", 13),
            ("forward_peak", 14),
            ("backward_peak", 15),
            ("optimizer_step_peak", 15),
            ("steady_state_peak", 15),
        )
    }
    d["metrics"] = {
        "peak_allocated": measured("15GiB"),
        "peak_reserved": measured("16GiB"),
        "device_peak": measured("16.5GiB"),
    }
    d["comparison"] = {
        "calculated_subtotal": calc(13611049472),
        "measured_peak": measured("15GiB"),
        "known_explanation": "activations of one microbatch and the cuBLAS workspace",
    }
    d["measurement"] = {"device": "cuda", "device_name": "NVIDIA GeForce RTX 4090", "steps": 3}
    d["result"]["oom"] = False
    return d


def status_of(d: dict[str, Any]) -> tuple[str, list[str]]:
    res = supported_status(from_text(json.dumps(d), "<case>"))
    return res.status, res.reasons


def with_change(base: Callable[[], dict[str, Any]], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``base()`` with ``path`` set to ``value`` (``DELETE`` removes it)."""
    d = copy.deepcopy(base())
    node = d
    for part in path[:-1]:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return d
