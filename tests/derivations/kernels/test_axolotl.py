"""axolotl's LoRA kernels as the estimate models them allocate what axolotl's own functions allocate.

The expected figures are axolotl 0.21.0's ``LoRA_O`` and ``LoRA_QKV`` run on real CPU tensors under the tracker
(``benchmarks/axolotl_kernels_truth.py`` wrote ``tests/data/kernels/axolotl-truth.json``; axolotl itself is not
installed here). The models run the same cases through the same harness and must count the same bytes at every point:
the peak of forward, what stays for backward, the peak of backward, what is left after it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support import REPO_ROOT, TESTS, load_script

TRUTH = json.loads((TESTS / "data" / "kernels" / "axolotl-truth.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script(REPO_ROOT / "benchmarks" / "axolotl_kernels_truth.py", "axolotl_kernels_truth")


def test_the_truth_covers_every_case_of_the_script(bench: Any) -> None:
    assert list(TRUTH["cases"]) == [c.name for c in bench.CASES]
    assert "axolotl 0.21.0" in TRUTH["source"]


@pytest.mark.parametrize("name", list(TRUTH["cases"]))
def test_the_model_allocates_what_axolotl_allocates(bench: Any, name: str) -> None:
    case = next(c for c in bench.CASES if c.name == name)
    got = bench.measure(bench.run_model(case), case)
    assert got == TRUTH["cases"][name]["bytes"]


def test_a_model_missing_a_saved_tensor_would_be_caught(bench: Any) -> None:
    """The figures are sensitive: the fp32 adapters' bf16 copies kept for backward show in what stays."""
    fp32 = TRUTH["cases"]["o-bf16-fp32-adapters"]["bytes"]["after_forward"]
    bf16 = TRUTH["cases"]["o-bf16-adapters"]["bytes"]["after_forward"]
    case = next(c for c in bench.CASES if c.name == "o-bf16-fp32-adapters")
    copies = case.rank * case.hidden * 2 + case.out * case.rank * 2  # A and B in bfloat16
    assert fp32 - bf16 == copies
