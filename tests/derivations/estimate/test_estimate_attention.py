"""The CUDA attention memory model: which kernel, and exactly which tensors it keeps and allocates."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ledgerspec.derivations.engine.tracker import MemoryTracker  # noqa: E402
from ledgerspec.derivations.estimate import attention as am  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    ("dtype", "head_dim", "mask", "grouped", "kernel", "repeat"),
    [
        (BF16, 128, False, False, "flash", False),
        (FP16, 128, False, True, "flash", False),  # enable_gqa: no repeat_kv
        (BF16, 128, True, True, "efficient", True),  # a mask: transformers repeats k/v, flash is out
        (FP32, 64, False, False, "efficient", False),  # flash has no fp32
        (BF16, 320, False, False, "efficient", False),  # flash needs head dim <= 256
        (FP32, 64, False, True, "math", False),  # GQA, fp32: neither fused kernel takes it
    ],
)
def test_sdpa_kernel_choice(dtype: Any, head_dim: int, mask: bool, grouped: bool, kernel: str, repeat: bool) -> None:
    choice = am.choose_sdpa_kernel(dtype, head_dim, mask, grouped, 0.0)
    assert (choice.kernel, choice.repeat_kv) == (kernel, repeat)


class _Module(torch.nn.Module):  # type: ignore[name-defined]
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _qkv(b: int, h: int, hk: int, s: int, d: int, dtype: Any = BF16) -> tuple[Any, Any, Any]:
    q = torch.zeros(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.zeros(b, hk, s, d, dtype=dtype, requires_grad=True)
    v = torch.zeros(b, hk, s, d, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(("b", "h", "hk", "s", "d"), [(1, 8, 8, 256, 64), (2, 8, 2, 200, 64), (1, 4, 1, 130, 96)])
def test_flash_keeps_output_and_logsumexp(b: int, h: int, hk: int, s: int, d: int) -> None:
    q, k, v = _qkv(b, h, hk, s, d)
    with MemoryTracker() as tr:
        before = tr.current
        out, _ = am._flash_model(_Module(h // hk), q, k, v, None)
        kept = tr.current - before
    # forward keeps: the bf16 output (b, s, h, d) and the fp32 log-sum-exp (b, h, s); q, k, v are the caller's
    assert kept == b * s * h * d * 2 + b * h * s * 4
    assert out.shape == (b, s, h, d)


@pytest.mark.parametrize(("b", "h", "hk", "s", "d"), [(1, 8, 8, 256, 64), (2, 8, 2, 200, 64), (1, 4, 1, 130, 96)])
def test_flash_backward_buffers(b: int, h: int, hk: int, s: int, d: int) -> None:
    q, k, v = _qkv(b, h, hk, s, d)
    with MemoryTracker() as tr:  # forward inside the tracker: it must know the saved tensors
        out, _ = am._flash_model(_Module(h // hk), q, k, v, None)
        grad = torch.zeros_like(out)
        tr.reset_peak()
        base = tr.current
        out.backward(grad)
        transient = tr.peak - base
    s_r = -(-s // 128) * 128
    d_r = -(-d // 32) * 32
    grads = (b * h * s * d + 2 * b * hk * s * d) * 2  # dq, dk, dv in bf16
    softmax_d = b * h * s_r * 4  # fp32
    dq_accum = b * s_r * h * d_r * 4  # fp32
    expanded = 2 * b * s * h * d * 2 if hk != h else 0  # GQA dk/dv before the head sum
    assert transient == grads + softmax_d + dq_accum + expanded


def test_sdpa_with_mask_repeats_kv_and_uses_padded_logsumexp() -> None:
    b, h, hk, s, d = 1, 8, 2, 100, 64
    with MemoryTracker() as tr:  # inputs made inside the tracker: views of them are not new storages
        q, k, v = _qkv(b, h, hk, s, d)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool)
        before = tr.current
        _out, _ = am._sdpa_model(_Module(h // hk), q, k, v, mask)  # the output stays alive
        kept = tr.current - before
    repeated = 2 * b * h * s * d * 2  # repeat_kv materialises k and v with all heads
    lse = b * h * 128 * 4  # memory-efficient: padded to a multiple of 32 (100 -> 128)
    bias = b * 1 * s * 104 * 2  # the bool mask as a bf16 additive bias, key dim padded to a multiple of 8, saved
    assert kept == repeated + b * s * h * d * 2 + lse + bias


def test_math_kernel_materialises_scores() -> None:
    b, h, s, d = 1, 4, 64, 16
    q, k, v = _qkv(b, h, 1, s, d, FP32)
    with MemoryTracker() as tr:
        tr.reset_peak()
        before = tr.current
        am._sdpa_model(_Module(h), q, k, v, None)
        peak = tr.peak - before
    assert peak >= b * h * s * s * 4  # at least one fp32 score matrix


def test_softcap_under_sdpa_is_refused() -> None:
    q, k, v = _qkv(1, 2, 2, 8, 8)
    with pytest.raises(am.UnsupportedAttention, match="soft-capping"):
        am._sdpa_model(_Module(1), q, k, v, None, softcap=50.0)


def _tiny_llama(impl: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=128,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=BF16)


@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2", "eager"])
def test_context_routes_attention_and_restores(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama("eager" if impl == "eager" else "sdpa")
    calls: list[str] = []
    original = am._fused().apply

    def spy(*args: Any) -> Any:
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(am._fused(), "apply", spy)
    with am.cuda_attention(model, impl) as key:
        model(input_ids=torch.zeros(1, 16, dtype=torch.long)).logits.sum().backward()
        assert model.config._attn_implementation == key
    assert model.config._attn_implementation == ("eager" if impl == "eager" else "sdpa")
    assert calls == ([] if impl == "eager" else ["flash", "flash"])  # one call per layer


def test_unknown_implementation_is_refused() -> None:
    with (
        pytest.raises(am.UnsupportedAttention, match="flex_attention"),
        am.cuda_attention(_tiny_llama("sdpa"), "flex_attention"),
    ):
        pass
