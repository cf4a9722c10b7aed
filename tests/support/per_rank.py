"""Per-rank comparisons of a real ``measure --nproc`` run with ``shard --estimate`` and the calculated state (the
FSDP1 tests: plain, QLoRA, hybrid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ledgerspec.contract.document import Document, load


def measured(path: Path, nproc: int) -> Document:
    """Resolve the ledger at ``path``, give it a target device and an activations figure (fixtures), write it back,
    run ``measure --nproc`` on it and return the measured document."""
    from ledgerspec import resolve
    from ledgerspec.contract.edit import set_figure, set_plain
    from ledgerspec.contract.writer import atomic_write, render
    from tests.support import run_cli

    doc = load(path)
    resolve(doc, offline=True)
    set_plain(doc, ("result", "target_device", "memory"), "1 GiB")
    set_figure(doc, ("ledger", "activations"), 1_000_000, "CALCULATED", method="test fixture")
    atomic_write(path, render(doc.data, doc.text))
    code, _, err = run_cli("measure", path, "--nproc", str(nproc))
    assert code == 0, err
    return load(path)


def assert_rank_agrees(real: dict[str, Any], est: Any, calc: Any, unit: int, components: bool = True) -> None:
    """One measured rank against its simulation and calculation: the model-state phases to the byte, the compute
    phases a lower bound at most two gathered layer units under the measurement (gloo's collectives run on their own
    thread), the measured components equal to the calculated state (and, with ``components``, to the simulated)."""
    for name, want in real["phases"].items():
        got = est.phases[name]
        if name.startswith("after_"):
            assert got == want, (real["rank"], name)
        else:
            assert 0 <= want - got <= 2 * unit, (real["rank"], name, want, got)
    m = real["measured"]
    if components:
        assert {k: m[k] for k in est.components} == est.components
    assert (m["frozen_base"], m["adapter"], m["gradients"], m["optimizer"]) == (
        calc.frozen_base,
        calc.adapter,
        calc.gradients,
        calc.optimizer + calc.optimizer_host,
    )
