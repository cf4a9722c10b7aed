"""Liger-Kernel's published memory rows, re-estimated without a GPU: the allocation models of
``ledgerspec/derivations/kernels/liger.py`` (provider ``liger``) and the eager modules (provider ``huggingface``) on
fake tensors under the dispatch-level tracker.

    python benchmarks/liger_published.py     # writes benchmarks/results/liger.md

Source: linkedin/Liger-Kernel ``benchmark/data/all_benchmark_data.csv`` at commit
ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (blob 196e2d97b3680f426cc905aa6b6fd67db3d97af1), its ``memory`` rows of
fused_linear_cross_entropy, rms_norm, swiglu, geglu and rope, providers ``liger`` and ``huggingface``: 68 rows, copied
unchanged to ``benchmarks/published-liger/liger_memory.csv``. Each value is the median over 10 calls of
``torch.cuda.max_memory_allocated() / 2**20`` right after ``torch.cuda.memory.reset_peak_memory_stats()``
(``benchmark/scripts/utils.py`` ``_test_memory``, lines 81-105 at b5672a1, lines 92-114 at ead96b6): an absolute
peak, so every tensor alive before the reset (inputs, weights, the ``.grad`` of earlier calls) counts.

The rows were written by older scripts than the ones at ead96b6 (which were refactored since, e.g. ``setup_*`` +
``build_memory_bench_fn``, one lm_head per provider): rms_norm, swiglu, geglu and rope by b5672a153b7b (liger-kernel
0.2.1, 2024-09-03, A100-SXM4-80GB), fused_linear_cross_entropy by 90fb5e4a3cb9 (liger-kernel 0.4.2, 2024-11-22). This
script reproduces those scripts' setups (``benchmark/scripts/<file>`` at the commit named):

* fused_linear_cross_entropy (``benchmark_fused_linear_cross_entropy.py`` at 90fb5e4, lines 17-51, 59-90, 158-183):
  ``TorchLMHeadCE`` and ``LigerLMHeadCE`` are both built on the GPU for every row (two bf16 4096 x 128256
  ``nn.Linear(bias=False)`` weights, requiring grad); ``_input`` (BT, H) bf16 ``requires_grad=True``; ``target``
  int64 (BT,); the measured call is ``full``: ``y = fwd(); y.backward()`` (no retain_graph), so ``_input.grad`` and
  the provider's ``lin.weight.grad`` exist from the 2nd call on. huggingface = ``nn.Linear`` + ``CrossEntropyLoss``
  (mean); liger = ``LigerFusedLinearCrossEntropyLoss(lin.weight, x, y)``, here the ``FusedLinearCrossEntropy`` model
  with ``on_cuda=True, autocast_dtype=None`` (no autocast in the script) and reduction ``mean`` (the loss module's
  default, line 47).
* rms_norm (``benchmark_rms_norm.py`` at b5672a1, lines 16-30, 96-131, 137-160): both ``LigerRMSNorm`` and the
  script's own ``LlamaRMSNorm`` (copied below; fp32 weight ``torch.ones(H)``, never cast) exist; x (2048, H) bf16
  ``requires_grad``; dy = ``randn_like(x)`` made before; call: ``y = layer(x); y.backward(dy, retain_graph=True)``.
  liger = the ``RMSNorm`` model with ``in_place=True``, llama casting and the A100 (108 SMs, 2,048 threads per SM) as
  the CUDA device of its weight-gradient sum's staging buffer.
* swiglu (``benchmark_swiglu.py`` at b5672a1, lines 87-140, 146-177) and geglu (``benchmark_geglu.py`` at b5672a1,
  lines 85-142, 148-179): x (B, T, 4096) bf16 ``requires_grad``; the layer is ``LlamaMLP(config)`` (huggingface) or
  ``LigerSwiGLUMLP``/``LigerGEGLUMLP`` (gate/up/down ``nn.Linear`` without bias around ``LigerSiLUMulFunction``/
  ``LigerGELUMulFunction``: here the ``GatedActivation`` model), ``.to(dtype)``: bf16 weights requiring grad. ``full``:
  ``y = layer(x); y.backward(torch.randn_like(y), retain_graph=True)``; ``forward``: ``layer(x)``; ``backward``:
  ``y = layer(x)`` and ``do = randn_like(x)`` before the 10 calls of ``y.backward(do, retain_graph=True)``.
* rope (``benchmark_rope.py`` at b5672a1, lines 104-161, 167-227): q (1, T, 32, hd) and k (1, T, 8, hd) bf16 leaves
  ``requires_grad``, transposed to (1, heads, T, hd); dq, dk = ``randn_like``; cos, sin from ``LlamaRotaryEmbedding``
  (bf16 (1, T, hd)); call: ``q_out, k_out = rope(q, k, cos, sin)`` then ``torch.autograd.grad((q_out, k_out), (q, k),
  (dq, dk), allow_unused=True, retain_graph=True)`` (no ``.grad`` accumulates). liger = the ``Rope`` model.

The tracker (granularity 512, the caching allocator's rounding that ``max_memory_allocated`` counts) runs the same 10
calls, resets its peak before each, and the median is taken, as ``_test_memory`` does; setup tensors are made under
the tracker (they are counted, like the live tensors before the reset on the GPU). Fake CPU tensors: every op here
(mm, log_softmax, nll_loss, gelu, silu, pow/mean/rsqrt, cat) has the same output shapes and dtypes on CPU and CUDA, and
no CPU-only kernel scratch is involved; CPU autograd runs backward in the calling thread, which changes nothing the
tracker counts.

What the tracker cannot see and is added: the cuBLAS workspace, allocated through the caching allocator (so counted by
``max_memory_allocated``) once per (handle, stream) and kept for the process: 8 MiB + 128 KiB on an A100 (ledgerspec's
device catalogue, ``ledgerspec/derivations/devices/outside.yaml`` ``cublas``). One handle per thread that ran a
cuBLAS call before the measured window, in the same process (the speed benchmarks run first): the Python thread and
the autograd engine's device thread for the MLP and lm_head benchmarks (matmuls in forward and backward), the Python
thread only for rope (the transformers of 2024's ``LlamaRotaryEmbedding`` multiplied ``inv_freq @ position_ids``), none
for rms_norm. This is an inference from the benchmark code, visible in the rows as constant offsets (x.25 MiB,
8.14 MiB).

Versions: each row is estimated with the liger-kernel release it was written with, declared as a user declares it,
``software.kernels.packages: {liger-kernel: <the row's liger_version column>}`` (:func:`declared_release`): 0.2.1 for
rms_norm, swiglu, geglu and rope, 0.4.2 for fused_linear_cross_entropy. The models of
``ledgerspec/derivations/kernels/liger.py`` then allocate what that release does where it differs from 0.8.5
(``liger.CHANGES``): for these rows, 0.2.1's RMSNorm backward sums a (M, H) weight-gradient buffer of W's dtype
(float32 here) instead of 0.8.5's (SMs, H) partial sums, and 0.4.2's fused linear cross-entropy makes each chunk's
logits anew, a float32 copy of them and back, and a scaled copy as the gradient, the previous chunk's still held while
the next one's are made (4 (chunk, V) bf16 units at the peak where 0.8.5 reuses one buffer). SwiGLU, GeGLU and RoPE
allocate the same in 0.2.1 and 0.8.5.

The 0.4.2 rows were committed with 90fb5e4, the commit that removed the float32 round trip from the function
(#406); they are the 0.4.2 release's allocations, not that commit's: with the round trip they are matched to the
byte (4,096 and 32,768 tokens), without it they would be 3 (chunk, V) units lower. The same rows written on
2024-09-03 (liger-kernel 0.2.1, replaced by 90fb5e4) differ from them by exactly 1,024 B, the two 512-B blocks of the
token count and the scale that 0.3.0 on keep as CUDA tensors.

On the CUDA target (these rows), the RMSNorm model's ``torch.sum(dW, dim=0)`` also takes the staging buffer and
semaphores PyTorch's reduction allocates from the caching allocator when it splits each column's rows across thread
blocks (``ledgerspec/derivations/engine/cuda_reduce.py``, a port of ``setReduceConfig`` and ``gpu_reduce_kernel`` of
PyTorch 2.4.1's ``Reduce.cuh``): 16-112 MiB for these shapes, which the CPU's reduction does not allocate. The
report's last table sets it against the published rows' residual.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from ledgerspec.derivations.engine.cuda_reduce import A100  # noqa: E402

PUBLISHED = ROOT / "benchmarks" / "published-liger" / "liger_memory.csv"
RESULTS = ROOT / "benchmarks" / "results" / "liger.md"
REPO = "https://github.com/linkedin/Liger-Kernel"
COMMIT = "ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c"
PATH = "benchmark/data/all_benchmark_data.csv"
KERNELS = ("fused_linear_cross_entropy", "rms_norm", "swiglu", "geglu", "rope")
PROVIDERS = ("liger", "huggingface")
GPU = "NVIDIA A100-SXM4-80GB"
ITERATIONS = 10  # _test_memory's _iter
MiB = 2**20
#: threads that made a cuBLAS handle (and its workspace) in the benchmark's process before the measured window
CUBLAS_HANDLES = {"fused_linear_cross_entropy": 2, "swiglu": 2, "geglu": 2, "rope": 1, "rms_norm": 0}
THRESHOLD = 10.0  # percent: rows beyond it carry an explanation


@dataclass(frozen=True)
class Row:
    """One published memory row."""

    kernel: str
    provider: str
    mode: str
    x_name: str
    x: int
    published_mib: float  # y_value_50
    config: dict[str, Any]
    version: str

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.kernel, self.provider, self.mode, self.x)


def published_rows(path: Path = PUBLISHED) -> list[Row]:
    """The committed rows, in the file's order."""
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["metric_name"] != "memory" or r["kernel_name"] not in KERNELS or r["kernel_provider"] not in PROVIDERS:
                continue
            out.append(
                Row(
                    r["kernel_name"],
                    r["kernel_provider"],
                    r["kernel_operation_mode"],
                    r["x_name"],
                    int(r["x_value"]),
                    float(r["y_value_50"]),
                    json.loads(r["extra_benchmark_config_str"]),
                    r["liger_version"],
                )
            )
    return out


