"""transformers < 4.52's checkpoint around each FSDP1 unit, modelled when a ledger declares it (known difference
``transformers-checkpoint-outside-fsdp-unit``, :mod:`ledgerspec.derivations.shard.fsdp.legacy_checkpoint`).

The ground truth is ``tests/truths/checkpoint_outside_fsdp1_unit.py``: real FSDP1 (gloo, one process) over frozen
units, checkpointed as 4.48.1's loop did and as ``GradientCheckpointingLayer`` does, written without ledgerspec. The
same placement with transformers 4.48.1 itself is measured in benchmarks/results/published-multi-gpu-cpu-repro.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from ledgerspec.contract.document import from_text
from tests.support import TESTS, fresh_python

TRUTH = TESTS / "truths" / "checkpoint_outside_fsdp1_unit.py"
LEDGER = "ledgerspec: ledger/v1\nsoftware: {transformers: '%s'}\n"


@pytest.mark.parametrize(
    ("declared", "modelled"), [("4.48.1", True), ("4.51.3", True), ("4.52.0", False), ("5.2", False)]
)
def test_modelled_only_when_declared_older(declared: str, modelled: bool) -> None:
    from ledgerspec.derivations.shard.fsdp.legacy_checkpoint import models_outside_checkpoint

    assert models_outside_checkpoint(from_text(LEDGER % declared, "x.ledger.yaml")) is modelled
    assert models_outside_checkpoint(from_text("ledgerspec: ledger/v1\n", "x.ledger.yaml")) is False


def _truth(where: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = fresh_python([TRUTH, where], env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_real_fsdp1_keeps_every_input_and_its_gradient_when_checkpointed_outside() -> None:
    """Real tensors: with the checkpoint outside the frozen units, when backward reaches the first block every
    block's input (L) and every later block's input gradient (L - 1) are alive; inside, only the first block's input
    and the gradient arriving at it."""
    pytest.importorskip("torch")
    outside, inside = _truth("outside"), _truth("inside")
    layers = outside["layers"]
    assert outside["at_first_block"] == 2 * layers - 1, outside
    assert inside["at_first_block"] == 2, inside
    assert outside["after"] == inside["after"] == 0  # all released once backward ends


TINY = """ledgerspec: ledger/v1
identity: {{model_id: tiny-llama-uneven, config_path: {config}}}
software: {{transformers: '{transformers}'}}
method: {{kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj]}}
base_model: {{loaded_dtype: float32, quantized: false}}
adapter: {{dtype: float32}}
workload: {{max_length: 64, microbatch: 2}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: true, checkpointing_kind: reentrant}}
parallelism: {{gpu_count: 2, strategy: fsdp1, parameter_placement: sharded, gradient_placement: sharded,
  optimizer_placement: sharded, reshard_after_forward: true}}
"""


@pytest.mark.slow
def test_simulation_holds_the_inputs_and_gradients_of_the_declared_placement(tmp_path: Any) -> None:
    """Fake tensors, a deep narrow Llama (8 layers, vocabulary 64: the layers' states dominate): the simulated FSDP1
    step of a ledger declaring transformers 4.51.3 (checkpoint outside the unit; the loss already 4.49's) peaks in
    backward above the same ledger declaring 4.52.0 by the later layers' input gradients the truth above keeps
    (between L - 2 and 2 L hidden states of the microbatch), and its method says so."""
    pytest.importorskip("peft")
    from ledgerspec.derivations.shard.sharder import shard

    layers, hidden, tokens = 8, 64, 2 * 64
    config = json.loads((TESTS / "data" / "sharding" / "tiny" / "config.json").read_text())
    config.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=128, vocab_size=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    peaks, methods = {}, {}
    for version in ("4.51.3", "4.52.0"):
        doc = from_text(TINY.format(config="config.json", transformers=version), str(tmp_path / "x.ledger.yaml"))
        est = shard(doc, estimate=True, target="cpu").estimate
        assert est is not None
        peaks[version] = max(est.ranks[0].phases[k] for k in ("backward_peak", "steady_state_peak"))
        methods[version] = est.method
    one = tokens * hidden * 4  # one float32 hidden state of the microbatch (fp32 base)
    extra = peaks["4.51.3"] - peaks["4.52.0"]
    assert (layers - 2) * one <= extra <= 2 * layers * one, (peaks, one, extra / one)
    assert "wraps each FSDP1 unit from outside" in methods["4.51.3"]
    assert "wraps each FSDP1 unit from outside" not in methods["4.52.0"]
