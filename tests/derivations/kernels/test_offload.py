"""Activation offloading (``memory_options.activation_offload``) in the estimate: TRL's hooks move what the step saves
for backward to the host.

The independent side is the same step without offloading: what it saves for backward (its activations figure) is
what the hooks see, so the host holds that much (less what TRL keeps on the device: parameters, tensors under 1 KiB),
and the device no longer does, except the five most recent tensors whose copy may still run.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledgerspec.errors import LedgerspecError
from tests.derivations.kernels.test_estimate_kernels import ledger, run


def offloaded(**kw: Any) -> Any:
    doc = ledger(**kw)
    text = doc.text.replace("memory_options: {", "memory_options: {activation_offload: true, ", 1)
    from ledgerspec.contract.document import from_text

    return from_text(text, "k.ledger.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False])
def test_what_the_step_saves_goes_to_the_host(checkpointing: bool) -> None:
    plain = run(ledger(checkpointing=checkpointing))
    off = run(offloaded(checkpointing=checkpointing))
    host = off.figures["host.offloaded_peak"]
    assert abs(host - plain.activations) <= 0.02 * plain.activations
    assert off.activations < plain.activations  # what stays on the device after forward
    assert off.peak_allocated <= plain.peak_allocated
    if not checkpointing:  # the saved activations dominate the peak: it drops by about a quarter (docs)
        assert off.peak_allocated < 0.8 * plain.peak_allocated
    assert "host.offloaded_peak" not in plain.figures
    assert "activation offloading as TRL's OffloadActivations does it" in off.method


def test_measure_refuses_a_step_it_would_not_offload() -> None:
    from ledgerspec.derivations.measure.measurer import make_request

    with pytest.raises(LedgerspecError, match="does not offload activations"):
        make_request(offloaded(), "cpu", 2, None, None)