def declared_release(row: Row) -> tuple[int, int, int]:
    """The liger-kernel release the row was written with, declared as a user declares it
    (``software.kernels.packages: {liger-kernel: <the row's liger_version>}``)."""
    from ledgerspec.derivations.kernels import liger

    return liger.declared_release(((liger.PACKAGE, row.version),))


def cublas_workspace_bytes() -> int:
    """One cuBLAS workspace on an A100 (the device catalogue's figure)."""
    from ledgerspec.derivations.devices import outside

    cat = outside.load()
    arch, _ = outside.architecture(GPU, cat)
    ws = cat.cublas["workspace"]
    value = ws.get(arch, ws["default"])
    assert isinstance(value, int), value
    return value


# -- the benchmarks' setups and measured calls -----------------------------------------------------------------------

#: a benchmark's modules (built before the tracker starts: ``Module.to`` cannot swap a tracked fake parameter; their
#: parameters and buffers are registered with ``track_existing``) and what makes the rest of its setup and returns
#: the measured call
Setup = tuple[list[Any], Callable[[], Callable[[], None]]]


def _dtype(name: str) -> Any:
    import torch

    return {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16, "torch.float32": torch.float32}[name]


def _llama_rms_norm_class() -> Any:
    """``LlamaRMSNorm`` of ``benchmark_rms_norm.py`` (b5672a1, lines 16-30), verbatim."""
    import torch
    import torch.nn as nn

    class LlamaRMSNorm(nn.Module):
        def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states: Any) -> Any:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    return LlamaRMSNorm


