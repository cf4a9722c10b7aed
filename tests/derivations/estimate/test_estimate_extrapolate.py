"""Layer extrapolation agrees with a full trace (several architectures, checkpointing on and off)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from ledgerspec.derivations.estimate.estimator import estimate
from ledgerspec.derivations.estimate.extrapolate import extend, layer_period, plan, with_layers
from tests.support.estimate_docs import ledger

# Gemma2 soft-caps attention logits, which SDPA refuses: it trains with eager or FlashAttention-2. Each architecture
# with checkpointing off and on; gradient accumulation (2 micro-steps: the second's backward runs beside the first's
# gradients) on one of the two, alternating, so that it meets every architecture and both checkpointing settings
# (the extrapolation extends each figure alike whatever the protocol ran; all ten combinations traced with
# accumulation 2 cost twice the forward and backward windows)
CASES = [
    ("tiny-llama-gqa", "sdpa", False, 2),
    ("tiny-llama-gqa", "sdpa", True, 1),
    ("tiny-qwen2", "sdpa", False, 1),
    ("tiny-qwen2", "sdpa", True, 2),
    ("tiny-mistral", "sdpa", False, 2),
    ("tiny-mistral", "sdpa", True, 1),
    ("tiny-gemma2", "eager", False, 1),
    ("tiny-gemma2", "eager", True, 2),
    ("tiny-gemma2", "flash_attention_2", False, 2),
    ("tiny-gemma2", "flash_attention_2", True, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "attention", "checkpointing", "accumulation"),
    [pytest.param(*c, id=f"{c[0]}-{c[1]}-{'ckpt' if c[2] else 'no-ckpt'}-accum{c[3]}") for c in CASES],
)
def test_extrapolation_matches_full_trace(arch: str, attention: str, checkpointing: bool, accumulation: int) -> None:
    # seq 128 > the sliding window (64) of Mistral and Gemma2: their masks and kernels differ by layer type
    doc = ledger(arch=arch, attention=attention, checkpointing=checkpointing, seq=128, accumulation=accumulation)
    fast = estimate(doc, layers="auto")
    full = estimate(doc, layers="full")
    assert fast.plan.probes is not None and full.plan.probes is None
    for phase, value in full.phases.items():
        assert abs(fast.phases[phase] - value) <= 0.005 * value, phase
    assert abs(fast.activations - full.activations) <= 0.005 * full.activations
    assert fast.components == full.components


def test_period_follows_layer_types() -> None:
    from transformers import Gemma2Config, LlamaConfig

    assert layer_period(LlamaConfig(num_hidden_layers=32)) == 1
    assert layer_period(Gemma2Config(num_hidden_layers=42)) == 2


@pytest.mark.parametrize(("layers", "period", "probes"), [(32, 1, (2, 3)), (42, 2, (4, 6)), (3, 1, None)])
def test_probes_hold_whole_periods(layers: int, period: int, probes: tuple[int, int] | None) -> None:
    from transformers import Gemma2Config, LlamaConfig

    cfg: Any = (Gemma2Config if period == 2 else LlamaConfig)(num_hidden_layers=layers)
    assert plan(cfg).probes == probes


def test_with_layers_truncates_the_pattern() -> None:
    from transformers import Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=42)
    small = with_layers(cfg, 6)
    assert small.num_hidden_layers == 6 and small.layer_types == (cfg.layer_types or [])[:6]
    assert cfg.num_hidden_layers == 42  # the original is untouched


def test_irregular_stacks_are_traced_in_full() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=32)
    cfg.first_k_dense_replace = 3  # DeepSeek-style: dense layers first, MoE after
    assert plan(cfg).probes is None


@pytest.mark.parametrize(("v1", "v2", "n1", "n2", "n", "want"), [(10, 13, 2, 3, 32, 100), (100, 140, 4, 6, 42, 860)])
def test_extend_is_affine(v1: int, v2: int, n1: int, n2: int, n: int, want: int) -> None:
    assert extend(v1, v2, n1, n2, n) == want
