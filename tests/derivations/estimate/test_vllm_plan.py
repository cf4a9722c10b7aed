"""GRPO with vLLM in server mode is traced at full depth: vLLM's packed weight transfer concatenates the whole
parameter list into chunks of just over 1 GiB (two in flight), so its chunks, and the generation peak they can set,
are not affine in the number of layers; two shallow probes extended linearly gave a negative generation peak for the
8B example (-378,518,016 B) before this rule. Colocate mode has no packing (each parameter is handed to vLLM's
``load_weights``): its probes stay."""

from __future__ import annotations

import pytest

from ledgerspec.contract.document import from_text
from tests.support import EXAMPLES

pytest.importorskip("torch")

EXAMPLE = EXAMPLES / "objectives" / "llama-3.1-8b-lora-grpo.ledger.yaml"
SETTINGS = "  objective_settings: {num_generations: 8, max_completion_length: 512}\n"


def _plan(extra: str) -> object:
    from ledgerspec.derivations.estimate.estimator import prepare

    text = EXAMPLE.read_text(encoding="utf-8")
    assert SETTINGS in text
    text = text.replace(SETTINGS, SETTINGS.replace("512}", f"512{extra}}}"))
    return prepare(from_text(text, str(EXAMPLE)), "cuda").plan


def test_server_mode_is_traced_in_full_and_colocate_keeps_its_probes() -> None:
    plain, server, colocate = (_plan(""), _plan(", use_vllm: true, vllm_mode: server"), _plan(", use_vllm: true"))
    assert plain.probes is not None and colocate.probes == plain.probes  # type: ignore[attr-defined]
    assert server.probes is None and "packed weight transfer" in server.reason  # type: ignore[attr-defined]