def _setup_flce(row: Row) -> Setup:
    import torch

    h, v, dtype = row.config["H"], row.config["V"], _dtype(row.config["dtype"])
    # TorchLMHeadCE and LigerLMHeadCE are both built (lines 69-70); each holds one nn.Linear(H, V, bias=False)
    torch_lin = torch.nn.Linear(h, v, bias=False, dtype=dtype)
    liger_lin = torch.nn.Linear(h, v, bias=False, dtype=dtype)
    return [torch_lin, liger_lin], lambda: _flce_call(row, torch_lin, liger_lin)


def _flce_call(row: Row, torch_lin: Any, liger_lin: Any) -> Callable[[], None]:
    import torch

    from ledgerspec.derivations.kernels import liger

    FusedLinearCrossEntropy = liger.functions().FusedLinearCrossEntropy

    bt, h, v, dtype = row.x, row.config["H"], row.config["V"], _dtype(row.config["dtype"])
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="mean")
    x = torch.randn(bt, h, requires_grad=True, dtype=dtype)
    target = torch.randint(v, (bt, 1), dtype=torch.long).squeeze(1)

    release = declared_release(row)

    def fwd() -> Any:
        if row.provider == "liger":  # LigerFusedLinearCrossEntropyLoss(reduction="mean") (line 47)
            return FusedLinearCrossEntropy.apply(x, liger_lin.weight, target, True, None, release, "mean")
        return ce(torch_lin(x), target)

    def full() -> None:  # lines 81-83
        y = fwd()
        y.backward()

    return full


