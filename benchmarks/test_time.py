"""How long the test suite takes, and where: the whole suite as CI runs it (``scripts/test``: two workers), its wall
and CPU time, the ten slowest tests, and the time per test file.

    python benchmarks/test_time.py                  # runs the suite, writes benchmarks/results/test-time.md
    python benchmarks/test_time.py --log RUN.log    # reads a finished run's log instead (pytest --durations=0)

A log given with ``--log`` must come from ``pytest -n 2 --dist loadgroup -q --durations=0`` (the durations table);
its wall and CPU time are read from a ``RUN.log.time`` file beside it when there is one (the output of ``time``).
The results keep the section of every label given with ``--label`` (default ``after``), so a before and an after
stand side by side.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.estimate_common import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "test-time.md"
ROW = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")


def durations(log: str) -> list[tuple[float, str, str]]:
    """``(seconds, phase, test id)`` of every row of pytest's durations table."""
    table = log.split("slowest durations", 1)[-1]
    return [(float(m[1]), m[2], m[3]) for line in table.splitlines() if (m := ROW.match(line))]


def summary_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if re.search(r"\d+ passed", ln)]
    return lines[-1].strip("= ") if lines else "no summary line"


def section(label: str, log: str, wall: float | None, cpu: float | None, note: str) -> str:
    rows = durations(log)
    by_test: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    for seconds, _phase, test in rows:
        base = re.sub(r"@[\w.\-]+$", "", test)  # the xdist group tag
        by_test[base] += seconds
        by_file[base.split("::")[0]] += seconds
    out = [
        f"## {label}",
        "",
        note,
        "",
        f"- result: {summary_line(log)}",
        f"- wall time: {wall / 60:.1f} min" if wall is not None else "- wall time: not recorded",
        f"- CPU time (user + system, every process): {cpu / 60:.1f} min" if cpu is not None else "- CPU: not recorded",
        f"- sum of the test durations (both workers): {sum(by_test.values()) / 60:.1f} min",
        "",
        "The ten slowest tests (setup + call + teardown; a module fixture's setup is counted on the first test that "
        "used it):",
        "",
        "| seconds | test |",
        "| ---: | --- |",
        *[f"| {s:.1f} | `{t}` |" for t, s in by_test.most_common(10)],
        "",
        "The ten slowest files:",
        "",
        "| seconds | file |",
        "| ---: | --- |",
        *[f"| {s:.1f} | `{f}` |" for f, s in by_file.most_common(10)],
        "",
    ]
    return "\n".join(out)


def run_suite() -> tuple[str, float, float]:
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "--durations=0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "LEDGERSPEC_FUZZ_EXAMPLES": os.environ.get("LEDGERSPEC_FUZZ_EXAMPLES", "1500")},
        check=False,
    )
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return proc.stdout + proc.stderr, wall, cpu


def read_time(path: Path) -> tuple[float | None, float | None]:
    """``real``/``user``/``sys`` from the output of bash's ``time``."""
    if not path.exists():
        return None, None
    text = path.read_text(encoding="utf-8")

    def get(name: str) -> float | None:
        m = re.search(rf"^{name}\s+(\d+)m([\d.]+)s", text, re.M)
        return int(m[1]) * 60 + float(m[2]) if m else None

    user, system = get("user"), get("sys")
    return get("real"), (user + system) if user is not None and system is not None else None


def write(label: str, body: str) -> None:
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    head = (
        "# The test suite's time (`benchmarks/test_time.py`)\n\n"
        "Each section: one whole run as CI runs it (two workers, `--dist loadgroup`, the slow fuzz run at 1,500 "
        "documents), on the machine named in it. The machine is shared: the CPU time is the steadier figure.\n"
    )
    sections = dict(re.findall(r"<!-- (\S+): begin -->\n(.*?)<!-- \1: end -->", text, re.S))
    sections[label] = body.rstrip() + "\n"
    order = ["before", *(k for k in sections if k != "before")]
    parts = [head] + [f"<!-- {k}: begin -->\n{sections[k]}<!-- {k}: end -->\n" for k in order if k in sections]
    RESULTS.write_text("\n".join(parts), encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log", type=Path, help="a finished run's log (pytest --durations=0) instead of running")
    p.add_argument("--label", default="after")
    p.add_argument("--note", default="", help="what the run was (commit, conditions)")
    args = p.parse_args()
    if args.log is not None:
        log = args.log.read_text(encoding="utf-8", errors="replace")
        wall, cpu = read_time(Path(str(args.log) + ".time"))
    else:
        log, wall, cpu = run_suite()
    note = args.note or f"Machine: {machine()}."
    body = section(args.label, log, wall, cpu, note)
    write(args.label, body)
    print(body)


if __name__ == "__main__":
    main()
