"""What axolotl's own LoRA kernels allocate on this CPU: the truth the kernel models are tested against.

axolotl's ``LoRA_O`` and ``LoRA_QKV`` (``axolotl/kernels/lora.py``) are plain torch code for unquantized weights, so
they run here. This script runs each on real CPU tensors under ledgerspec's dispatch-level tracker, for the cases in
:data:`CASES` (16-bit activations with 32- or 16-bit adapters, with and without dropout's second input, with a base
bias), and writes what it counted to ``tests/data/kernels/axolotl-truth.json``: the peak during forward, the bytes
alive after forward (what the function keeps for backward plus its output), the peak during backward and the bytes
alive after it. ``tests/derivations/kernels/test_axolotl.py`` runs ledgerspec's models
(:mod:`ledgerspec.derivations.kernels.axolotl`) through the same :func:`measure` and asserts the same figures.

axolotl is not a dependency of ledgerspec (it needs Python >= 3.12 and a CUDA stack); to re-run::

    pip install --no-deps --ignore-requires-python --target /tmp/axolotl-src axolotl==0.21.0
    AXOLOTL_SRC=/tmp/axolotl-src .venv/bin/python benchmarks/axolotl_kernels_truth.py

(the kernels import with torch, bitsandbytes and nothing else of axolotl's dependencies).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "kernels" / "axolotl-truth.json"


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # o | qkv
    batch: int = 2
    seq: int = 48
    hidden: int = 128
    out: int = 96  # o: the projection's output; qkv: k and v's output (q's is `hidden`)
    rank: int = 8
    x_dtype: str = "bfloat16"
    adapter_dtype: str = "float32"
    dropout: bool = False
    bias: bool = False


CASES = (
    Case("o-bf16-fp32-adapters", "o"),
    Case("o-bf16-adapters", "o", adapter_dtype="bfloat16"),
    Case("o-dropout", "o", dropout=True),
    Case("o-bias", "o", bias=True, adapter_dtype="bfloat16"),
    Case("qkv-bf16-fp32-adapters", "qkv"),
    Case("qkv-bf16-adapters", "qkv", adapter_dtype="bfloat16"),
    Case("qkv-dropout", "qkv", dropout=True),
    Case("qkv-fp32", "qkv", x_dtype="float32", adapter_dtype="float32"),
)


def inputs(case: Case) -> dict[str, Any]:
    """The tensors of one case, made before the tracker starts (seeded: every run sees the same values)."""
    import torch

    torch.manual_seed(0)
    xd, ad = getattr(torch, case.x_dtype), getattr(torch, case.adapter_dtype)
    x = torch.randn(case.batch, case.seq, case.hidden, dtype=xd, requires_grad=True)
    x_drop = torch.randn(case.batch, case.seq, case.hidden, dtype=xd, requires_grad=True) if case.dropout else None
    outs = (case.out,) if case.kernel == "o" else (case.hidden, case.out, case.out)
    layers = []
    for n in outs:
        linear = torch.nn.Linear(case.hidden, n, bias=case.bias, dtype=xd)
        linear.requires_grad_(False)
        a = torch.nn.Parameter(torch.randn(case.rank, case.hidden, dtype=ad) * 0.01)
        b = torch.nn.Parameter(torch.randn(n, case.rank, dtype=ad) * 0.01)
        layers.append((linear, a, b, 2.0))
    return {"x": x, "x_drop": x_drop, "layers": layers}


def measure(run: Any, case: Case) -> dict[str, int]:
    """Run ``run(inputs) -> outputs`` under the tracker, then backward with a gradient of ones per output."""
    import torch

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    data = inputs(case)
    grads = None
    existing = [data["x"], *([data["x_drop"]] if data["x_drop"] is not None else [])]
    for linear, a, b, _ in data["layers"]:
        existing += [t for t in (linear.weight, linear.bias, a, b) if t is not None]
    with MemoryTracker() as tracker:
        tracker.track_existing(existing, "temporary")  # the inputs are there before: count only what the call makes
        base = tracker.current
        tracker.reset_peak()
        outs = run(data)
        outs = outs if isinstance(outs, tuple) else (outs,)
        forward_peak, after_forward = tracker.peak - base, tracker.current - base
        grads = [torch.ones_like(o) for o in outs]
        start = tracker.current
        tracker.reset_peak()
        torch.autograd.backward(outs, grads)
        backward_peak = tracker.peak - start
        del outs, grads
        after_backward = tracker.current - base
    return {
        "forward_peak": forward_peak,
        "after_forward": after_forward,
        "backward_peak": backward_peak,
        "after_backward": after_backward,
    }


def run_axolotl(case: Case) -> Any:
    """A ``run`` calling axolotl's own function."""
    from axolotl.kernels.lora import LoRA_O, LoRA_QKV

    def run(d: dict[str, Any]) -> Any:
        x, x_drop = d["x"], d["x_drop"]
        args = []
        for linear, a, b, s in d["layers"]:
            args += [linear.weight, linear.bias, None, a, b, s, None, None]
        if case.kernel == "o":
            return LoRA_O.apply(x, x_drop, *args)
        return LoRA_QKV.apply(x, x_drop, *args, True)

    return run


def run_model(case: Case) -> Any:
    """A ``run`` calling ledgerspec's model of the same function."""
    from ledgerspec.derivations.kernels import axolotl

    LoRA_O = axolotl.functions().LoRA_O
    LoRA_QKV = axolotl.functions().LoRA_QKV

    def run(d: dict[str, Any]) -> Any:
        x, x_drop, layers = d["x"], d["x_drop"], d["layers"]
        if case.kernel == "o":
            linear, a, b, s = layers[0]
            return LoRA_O.apply(x, x_drop, linear, a, b, s)
        ab = [t for _, a, b, _ in layers for t in (a, b)]
        return LoRA_QKV.apply(x, x_drop, *ab, tuple((lin, s) for lin, _, _, s in layers))

    return run


def main() -> int:
    src = os.environ.get("AXOLOTL_SRC")
    if src:
        sys.path.insert(0, src)
    sys.path.insert(0, str(ROOT))
    from importlib.metadata import PackageNotFoundError, version

    import axolotl  # noqa: F401  (fails clearly when the kernels are not importable)

    try:
        ax_version = version("axolotl")
    except PackageNotFoundError:
        ax_version = "0.21.0"
    import torch

    from benchmarks.machine import cpu_model

    truth = {
        "source": f"axolotl {ax_version} axolotl/kernels/lora.py (LoRA_O, LoRA_QKV), run on real CPU tensors",
        "torch": torch.__version__,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "cases": {c.name: {"case": asdict(c), "bytes": measure(run_axolotl(c), c)} for c in CASES},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(truth, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