def _setup_rms_norm(row: Row) -> Setup:
    import torch

    h, eps = row.x, row.config["eps"]
    liger_rms = torch.nn.Module()
    liger_rms.weight = torch.nn.Parameter(torch.ones(h))  # LigerRMSNorm(hidden_size=N, eps=eps): fp32 ones (line 107)
    llama_rms = _llama_rms_norm_class()(h, eps)  # line 108
    return [liger_rms, llama_rms], lambda: _rms_norm_call(row, liger_rms.weight, llama_rms)


def _rms_norm_call(row: Row, liger_weight: Any, llama_rms: Any) -> Callable[[], None]:
    import torch

    from ledgerspec.derivations.kernels import liger

    RMSNorm = liger.functions().RMSNorm

    m, h, dtype = row.config["M"], row.x, _dtype(row.config["dtype"])
    x = torch.randn((m, h), dtype=dtype)
    dy = torch.randn_like(x)
    x.requires_grad_(True)

    release = declared_release(row)

    def full() -> None:  # lines 121-123
        if row.provider == "liger":
            y = RMSNorm.apply(x, liger_weight, True, A100.sm_count, release, False, A100)
        else:
            y = llama_rms(x)
        y.backward(dy, retain_graph=True)

    return full


def _mlp(row: Row, dtype: Any) -> Any:
    import torch
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ledgerspec.derivations.kernels import liger

    GatedActivation = liger.functions().GatedActivation

    cfg = row.config
    config = LlamaConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], hidden_act=cfg["hidden_act"]
    )
    if row.provider == "huggingface":
        return _to(LlamaMLP(config), dtype)

    class LigerGatedMLP(torch.nn.Module):
        """``LigerSwiGLUMLP`` / ``LigerGEGLUMLP`` (``src/liger_kernel/transformers/{swiglu,geglu}.py`` at b5672a1)."""

        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(GatedActivation.apply(self.gate_proj(x), self.up_proj(x)))

    return _to(LigerGatedMLP(), dtype)


def _to(module: Any, dtype: Any) -> Any:
    """``module.to(dtype)`` for fake parameters: new parameters in place of the old (``Module.to`` swaps a tensor
    subclass's parameters in place, and ``torch.utils.swap_tensors`` refuses a fake tensor, which has weak
    references)."""
    import torch

    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_floating_point():
                m._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    return module


def _setup_gated(row: Row) -> Setup:
    layer = _mlp(row, _dtype(row.config["dtype"]))
    return [layer], lambda: _gated_call(row, layer)


