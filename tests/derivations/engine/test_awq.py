"""An AWQ base in the training step (``ledgerspec.derivations.engine.awq``), against AutoAWQ's own GEMM layer and a
real CPU run.

- The layer: its buffers and what its forward/backward allocate and keep (its input kept for backward, the weight
  dequantized, the batch-size copy of it in backward), alone and under PEFT's ``AwqLoraLinear``, equal to AutoAWQ's
  ``WQLinear_GEMM`` run from its source file (:mod:`tests.truths.awq_upstream`), counted by PyTorch's ``MemTracker``.
- The step: the estimate (fake tensors) equals a real CPU measurement of the same step, byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from ledgerspec.contract.document import from_text
from ledgerspec.errors import LedgerspecError
from tests.support.estimate_docs import DATA

LAYERS = [  # group size, in, out, bias
    (128, 256, 512, False),
    (64, 512, 256, True),
    (32, 160, 64, False),
]


@pytest.fixture(scope="module")
def upstream() -> dict[str, Any]:
    from tests.truths.awq_upstream import upstream as load

    return load()


def _ours(group: int, i: int, o: int, bias: bool) -> Any:
    from ledgerspec.derivations.engine.awq import quant_linear_class

    return quant_linear_class()(i, o, 4, group, bias)


def _theirs(upstream: dict[str, Any], group: int, i: int, o: int, bias: bool) -> Any:
    layer = upstream["WQLinear_GEMM"](4, group, i, o, bias, "cpu", training=True)
    layer.train()
    return layer


@pytest.mark.parametrize("layer", LAYERS, ids=lambda c: "-".join(map(str, c)))
def test_buffers_are_autoawqs(upstream: dict[str, Any], layer: tuple[Any, ...]) -> None:
    from ledgerspec.derivations.stack.quant_storage import awq_bytes

    group, i, o, _ = layer
    theirs, ours = _theirs(upstream, *layer), _ours(*layer)
    shape = {k: (tuple(v.shape), v.dtype) for k, v in theirs.named_buffers()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.named_buffers()} == shape
    assert awq_bytes(i, o, 4, group).total == sum(v.nbytes for k, v in theirs.named_buffers() if k != "bias")


def _run(module: Any, in_features: int, lora: bool, batch: int = 2, rows: int = 600) -> tuple[int, int, int]:
    """(forward peak, forward + backward peak, bytes saved for backward) of a (batch, rows, in) float16 input by
    PyTorch's MemTracker and autograd's saved-tensor hooks (the module's own tensors not counted as saved; the input
    is: the AWQ kernel keeps it)."""
    import torch
    from peft import LoraConfig
    from peft.tuners.lora.awq import AwqLoraLinear
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    x = torch.randn(batch, rows, in_features, dtype=torch.float16, requires_grad=True)
    if lora:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1)
        module = AwqLoraLinear(module, "default", config=cfg, r=4, lora_alpha=8)
    own = {t.untyped_storage().data_ptr() for t in [*module.buffers(), *module.parameters()]}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    cpu = torch.device("cpu")
    mt = MemTracker()
    mt.track_external(module, x)
    with mt:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x)
        forward = mt.get_tracker_snapshot("peak")[cpu]["Total"]
        y.float().sum().backward()
    return forward, mt.get_tracker_snapshot("peak")[cpu]["Total"], sum(saved.values())


@pytest.mark.parametrize("lora", [False, True], ids=["alone", "lora"])
@pytest.mark.parametrize("layer", LAYERS, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_backward_allocate_what_autoawq_does(
    upstream: dict[str, Any], layer: tuple[Any, ...], lora: bool
) -> None:
    i = layer[1]
    theirs = _run(_theirs(upstream, *layer), i, lora)
    assert _run(_ours(*layer), i, lora) == theirs
    if not lora:
        assert theirs[2] == 2 * 600 * i * 2  # WQLinearMMFunction keeps its input for backward


def _text(targets: str = "[q_proj, k_proj, v_proj, o_proj, down_proj]") -> str:
    return f"""ledgerspec: ledger/v1
identity: {{model_id: tests/tiny-mistral, config_path: tiny-mistral/config.json}}
software: {{attention_implementation: sdpa}}
method: {{kind: QLoRA, rank: 4, alpha: 8, dropout: 0.1, target_modules: {targets}}}
base_model:
  loaded_dtype: float16
  quantized: true
  prepare_for_kbit_training: true
  quantization: {{type: awq, bits: 4, blocksize: 32}}
adapter: {{dtype: float32}}
workload: {{max_length: 80, packing: true, microbatch: 2, gradient_accumulation: 1}}
optimizer: {{name: adamw_torch}}
training: {{loop: trainer, mixed_precision: fp16}}
memory_options: {{gradient_checkpointing: true, checkpointing_kind: reentrant}}
"""


@pytest.mark.slow
def test_the_estimate_equals_a_cpu_measurement_of_the_awq_step() -> None:
    """A tiny Mistral, AWQ 4-bit with LoRA (down_proj too), fp16 autocast, checkpointing, 2 x 80 tokens (the fused
    GEMM's side of the kernel's 1,024 rows: the input kept and the backward's batch copy of the weight are the same on
    both sides; the dequantizing side is checked layer by layer above, and its step ran equal too at 2 x 600 tokens
    when this was written, 14,896,040 B steady-state peak both ways, too slow for CI)."""
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.fit import PHASES
    from ledgerspec.derivations.measure.measurer import make_request, run_request

    doc = from_text(_text(), str(DATA / "test.ledger.yaml"))
    est = estimate(doc, target="cpu")
    measured = run_request(make_request(doc, "cpu", 2, None, None)).result
    assert {p: est.phases[p] for p in PHASES} == {p: measured.phases[p].figure for p in PHASES}
    assert est.activations == measured.activations_saved


def test_awq_needs_four_bits_and_listed_targets() -> None:
    from ledgerspec.derivations.engine.workload import WorkloadSpec

    spec = WorkloadSpec.from_document(from_text(_text(), str(DATA / "test.ledger.yaml")))
    assert spec.gptq is not None and spec.gptq.scheme == "awq" and spec.gptq.kernel == "gemm"
    with pytest.raises(LedgerspecError, match="4 bits, not 8"):
        WorkloadSpec.from_document(from_text(_text().replace("bits: 4", "bits: 8"), str(DATA / "test.ledger.yaml")))
    with pytest.raises(LedgerspecError, match="in an AWQ model"):
        WorkloadSpec.from_document(from_text(_text("all-linear"), str(DATA / "test.ledger.yaml")))
