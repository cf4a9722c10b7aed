"""Benchmark ``ledgerspec validate`` against ``check-jsonschema`` on the same ledger files.

One command: ``python benchmarks/validate.py [--runs N]``. Measures the wall time of each tool as a
subprocess (interpreter start included) on 1 file and on 200 files (copies of the example ledgers and
the rule cases), median of N runs, side by side, and the in-process throughput of ``load`` +
``validate``. Writes ``benchmarks/results/validate.md`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "validate.md"
SCHEMA = ROOT / "schema" / "ledger.v1.json"


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        sys.exit(f"benchmarks/validate.py: `{name}` not found (install the [dev] extra)")
    return found


def _sources() -> list[Path]:
    files = sorted((ROOT / "examples").glob("*.ledger.yaml"))
    files += sorted((ROOT / "tests" / "cases").rglob("*.ledger.yaml"))
    if not files:
        sys.exit("benchmarks/validate.py: no ledger files under examples/ or tests/cases/")
    return files


def _copies(folder: Path, n: int) -> list[Path]:
    sources = _sources()
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        dst = folder / f"{i:03d}-{src.name}"
        shutil.copyfile(src, dst)
        out.append(dst)
    return out


def _wall(cmd: list[str], runs: int) -> tuple[float, int]:
    times = []
    code = 0
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t0)
        code = proc.returncode
    return statistics.median(times), code


def _in_process(files: list[Path], rounds: int) -> float:
    from ledgerspec.checks.validate import validate
    from ledgerspec.contract.document import load

    for f in files[:5]:  # warm: imports, compiled validator
        validate(load(f))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for f in files:
            validate(load(f))
        best = min(best, time.perf_counter() - t0)
    return len(files) / best


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="subprocess runs per measurement (median)")
    ap.add_argument("--files", type=int, default=200)
    args = ap.parse_args(argv)

    ours = [_tool("ledgerspec"), "validate"]
    theirs = [_tool("check-jsonschema"), "--schemafile", str(SCHEMA)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ledgerspec-bench-") as tmp:
        files = _copies(Path(tmp), args.files)
        for label, batch in (("1 file", files[:1]), (f"{len(files)} files", files)):
            names = [str(f) for f in batch]
            t_ours, c_ours = _wall([*ours, *names], args.runs)
            t_theirs, c_theirs = _wall([*theirs, *names], args.runs)
            rows.append((label, t_ours, t_theirs, c_ours, c_theirs))
            print(
                f"{label:>10}: ledgerspec {t_ours * 1000:7.0f} ms   check-jsonschema {t_theirs * 1000:7.0f} ms"
                f"   ratio {t_ours / t_theirs:.2f}",
                flush=True,
            )
        throughput = _in_process(files, rounds=3)
    print(f"in-process load + validate: {throughput:.0f} documents/s")

    lines = [
        "# `ledgerspec validate` vs `check-jsonschema`",
        "",
        "Produced by `python benchmarks/validate.py` (median of "
        f"{args.runs} runs; subprocess wall time, interpreter start included). Files: copies of "
        "`examples/*.ledger.yaml` and `tests/cases/**/*.ledger.yaml`; check-jsonschema validates them with "
        "`--schemafile schema/ledger.v1.json`. ledgerspec does more per file (schema, rules LS001-LS090, status "
        "ladder, positions). Ratio = ledgerspec / check-jsonschema (below 1: ledgerspec is faster). "
        "Exit codes differ by design: some rule cases are meant to fail.",
        "",
        "| files | ledgerspec validate | check-jsonschema | ratio | exit codes (ours, theirs) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for label, t_ours, t_theirs, c_ours, c_theirs in rows:
        lines.append(
            f"| {label} | {t_ours * 1000:.0f} ms | {t_theirs * 1000:.0f} ms | {t_ours / t_theirs:.2f} | "
            f"{c_ours}, {c_theirs} |"
        )
    lines += [
        "",
        f"In-process throughput (`ledgerspec.load` + `ledgerspec.validate`, warm, best of 3): **{throughput:.0f} "
        "documents/s**.",
        "",
        "## Machine",
        "",
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- OS: {platform.platform()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        f"- ledgerspec {_version('ledgerspec')}, jsonschema {_version('jsonschema')}, "
        f"ruamel.yaml {_version('ruamel.yaml')}, check-jsonschema {_version('check-jsonschema')}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