def _gated_call(row: Row, layer: Any) -> Callable[[], None]:
    import torch

    cfg = row.config
    bsz = cfg["B"] if row.kernel == "swiglu" else cfg["bsz"]
    x = torch.randn(bsz, row.x, cfg["hidden_size"], dtype=_dtype(cfg["dtype"]), requires_grad=True)

    if row.mode == "forward":
        return lambda: layer(x)  # _test_memory(fwd): the output is dropped when the call returns
    if row.mode == "backward":  # y and do exist before the 10 calls
        do = torch.randn_like(x)
        y = layer(x)
        return lambda: y.backward(do, retain_graph=True)

    def full() -> None:
        y = layer(x)
        y.backward(torch.randn_like(y), retain_graph=True)

    return full


def _setup_rope(row: Row) -> Setup:
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = row.config
    nq, nkv = cfg["num_q_heads"], cfg["num_kv_heads"]
    hidden = cfg.get("hidden_size", row.x)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hidden // nq)
    rotary_emb = LlamaRotaryEmbedding(config)
    return [rotary_emb], lambda: _rope_call(row, rotary_emb)


def _rope_call(row: Row, rotary_emb: Any) -> Callable[[], None]:
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from ledgerspec.derivations.kernels import liger

    rotary_pos_emb = liger.functions().rotary_pos_emb

    cfg = row.config
    nq, nkv, dtype = cfg["num_q_heads"], cfg["num_kv_heads"], _dtype(cfg["dtype"])
    hidden = cfg.get("hidden_size", row.x)
    seq = cfg.get("seq_len", row.x)
    hd = hidden // nq
    q = torch.randn((1, seq, nq, hd), requires_grad=True, dtype=dtype).transpose(1, 2)
    k = torch.randn((1, seq, nkv, hd), requires_grad=True, dtype=dtype).transpose(1, 2)
    dq, dk = torch.randn_like(q, dtype=dtype), torch.randn_like(k)
    pos_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0)
    cos, sin = rotary_emb(k, pos_ids)

    def full() -> None:  # lines 144-151
        if row.provider == "liger":
            q_out, k_out = rotary_pos_emb(q, k, cos, sin, pos_ids)
        else:
            q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.grad((q_out, k_out), (q, k), (dq, dk), allow_unused=True, retain_graph=True)

    return full


SETUPS: dict[str, Callable[[Row], Setup]] = {
    "fused_linear_cross_entropy": _setup_flce,
    "rms_norm": _setup_rms_norm,
    "swiglu": _setup_gated,
    "geglu": _setup_gated,
    "rope": _setup_rope,
}


def tracked_peak(row: Row) -> int:
    """The median over 10 calls of the tracked peak (bytes), tensors made by the setup included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.engine.tracker import MemoryTracker

    with FakeTensorMode():
        modules, make_call = SETUPS[row.kernel](row)
        tracker = MemoryTracker(granularity=512)
        with tracker:
            tracker.track_existing([t for m in modules for t in (*m.parameters(), *m.buffers())], "frozen_params")
            call = make_call()
            peaks = []
            for _ in range(ITERATIONS):
                tracker.reset_peak()
                call()
                peaks.append(tracker.peak)
            del call
    return int(statistics.median(peaks))  # torch.quantile(q=0.5) of 10 values: the mean of the middle two


def allocator_replay(kernel: str, provider: str, workspace: int | None = None) -> dict[int, float]:
    """x -> the median over its 10 calls of ``max_memory_allocated`` (MiB) when the allocations of the memory rows of
    ``kernel``/``provider``, in the order ``run_benchmarks`` makes them in one process (x ascending, each row's
    tensors released before the next; the cuBLAS workspaces first), go through ledgerspec's model of the caching
    allocator (``ledgerspec/derivations/allocator``) from an empty cache. What ran before them in the real process
    (the speed benchmarks) is left out."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.allocator.replay import replay
    from ledgerspec.derivations.engine.tracker import MemoryTracker

    ws = cublas_workspace_bytes() if workspace is None else workspace
    events: list[tuple[Any, ...]] = [("alloc", f"ws{i}", ws, 0) for i in range(CUBLAS_HANDLES[kernel])]
    rows = [r for r in published_rows() if (r.kernel, r.provider) == (kernel, provider)]
    for n, row in enumerate(rows):
        with FakeTensorMode():
            modules, make_call = SETUPS[row.kernel](row)
            tracker = MemoryTracker(granularity=512, events=True)
            with tracker:
                tracker.track_existing([t for m in modules for t in (*m.parameters(), *m.buffers())], "frozen_params")
                call = make_call()
                for i in range(ITERATIONS):
                    tracker.mark(f"{row.x}/{i}")
                    call()
                del call, make_call, modules
                gc.collect()
        assert tracker.events is not None
        events += [(e[0], f"{n}:{e[1]}", *e[2:]) if e[0] in ("alloc", "free") else e for e in tracker.events]
    result = replay(events)
    return {
        r.x: statistics.median(result.phases[f"{r.x}/{i}"].peak_allocated for i in range(ITERATIONS)) / MiB
        for r in rows
    }


