"""The estimate cache: an answer from it equals a fresh trace, every input that changes the trace changes the key,
and the cache is safe to delete, bounded, and never an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ledgerspec.contract.document import load
from ledgerspec.contract.edit import set_plain
from ledgerspec.derivations.estimate import cache as C
from ledgerspec.derivations.estimate.estimator import Estimate, estimate
from tests.support import EXAMPLES, REPO_ROOT

TINY = EXAMPLES / "tiny"


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The tiny example ledger and its config, copied where the test may edit both."""
    shutil.copytree(TINY / "tiny-llama", tmp_path / "tiny-llama")
    path = tmp_path / "tiny.ledger.yaml"
    path.write_text((TINY / "tiny-llama-lora.ledger.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return path


@pytest.fixture
def store(tmp_path: Path) -> C.EstimateCache:
    return C.EstimateCache(tmp_path / "cache")


def _entries(store: C.EstimateCache) -> list[Path]:
    return sorted(store.entries.glob("*.json"))


def _same(a: Estimate, b: Estimate) -> None:
    """Every figure, the depth plan, the method and the notes: what the CLI prints and writes back."""
    for name in ("phases", "activations", "components", "plan", "attention", "target", "method", "notes"):
        assert getattr(a, name) == getattr(b, name), name
    assert list(a.phases) == list(b.phases), "phase order kept (the first phase wins a tie)"
    assert (a.at_peak, a.figures, a.stack, a.differences) == (b.at_peak, b.figures, b.stack, b.differences)


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_an_answer_from_the_cache_equals_a_fresh_trace(ledger: Path, store: C.EstimateCache) -> None:
    fresh = estimate(load(ledger))  # no store: traced
    first = estimate(load(ledger), store=store)
    assert first.cached_from is None and len(_entries(store)) == 1
    again = estimate(load(ledger), store=store)
    assert again.cached_from == pytest.approx(first.seconds)
    _same(fresh, again)


def test_each_input_that_changes_the_trace_changes_the_key(ledger: Path, store: C.EstimateCache) -> None:
    doc = load(ledger)
    base = C.key(doc, {"target": "cuda"})
    assert base is not None and base == C.key(load(ledger), {"target": "cuda"})
    assert C.key(doc, {"target": "cpu"}) != base
    edited = load(ledger)
    set_plain(edited, ("workload", "microbatch"), 3, force=True)
    assert C.key(edited, {"target": "cuda"}) != base
    config = ledger.parent / "tiny-llama" / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["intermediate_size"] += 2
    config.write_text(json.dumps(data), encoding="utf-8")
    assert C.key(load(ledger), {"target": "cuda"}) != base


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_writing_the_answer_back_keeps_the_key(ledger: Path, store: C.EstimateCache) -> None:
    """estimate writes ledger.activations, x-estimate, result and the status: outputs, not inputs."""
    from tests.support import run_cli

    before = C.key(load(ledger), {"target": "cuda"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(C.DIR_ENV, str(store.folder))
        code, out, err = run_cli("estimate", ledger, "--device-memory", "4GiB")
        assert code == 0, err
        assert "from the estimate cache" not in out and ": estimate written" in err
        assert C.key(load(ledger), {"target": "cuda"}) == before
        written, stamp = ledger.read_bytes(), ledger.stat().st_mtime_ns
        code, out, err = run_cli("estimate", ledger, "--device-memory", "4GiB")
        assert code == 0, err
        assert "from the estimate cache" in out
        # the same answer again: the file is left as it is (not rewritten), and the command says so
        assert ": up to date" in err and "estimate written" not in err
        assert ledger.read_bytes() == written and ledger.stat().st_mtime_ns == stamp
        code, out, err = run_cli("estimate", ledger, "--no-cache", "--dry-run")
        assert code == 0 and "from the estimate cache" not in out


def test_code_and_stack_are_in_the_key(ledger: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = load(ledger)
    base = C.key(doc, {})
    monkeypatch.setattr(C, "code_digest", lambda: "another ledgerspec")
    assert C.key(doc, {}) != base
    monkeypatch.undo()
    monkeypatch.setattr(C, "installed_distributions", lambda: ("torch-9.9.dist-info",))
    assert C.key(doc, {}) != base


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_a_corrupt_or_foreign_entry_is_a_miss_and_is_replaced(ledger: Path, store: C.EstimateCache) -> None:
    first = estimate(load(ledger), store=store)
    (entry,) = _entries(store)
    entry.write_text("{not json", encoding="utf-8")
    again = estimate(load(ledger), store=store)
    assert again.cached_from is None
    _same(first, again)
    data = json.loads(entry.read_text(encoding="utf-8"))
    data["value"]["phases"] = "garbage"
    data["format"] = C.FORMAT + 1
    entry.write_text(json.dumps(data), encoding="utf-8")
    assert estimate(load(ledger), store=store).cached_from is None


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_a_cache_that_cannot_be_written_is_no_cache(ledger: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    store = C.EstimateCache(blocker / "cache")  # a folder under a file: mkdir fails
    assert estimate(load(ledger), store=store).cached_from is None
    assert estimate(load(ledger), store=store).cached_from is None


def test_the_folder_is_bounded_by_last_use(tmp_path: Path) -> None:
    store = C.EstimateCache(tmp_path / "cache", limit=4500)  # four entries of about 1 KB, not five
    for i in range(4):
        store.put(f"{i:064x}", {"pad": "x" * 900})
        os.utime(store.entries / f"{i:064x}.json", (1000 + i, 1000 + i))
    assert store.get(f"{0:064x}") is not None  # used: now the newest
    store.put(f"{9:064x}", {"pad": "x" * 900})
    left = {p.stem[-1] for p in _entries(store)}
    assert sum(p.stat().st_size for p in _entries(store)) <= 4500 and len(left) == 4
    assert "0" in left and "9" in left and "1" not in left


def test_the_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(C.DIR_ENV, "off")
    assert C.EstimateCache.from_environment() is None
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path / "here"))
    assert C.default_dir() == tmp_path / "here"
    monkeypatch.delenv(C.DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.default_dir() == tmp_path / "xdg" / "ledgerspec"
    monkeypatch.setenv(C.MAX_ENV, "2")
    assert C.max_bytes() == 2 * 2**20


@pytest.mark.slow
def test_a_repeated_cli_estimate_imports_no_torch(ledger: Path, tmp_path: Path) -> None:
    """The second ``ledgerspec estimate`` of the same ledger is answered before torch & co. are imported."""
    code = (
        "import sys\nfrom ledgerspec.faces.cli import main\n"
        f"rc = main(['estimate', {str(ledger)!r}, '--dry-run'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules)\n"
        "print('HEAVY', ','.join(heavy), rc)\n"
    )
    env = {**os.environ, C.DIR_ENV: str(tmp_path / "cache")}
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        for _ in range(2)
    ]
    heavy = [next(ln for ln in r.stdout.splitlines() if ln.startswith("HEAVY")) for r in runs]
    assert heavy[0] == "HEAVY bitsandbytes,peft,torch,transformers 0", runs[0].stderr
    assert heavy[1] == "HEAVY  0", runs[1].stderr
