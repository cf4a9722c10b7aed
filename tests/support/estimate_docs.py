"""Ledger texts for the estimate tests: tiny real-architecture configs under tests/data/estimate/."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

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
    """A document whose path sits in tests/data/estimate/ (config_path resolves there); nothing is written.
    ``layers=n``: over a copy of the architecture's tiny config ``n`` layers deep instead (:func:`deeper_copy`)."""
    layers = kwargs.pop("layers", None)
    assert layers is None or isinstance(layers, int), layers
    if layers is None:
        return from_text(ledger_text(**kwargs), str(DATA / "test.ledger.yaml"))  # type: ignore[arg-type]
    arch = str(kwargs.get("arch", "tiny-llama-gqa"))
    where = deeper_copy(arch, layers)
    return from_text(ledger_text(**kwargs), str(where / "test.ledger.yaml"))  # type: ignore[arg-type]


_COPIES: dict[tuple[str, int], Path] = {}


def deeper_copy(arch: str, layers: int) -> Path:
    """A folder holding ``arch/config.json``: the tiny config of tests/data/estimate/ with ``layers`` decoder layers,
    its layer pattern (``layer_types``) continued or cut; a ledger in that folder reads it. One folder per
    (arch, layers) for this process, removed at exit."""
    if (arch, layers) in _COPIES:
        return _COPIES[arch, layers]
    config = json.loads((DATA / arch / "config.json").read_text(encoding="utf-8"))
    types = config.get("layer_types")
    config["num_hidden_layers"] = layers
    if types:
        config["layer_types"] = [types[n % len(types)] for n in range(layers)]
    folder = Path(tempfile.mkdtemp(prefix=f"ledgerspec-{arch}-{layers}-"))
    atexit.register(shutil.rmtree, folder, True)
    _COPIES[arch, layers] = folder
    (folder / arch).mkdir()
    (folder / arch / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def between_3_and_4(folder: Path) -> tuple[str, Document, dict[int, int], int]:
    """The device the on-device answer tests build on the tiny Llama (128 tokens): its config copied into
    ``folder``; the ledger's text at microbatch 1 and its document there; the allocated peaks of microbatch 3 and 4
    (plain estimates); and a device memory between them, where microbatch 3's tensors fit and 4's do not."""
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.estimate.sweep import apply

    shutil.copytree(DATA / "tiny-llama-gqa", folder / "tiny-llama-gqa")
    base = ledger_text(microbatch=1, seq=128)
    doc = from_text(base, str(folder / "t.ledger.yaml"))
    allocated = {b: estimate(apply(doc, {"microbatch": b})).peak_allocated for b in (3, 4)}
    return base, doc, allocated, (allocated[3] + allocated[4]) // 2