@dataclass(frozen=True)
class Result:
    row: Row
    tensors: int  # tracked peak, bytes
    cublas: int  # cuBLAS workspaces added, bytes

    @property
    def estimated_mib(self) -> float:
        return (self.tensors + self.cublas) / MiB

    @property
    def difference(self) -> float:
        """(estimated - published) / published, percent."""
        return (self.estimated_mib - self.row.published_mib) / self.row.published_mib * 100

    @property
    def differs(self) -> bool:
        """The estimated cell (MiB to the hundredth) is not the published one."""
        return f"{self.estimated_mib:.2f}" != f"{self.row.published_mib:.2f}"

    def cells(self) -> list[str]:
        """The row's table cells, explanation left out."""
        r = self.row
        return [
            str(r.x),
            r.provider,
            r.mode,
            f"{r.published_mib:.2f}",
            f"{self.estimated_mib:.2f}",
            f"{self.cublas / MiB:.2f}",
            f"{self.difference:+.1f}%",
        ]


def estimate(row: Row, workspace: int | None = None) -> Result:
    ws = cublas_workspace_bytes() if workspace is None else workspace
    return Result(row, tracked_peak(row), CUBLAS_HANDLES[row.kernel] * ws)


# -- explanations (rows whose cells differ) --------------------------------------------------------------------------

#: (kernel, provider, mode) -> why the rows of that group whose estimated cell is not the published one differ;
#: filled in from the run and the sources. ``{replay}``: the row's :func:`allocator_replay` figure minus the estimate
EXPLANATIONS: dict[tuple[str, str, str], str] = {
    ("fused_linear_cross_entropy", "liger", "full"): (
        "the caching allocator's blocks: `max_memory_allocated` counts whole blocks, the estimate each tensor rounded "
        "up to 512 B. A request served from a cached block that would leave 1 MiB or less is not split "
        "(CUDACachingAllocator.cpp `should_split`: a large-pool block splits only when more than kSmallSize = 1 MiB "
        "remains), so it counts that whole block, up to 1 MiB more per tensor; which blocks were cached when this "
        "row's (chunk, V) tensors were made depends on everything the benchmark process ran before (the speed "
        "benchmarks, the earlier rows). Replaying the allocations of this kernel's memory rows, in their order, "
        "through ledgerspec's allocator model from an empty cache (the speed benchmarks left out) gives {replay} MiB "
        "more than the estimate (published: {published} MiB more): the same effect and size, another cache history"
    ),
}


def explanation(result: Result, replayed: dict[tuple[str, str, int], float] | None = None) -> str:
    """The row's explanation: empty when its estimated cell is the published one. ``replayed``: (kernel,
    provider, x) -> :func:`allocator_replay`'s figure (MiB)."""
    if not result.differs:
        return ""
    r = result.row
    text = EXPLANATIONS.get((r.kernel, r.provider, r.mode), "not explained yet")
    if "{replay}" in text:
        figure = (replayed or {}).get((r.kernel, r.provider, r.x))
        text = text.format(
            replay="(not replayed)" if figure is None else f"{figure - result.estimated_mib:+.2f}",
            published=f"{r.published_mib - result.estimated_mib:+.2f}",
        )
    return text


# -- the report -------------------------------------------------------------------------------------------------------

HEADER = (
    "| x | provider | mode | published MiB | estimated MiB | of which cuBLAS workspaces MiB | difference "
    "| explanation |"
)
RULE = "| --- | --- | --- | --- | --- | --- | --- | --- |"


