"""``aten::_grouped_mm`` under fake tensors for float16 and float32 (issue 26;
:mod:`ledgerspec.derivations.estimate.grouped_mm`): torch's meta kernel refuses what its kernels compute, and a
Mixtral trained in fp16 could not be estimated ("MixtralForCausalLM cannot be traced under FakeTensorMode ...
Expected inputs of BF16 type", after 22 lines of torch's log). The truths: torch's own CPU kernel on real tensors
(each dtype, its output's shape, dtype and strides), and a real CPU step of a tiny Mixtral in fp16 measured by
``measure --device cpu``'s protocol against ``estimate --target cpu``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ledgerspec.contract.document import load
from tests.support import TESTS, CliRunner

torch = pytest.importorskip("torch")

TINY = TESTS / "data" / "estimate" / "tiny-mixtral"
PHASES = ("after_load", "after_adapter_injection", "after_optimizer_init", "forward_peak", "backward_peak")


def _operands(dtype: object, fake: bool) -> tuple[object, object, object]:
    """Real CPU operands, or (under FakeTensorMode) fake CUDA ones as the estimate's CUDA target makes them."""
    device = "cuda" if fake else "cpu"
    make = torch.empty if fake else torch.randn
    a, b = make(8, 64, dtype=dtype, device=device), make(2, 64, 16, dtype=dtype, device=device)
    return a, b, torch.tensor([3, 8], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_the_fake_output_is_the_cpu_kernels(dtype: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ledgerspec.derivations.estimate.grouped_mm import grouped_mm_any_float

    dt = getattr(torch, dtype)
    real = torch._grouped_mm(*_operands(dt, fake=False))  # torch's CPU kernel computes it
    grouped_mm_any_float()
    with FakeTensorMode():
        fake = torch._grouped_mm(*_operands(dt, fake=True))
    # (a CUDA build's meta kernel pads the last dimension to 16 bytes, as the CUDA kernel does; this is the CPU build)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.slow  # a fresh Python: the relaxed kernel stays for the rest of a process
def test_torchs_own_meta_kernel_still_refuses_float16() -> None:
    """When torch's own meta kernel takes float16, the relaxed one can go (and this test says so)."""
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "with FakeTensorMode():\n"
        "    a = torch.empty(8, 64, dtype=torch.float16, device='cuda')\n"
        "    b = torch.empty(2, 64, 16, dtype=torch.float16, device='cuda')\n"
        "    torch._grouped_mm(a, b, torch.tensor([3, 8], dtype=torch.int32, device='cuda'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Expected inputs of BF16 type" in done.stderr


def _mixtral(tmp: Path) -> Path:
    shutil.copytree(TINY, tmp / "tiny-mixtral")
    path = tmp / "mixtral-fp16.ledger.yaml"
    path.write_text(
        """ledgerspec: ledger/v1
title: tiny Mixtral, fp16 base and autocast, LoRA on the attention
identity: {model_id: tiny-mixtral, config_path: tiny-mixtral/config.json, architecture: MixtralForCausalLM}
software: {attention_implementation: sdpa}
method: {kind: LoRA, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj], bias: none}
base_model: {loaded_dtype: float16, quantized: false}
adapter: {dtype: float32}
workload: {max_length: 32, sequence_p50: 32, sequence_p95: 32, packing: false, microbatch: 2, gradient_accumulation: 1}
optimizer: {name: adamw_torch}
training: {loop: trainer, mixed_precision: fp16}
memory_options: {gradient_checkpointing: false}
""",
        encoding="utf-8",
    )
    return path


@pytest.mark.slow  # a traced and a real step
def test_an_fp16_mixtral_is_estimated_as_its_real_cpu_step_runs(tmp_path: Path, cli: CliRunner) -> None:
    from ledgerspec.derivations.estimate.estimator import estimate
    from ledgerspec.derivations.measure.measurer import make_request, run_request

    path = _mixtral(tmp_path)
    doc = load(path)
    est = estimate(doc, target="cpu")
    measured = run_request(make_request(doc, "cpu", 2, None, None)).result  # real tensors, the real CPU kernel
    for phase in PHASES:
        assert est.phases[phase] == measured.phases[phase].figure, phase
    code, out, err = cli("estimate", path, "--dry-run")  # the CUDA target too, without torch's log
    assert code == 0, err
    assert "peak allocated" in out and "Expected inputs of BF16" not in out + err and "fake_tensor.py" not in err


@pytest.mark.slow  # a fresh Python, as a user's
def test_a_step_that_cannot_be_traced_is_one_line_without_torchs_log(tmp_path: Path) -> None:
    """Without the relaxed kernel (torch's own refuses float16), the estimate's failure is its one line: torch's log
    of the failing meta kernel (22 lines with its traceback) is not printed."""
    path = _mixtral(tmp_path)
    code = (
        "import sys\n"
        "from ledgerspec.derivations.estimate import grouped_mm\n"
        "grouped_mm.grouped_mm_any_float = lambda: None\n"
        "from ledgerspec.faces.cli import main\n"
        f"sys.exit(main(['estimate', {str(path)!r}, '--dry-run', '--no-cache']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "MixtralForCausalLM cannot be traced under FakeTensorMode" in lines[0]
    assert "Expected inputs of BF16 type" in lines[0] and "fake_tensor.py" not in done.stderr
