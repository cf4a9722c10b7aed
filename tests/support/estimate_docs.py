"""Ledger texts for the estimate tests: tiny real-architecture configs under tests/data/estimate/."""

from __future__ import annotations

from ledgerspec.contract.document import Document, from_text
from tests.support import TESTS

DATA = TESTS / "data" / "estimate"
ARCHS = ("tiny-llama-gqa", "tiny-qwen2", "tiny-mistral", "tiny-gemma2")


def ledger_text(
    arch: str = "tiny-llama-gqa",
    attention: str = "sdpa",
    checkpointing: bool = False,
    dtype: str = "bfloat16",
    microbatch: int = 2,
    seq: int = 128,
    accumulation: int = 1,
    optimizer: str = "adamw_torch",
    targets: str = "[q_proj, v_proj]",
    extra: str = "",
    quant: str | None = None,
    double_quant: bool = True,
    storage: str = "uint8",
    loop: str | None = None,
    mixed_precision: str | None = None,
) -> str:
    """A LoRA ledger; ``quant`` (nf4, fp4) makes it QLoRA with a bfloat16 compute dtype and
    prepare_for_kbit_training; ``loop``/``mixed_precision`` declare ``training`` (absent: the Trainer's defaults)."""
    training = {k: v for k, v in (("loop", loop), ("mixed_precision", mixed_precision)) if v is not None}
    training_text = ("training: {" + ", ".join(f"{k}: {v}" for k, v in training.items()) + "}\n") if training else ""
    base = "  quantized: false"
    if quant is not None:
        base = f"""  quantized: true
  prepare_for_kbit_training: true
  quantization:
    type: {quant}
    bits: 4
    double_quant: {str(double_quant).lower()}
    compute_dtype: bfloat16
    storage_dtype: {storage}"""
    return f"""ledgerspec: ledger/v1
status: CALCULATED
title: {arch}, LoRA r=4, {dtype}, {attention}
identity:
  model_id: tests/{arch}
  config_sha256: UNKNOWN
  config_path: {arch}/config.json
software:
  attention_implementation: {attention}
method:
  kind: {"LoRA" if quant is None else "QLoRA"}
  rank: 4
  alpha: 8
  dropout: 0.0
  target_modules: {targets}
  bias: none
base_model:
  loaded_dtype: {dtype}
{base}
adapter:
  dtype: float32
workload:
  max_length: {seq}
  packing: false
  microbatch: {microbatch}
  gradient_accumulation: {accumulation}
optimizer:
  name: {optimizer}
{training_text}memory_options:
  gradient_checkpointing: {str(checkpointing).lower()}
{extra}"""


def ledger(**kwargs: object) -> Document:
    """A document whose path sits in tests/data/estimate/ (config_path resolves there); nothing is written."""
    return from_text(ledger_text(**kwargs), str(DATA / "test.ledger.yaml"))  # type: ignore[arg-type]