def replays(results: list[Result]) -> dict[tuple[str, str, int], float]:
    """:func:`allocator_replay` for each (kernel, provider) with a row whose cell differs."""
    out: dict[tuple[str, str, int], float] = {}
    for kernel, provider in dict.fromkeys((r.row.kernel, r.row.provider) for r in results if r.differs):
        if "{replay}" in EXPLANATIONS.get((kernel, provider, "full"), ""):
            for x, mib in allocator_replay(kernel, provider).items():
                out[(kernel, provider, x)] = mib
    return out


def render(results: list[Result], seconds: float, replayed: dict[tuple[str, str, int], float] | None = None) -> str:
    lines = [
        "# Liger-Kernel's published memory rows, re-estimated without a GPU",
        "",
        "Command: `python benchmarks/liger_published.py`. Machine (for the estimate): "
        f"{cpu_model()}; {machine()}; no GPU used ({seconds:.0f} s for {len(results)} rows).",
        "",
        f"Source: {REPO}, `{PATH}` at commit `{COMMIT}` ({REPO}/blob/{COMMIT}/{PATH}), the `memory` rows of "
        f"{', '.join(KERNELS)}, providers liger and huggingface (copied unchanged to "
        "`benchmarks/published-liger/liger_memory.csv`). All rows: one A100-SXM4-80GB; rms_norm, swiglu, geglu, rope "
        "written with liger-kernel 0.2.1 (commit b5672a1, 2024-09-03), fused_linear_cross_entropy with 0.4.2 "
        "(commit 90fb5e4, 2024-11-22). Published = `y_value_50`, MiB of `torch.cuda.max_memory_allocated()` after "
        "`reset_peak_memory_stats()` (absolute: inputs, weights and earlier calls' `.grad` count), median of 10 calls.",
        "",
        "Estimated = the tracked peak of the same calls on fake tensors (median of 10; liger: the allocation models "
        "of `ledgerspec/derivations/kernels/liger.py` for the release each row was written with, declared per row "
        "as a user declares it, `software.kernels.packages: {liger-kernel: 0.2.1}` (0.4.2 for "
        "fused_linear_cross_entropy), with the CUDA reduction staging of the RMSNorm weight-gradient sum on an A100; "
        "huggingface: the eager modules, transformers of the venv) + the cuBLAS workspaces the benchmark's process "
        "holds (8 MiB + 128 KiB each on an A100, from the device catalogue; how many: see the script's docstring). "
        "The script's docstring cites the benchmark scripts' lines each setup follows. Difference = (estimated - "
        "published) / published; a row whose estimated cell is not the published one carries an explanation.",
        "",
    ]
    summary = []
    for kernel in KERNELS:
        rows = [r for r in results if r.row.kernel == kernel]
        if not rows:
            continue
        lines += [f"## {kernel}", ""]
        for x_name in dict.fromkeys(r.row.x_name for r in rows):
            sweep = [r for r in rows if r.row.x_name == x_name]
            configs = sorted({json.dumps(r.row.config) for r in sweep})
            lines += [f"Sweep of {x_name}, config `{c}`:" for c in configs] + [""]
            lines += [HEADER.replace("| x |", f"| {x_name} |", 1), RULE]
            lines += ["| " + " | ".join([*r.cells(), explanation(r, replayed)]) + " |" for r in sweep]
            lines.append("")
        for provider in PROVIDERS:
            mine = [r for r in rows if r.row.provider == provider]
            within = sum(abs(r.difference) <= THRESHOLD for r in mine)
            summary.append(f"| {kernel} | {provider} | {within} of {len(mine)} |")
    worst = max(results, key=lambda r: abs(r.difference))
    same = sum(not r.differs for r in results)
    lines += [
        "## Summary",
        "",
        f"| kernel | provider | rows within {THRESHOLD:.0f}% |",
        "| --- | --- | --- |",
        *summary,
        "",
        f"{sum(abs(r.difference) <= THRESHOLD for r in results)} of {len(results)} rows within {THRESHOLD:.0f}%, "
        f"{same} with the published cell; the largest difference: {worst.difference:+.3f}% "
        f"({worst.estimated_mib - worst.row.published_mib:+.3f} MiB, {worst.row.kernel} {worst.row.provider} "
        f"{worst.row.x_name}={worst.row.x}).",
        "",
        *staging_section(results),
    ]
    return "\n".join(lines) + "\n"


