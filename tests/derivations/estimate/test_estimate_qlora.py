"""4-bit layers under fake tensors: the stand-in stores what bitsandbytes stores and allocates its temporaries."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from ledgerspec.derivations.engine.tracker import MemoryTracker, quant_state_tensors  # noqa: E402
from ledgerspec.derivations.estimate.qlora import fake_4bit_linear_class, model_4bit_layers  # noqa: E402


def _real_bytes(out_f: int, in_f: int, double: bool, quant_type: str) -> int:
    """Quantize a real weight with bitsandbytes on the CPU and count every tensor it keeps."""
    layer = bnb.nn.Linear4bit(
        in_f,
        out_f,
        bias=False,
        compute_dtype=torch.bfloat16,
        compress_statistics=double,
        quant_type=quant_type,
        device="meta",
    )
    dense = torch.randn(out_f, in_f, dtype=torch.bfloat16)
    w = bnb.nn.Params4bit(
        dense, requires_grad=False, compress_statistics=double, quant_type=quant_type, module=layer
    )._quantize("cpu")
    storages = {w.untyped_storage()._cdata: w.untyped_storage().nbytes()}
    for t in quant_state_tensors(w.quant_state):
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _fake_layer(out_f: int, in_f: int, double: bool, quant_type: str) -> Any:
    src = bnb.nn.Linear4bit(
        in_f,
        out_f,
        bias=False,
        compute_dtype=torch.bfloat16,
        compress_statistics=double,
        quant_type=quant_type,
        device="meta",
    )
    return fake_4bit_linear_class()(src, torch.bfloat16)


@pytest.mark.parametrize("double", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize(
    ("out_f", "in_f"), [(4096, 4096), pytest.param(11008, 4096, marks=pytest.mark.slow), (320, 192), (257, 64)]
)
def test_storage_equals_bitsandbytes(out_f: int, in_f: int, double: bool) -> None:
    fake = _fake_layer(out_f, in_f, double, "nf4").to_empty(device="cpu")
    held = sum(t.untyped_storage().nbytes() for t in [*fake.parameters(), *fake.buffers()])
    assert held == _real_bytes(out_f, in_f, double, "nf4")


@pytest.mark.parametrize("double", [False, True])
def test_forward_and_backward_temporaries(double: bool) -> None:
    out_f, in_f, rows = 512, 256, 2048
    layer = _fake_layer(out_f, in_f, double, "nf4").to_empty(device="cpu")
    x = torch.zeros(rows, in_f, dtype=torch.bfloat16, requires_grad=True)
    with MemoryTracker() as tr:
        base = tr.current
        y = layer(x)
        fwd = tr.peak - base
        kept = tr.current - base
        grad = torch.zeros_like(y)
        tr.reset_peak()
        before = tr.current
        y.backward(grad)
        bwd = tr.peak - before
    nblocks = out_f * in_f // 64
    dense = out_f * in_f * 2  # the dequantized bf16 weight
    absmax = 2 * nblocks * 4 if double else 0  # nested absmax dequantized to fp32, then + offset
    assert kept == rows * out_f * 2  # only the output: nothing saved for backward
    assert fwd == kept + dense + absmax
    assert bwd == dense + (nblocks * 4 if double else 0) + rows * in_f * 2  # dequantized weight + grad input


def test_replaces_every_4bit_linear() -> None:
    model = torch.nn.Sequential(
        bnb.nn.Linear4bit(64, 64, bias=False, device="meta"),
        torch.nn.Linear(64, 64, device="meta"),
        bnb.nn.Linear4bit(64, 32, bias=False, device="meta"),
    )
    assert model_4bit_layers(model, torch.bfloat16) == 2
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Fake4bitLinear", "Linear", "Fake4bitLinear"]
