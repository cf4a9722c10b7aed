"""docs/kernels.md says what the code does: its catalogue table lists every kernel with the catalogue's op and
modelled flag, and its worked example's peaks are what `estimate` gives for the shipped ledger."""

from __future__ import annotations

import re

import pytest

from ledgerspec.contract.document import from_text
from ledgerspec.contract.kernels import KERNELS
from tests.support import EXAMPLES, REPO_ROOT

PAGE = (REPO_ROOT / "docs" / "kernels.md").read_text(encoding="utf-8")
EXAMPLE = EXAMPLES / "kernels" / "llama-3.1-8b-lora.ledger.yaml"


def _rows(header: str) -> list[list[str]]:
    table = PAGE.split(header, 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def test_the_catalogue_table_is_the_catalogue() -> None:
    seen: dict[str, tuple[str, bool]] = {}
    for cells in _rows("| kernel | op | package | modelled | what it changes |"):
        for kid in re.findall(r"`([a-z_]+)`", cells[0]):
            seen[kid] = (cells[1], cells[3] == "yes")
    assert seen == {k.id: (k.op, k.modelled) for k in KERNELS.values()}


EXAMPLE_KERNELS = {
    "none (transformers' modules)": "",
    "`cross_entropy: liger_fused_linear_cross_entropy`": "{cross_entropy: liger_fused_linear_cross_entropy}",
    "`cross_entropy: cut_cross_entropy`": "{cross_entropy: cut_cross_entropy}",
    "`cross_entropy: trl_chunked_nll` (TRL's `SFTTrainer`, its default)": "{cross_entropy: trl_chunked_nll}",
    "Liger's defaults (fused cross-entropy, RMSNorm, SwiGLU, RoPE)": (
        "{cross_entropy: liger_fused_linear_cross_entropy, norm: liger_rms_norm, mlp_activation: liger_swiglu, "
        "rope: liger_rope}"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("row", _rows("| kernels | peak allocated | device peak (24 GiB card) | verdict |"), ids=str)
def test_the_example_table_is_what_estimate_says(row: list[str]) -> None:
    from ledgerspec.derivations.estimate.estimator import estimate

    text = EXAMPLE.read_text(encoding="utf-8")
    kernels = EXAMPLE_KERNELS[row[0]]
    if kernels:
        text = text.replace("  # kernels:  ", f"  kernels: {kernels}\n  # ", 1)
    doc = from_text(text, str(EXAMPLE))
    est = estimate(doc)
    assert f"{est.peak_allocated / 2**30:.2f} GiB" == row[1]