def staging_rows(results: list[Result]) -> list[dict[str, Any]]:
    """For each liger rms_norm row: the published peak less what the tensors of its shapes hold (independent of
    the estimate: shapes x bytes), against the staging buffer and semaphores of the port of ``Reduce.cuh``."""
    from ledgerspec.derivations.engine import cuda_reduce

    out = []
    for r in results:
        row = r.row
        if (row.kernel, row.provider) != ("rms_norm", "liger"):
            continue
        m, h = row.config["M"], row.x
        # x, dy (bf16) and y (bf16, alive in `full`); 0.2.1's dW (M, H) float32 (W's dtype)
        big = 3 * m * h * 2 + m * h * 4
        config = cuda_reduce.set_reduce_config(cuda_reduce.rows_layout(m, h, 4), A100, 4, 4)
        staging = cuda_reduce.rows_sum_staging(m, h, "float32", A100)
        # two float32 weights (LigerRMSNorm's, LlamaRMSNorm's), the liger weight's .grad, the sum's output (H float32
        # each), the reciprocal RMS (M float32), the semaphores' 512-B block
        small = 4 * h * 4 + m * 4 + -(-staging.semaphores // 512) * 512
        residual = round(row.published_mib * MiB) - big
        out.append(
            {
                "H": h,
                "published": row.published_mib,
                "residual": residual,
                "ctas": config.ctas_per_output,
                "staging": staging.buffer,
                "semaphores": staging.semaphores,
                "rest": residual - staging.buffer,
                "small": small,
            }
        )
    return out


def staging_section(results: list[Result]) -> list[str]:
    rows = staging_rows(results)
    if not rows:
        return []
    lines = [
        "## The CUDA reduction's staging buffer (rms_norm, liger)",
        "",
        "liger-kernel 0.2.1's RMSNorm backward sums a (M, H) float32 weight-gradient buffer over its M = 2,048 rows "
        "(`torch.sum(dW, dim=0)`). On CUDA, PyTorch splits each column's rows across `ctas_per_output` thread blocks "
        "and combines them through a staging buffer and semaphores from the caching allocator (`gpu_reduce_kernel`, "
        "`aten/src/ATen/native/cuda/Reduce.cuh`); `ledgerspec/derivations/engine/cuda_reduce.py` ports its "
        "`setReduceConfig` (PyTorch 2.4.1; A100: 108 SMs, 2,048 threads per SM, warps of 32). Residual = published "
        "less x, dy, y (3 x M x H x 2 B) and dW (M x H x 4 B), from the shapes alone; after the staging buffer, what "
        "remains is the small tensors: two float32 weights, the weight's gradient and the sum's output (H x 4 B each), "
        "the reciprocal RMS (M x 4 B) and the semaphores' 512-B block.",
        "",
        "| H | published MiB | residual MiB | ctas_per_output | staging buffer MiB (port) | semaphores B (port) "
        "| residual - staging, B | small tensors, B |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['H']} | {r['published']:.2f} | {r['residual'] / MiB:.4f} | {r['ctas']} | {r['staging'] / MiB:.2f} "
            f"| {r['semaphores']} | {r['rest']} | {r['small']} |"
        )
    return [*lines, ""]


def main() -> None:
    started = time.perf_counter()
    workspace = cublas_workspace_bytes()
    results = [estimate(row, workspace) for row in published_rows()]
    replayed = replays(results)
    seconds = time.perf_counter() - started
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(render(results, seconds, replayed), encoding="utf-8")
    for r in results:
        print(" ".join(r.cells()), explanation(r, replayed)[:60])
    print(f"wrote {RESULTS.relative_to(ROOT)} ({seconds:.1f} s, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
