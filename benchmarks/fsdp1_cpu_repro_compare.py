"""The published FSDP1 step measured with the published stack on the CPU, against ledgerspec's simulation of it.

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/fsdp1_cpu_repro_compare.py   # the project's venv

Reads the real runs in ``benchmarks/results/fsdp1-cpu-repro/*.json`` (written by ``benchmarks/fsdp1_cpu_repro.py``
in the published stack's venv, torch 2.4.1 + transformers 4.48.1 + accelerate 1.0.1 + PEFT 0.13.2: see
``benchmarks/results/published-multi-gpu-cpu-repro.md`` for the commands), simulates the ledger of the same name in
``benchmarks/published-multi-gpu-cpu-repro/`` (``--target cpu``, every layer traced) twice: as declared
(transformers 4.48.1, so its loss and its checkpoint placement are modelled) and with the installed transformers
(``software.transformers`` removed), and prints rank 0's forward and backward peaks side by side, in MB (1e6 B).
The real figures are the largest over the run's two steps; the simulation's backward is its first step's, and its
steady state is a whole second step (forward included), so the real backward lies between the two where the second
step's backward is the higher. Nothing is fitted: the ledgers state the runs' settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REAL = ROOT / "benchmarks" / "results" / "fsdp1-cpu-repro"
LEDGERS = ROOT / "benchmarks" / "published-multi-gpu-cpu-repro"


def simulate(text: str, path: Path) -> dict[str, int]:
    from ledgerspec.contract.document import from_text

    doc = from_text(text, str(path))
    if "strategy: fsdp1" in text:
        from ledgerspec.derivations.shard.sharder import shard

        est = shard(doc, estimate=True, target="cpu", layers="full").estimate
        assert est is not None
        return dict(est.ranks[0].phases)
    from ledgerspec.derivations.estimate.estimator import estimate

    return dict(estimate(doc, target="cpu", layers="full").phases)


def main() -> None:
    header = (
        "| run | real forward | simulated forward (declared / installed transformers) | real backward "
        "| simulated backward, first step (declared / installed) | simulated steady-state step (declared / installed) "
        "| real after train() |"
    )
    print(header)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for real_path in sorted(REAL.glob("*.json")):
        real = json.loads(real_path.read_text())
        ledger = LEDGERS / f"{real_path.stem}.ledger.yaml"
        text = ledger.read_text(encoding="utf-8")
        declared = simulate(text, ledger)
        installed = simulate(text.replace("  transformers: 4.48.1\n", ""), ledger)

        def mb(p: dict[str, int], key: str) -> str:
            return f"{p[key] / 1e6:.2f}"

        print(
            f"| {real_path.stem} | {real['phases']['forward'] / 1e6:.2f} | "
            f"{mb(declared, 'forward_peak')} / {mb(installed, 'forward_peak')} | "
            f"{real['phases']['backward'] / 1e6:.2f} | "
            f"{mb(declared, 'backward_peak')} / {mb(installed, 'backward_peak')} | "
            f"{mb(declared, 'steady_state_peak')} / {mb(installed, 'steady_state_peak')} | "
            f"{real['after_train'] / 1e6:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
