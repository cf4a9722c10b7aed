"""Starting the measurement's processes (:mod:`ledgerspec.derivations.measure.launch`): a process forked from the
preloaded server behaves as a fresh Python (environment, working directory, argv, ``__main__``, streams, exit code,
process group), falls back to a fresh Python when the environment would differ at import time, and ranks start
as torchrun starts them; ``measure --nproc`` under real torchrun gives what the forked ranks give."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ledgerspec.derivations.measure import launch
from tests.support import DATA

PROBE = """
import json, os, sys
print("out", " ".join(sys.argv[1:]))
print("err", file=sys.stderr)
json.dump(
    {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "name": __name__,
        "env": {k: os.environ.get(k) for k in ("A_VAR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
    },
    open(sys.argv[1], "w"),
)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture(params=["subprocess", pytest.param("forkserver", marks=pytest.mark.slow)])  # its server: seconds
def launcher(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(launch.ENV, request.param)
    return str(request.param)


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE), encoding="utf-8")
    return script


def test_a_launched_python_is_a_process_of_its_own(tmp_path: Path, launcher: str) -> None:
    script, out = _script(tmp_path), tmp_path / "out.json"
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "A_VAR": "x y", "EXIT": "3"}
    done = launch.run([str(script), str(out), "more"], env, timeout=120, new_session=True, cwd=str(work))
    seen = json.loads(out.read_text(encoding="utf-8"))
    assert done.returncode == 3
    assert done.stdout == f"out {out} more\n" and done.stderr == "err\n"
    assert seen["argv"] == [str(script), str(out), "more"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(work) and seen["env"]["A_VAR"] == "x y"
    assert seen["pid"] != os.getpid() and seen["pgid"] == seen["pid"]  # its own session


def test_a_module_runs_as_python_m(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "probe_mod.py").write_text(textwrap.dedent(PROBE), encoding="utf-8")
    out = tmp_path / "out.json"
    done = launch.run(["-m", "probe_mod", str(out)], timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text(encoding="utf-8"))["name"] == "__main__"


@pytest.mark.slow  # starts the fork server: seconds
def test_an_environment_read_at_import_gets_a_fresh_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.ENV, "forkserver")
    launch.run([str(_script(tmp_path)), str(tmp_path / "a.json")], timeout=120)  # the server runs
    same = launch.start([str(_script(tmp_path)), str(tmp_path / "b.json")], {**os.environ, "RANK": "1"})
    other = launch.start([str(_script(tmp_path)), str(tmp_path / "c.json")], {**os.environ, "TRANSFORMERS_X": "1"})
    assert same.forked and not other.forked
    assert same.wait(120).returncode == 0 and other.wait(120).returncode == 0
    # what kept the second from the fork, as the launcher says it (tests/conftest.py lists these for the session)
    assert launch.keeps_from_forking({**os.environ, "RANK": "1"}) == []
    assert launch.keeps_from_forking({**os.environ, "TRANSFORMERS_X": "1"}) == ["TRANSFORMERS_X"]


@pytest.mark.slow  # traces or starts processes: the full suite, not the edit loop
def test_a_timeout_kills_the_process(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n", encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run([str(script)], timeout=1, new_session=True)
    assert time.monotonic() - started < 30


def test_ranks_get_what_torchrun_gives_them(tmp_path: Path, launcher: str) -> None:
    script = _script(tmp_path)
    code, stderr = launch.run_ranks([str(script), str(tmp_path / "rank.json")], 1, dict(os.environ), 29999, 120)
    assert code == 0, stderr
    seen = json.loads((tmp_path / "rank.json").read_text(encoding="utf-8"))["env"]
    assert seen == {"A_VAR": None, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "29999"}


def test_a_failing_rank_stops_the_others(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(5)\ntime.sleep(60)\n", encoding="utf-8"
    )
    warm = tmp_path / "warm.py"
    warm.write_text("pass\n", encoding="utf-8")
    launch.run([str(warm)], timeout=120)  # the fork server (if asked for) started before the clock: its imports are
    started = time.monotonic()  # not what this test times
    code, _ = launch.run_ranks([str(script)], 2, dict(os.environ), 29998, 120)
    assert code == 5 and time.monotonic() - started < 30


@pytest.mark.slow
def test_measure_nproc_under_torchrun_equals_the_forked_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's default launch (real torchrun, fresh Pythons) and the forked ranks measure the same figures
    (gloo may still hold an all-gather buffer at a compute peak: the per-rank tests allow it, here only the held
    phases are compared, which no collective is in flight at)."""
    from ledgerspec.contract.document import load
    from ledgerspec.derivations.engine.protocol import HELD_PHASES
    from ledgerspec.derivations.measure.dist import make_request, run_ranks

    shutil.copytree(DATA / "sharding", tmp_path / "s")
    doc = load(tmp_path / "s" / "tiny-lora-measure.ledger.yaml")
    got = {}
    for how in ("subprocess", "forkserver"):
        monkeypatch.setenv(launch.ENV, how)
        outs = run_ranks(make_request(doc, 2, "cpu", 2), timeout=300)
        got[how] = [{k: o.result.phases[k].figure for k in HELD_PHASES} for o in outs]
    assert got["subprocess"] == got["forkserver"]
    assert sys.executable  # the torchrun path ran: a fresh interpreter per rank


@pytest.mark.slow  # starts the fork server: seconds
def test_the_server_keeps_the_session_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that changes the environment while the server first starts does not make every later launch of the
    session a fresh Python: the server starts with the environment kept by ``remember_environment``."""
    monkeypatch.setenv(launch.ENV, "forkserver")
    monkeypatch.setattr(launch, "_SERVER_ENV", None)
    monkeypatch.setattr(launch, "_BASE_ENV", None)
    launch.remember_environment()
    monkeypatch.setenv("A_TEST_ONLY_VARIABLE", "1")
    first = launch.start([str(_script(tmp_path)), str(tmp_path / "a.json")], dict(os.environ))
    assert not first.forked  # its environment is not the session's
    assert first.wait(120).returncode == 0
    monkeypatch.delenv("A_TEST_ONLY_VARIABLE")
    later = launch.start([str(_script(tmp_path)), str(tmp_path / "b.json")], dict(os.environ))
    assert later.forked
    assert later.wait(120).returncode == 0
