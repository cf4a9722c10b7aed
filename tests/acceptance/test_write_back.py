"""Writers that are killed or race each other (issue 15, items 6 and 7), in real processes.

- kill -9 at random moments, 50 runs: the file is always the old or the new text, never partial; a temp file a
  killed run left is removed by the next write, so none is left at the end;
- SIGTERM: the run unwinds and removes its own temp file at once;
- concurrent read-modify-write: every update lands (a writer that read a file another one changed meanwhile is
  refused and reads again), none is lost;
- ``validate --fix`` while ``resolve`` runs on the same file: the fix is kept, resolve refuses to write over it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.support import REPO_ROOT, TESTS, CliRunner

pytestmark = pytest.mark.slow

OLD = "ledgerspec: ledger/v1\nstatus: INSUFFICIENT DATA\n" + "".join(f"x-old-{i}: {'o' * 60}\n" for i in range(3000))
NEW = "ledgerspec: ledger/v1\nstatus: INSUFFICIENT DATA\n" + "".join(f"x-new-{i}: {'n' * 60}\n" for i in range(3000))

WRITER = textwrap.dedent(
    """
    import sys
    from ledgerspec.contract.writer import atomic_write
    from ledgerspec.faces.cli import _sigterm_unwinds
    path, old, new = sys.argv[1], open(sys.argv[2]).read(), open(sys.argv[3]).read()
    with _sigterm_unwinds():
        print("ready", flush=True)
        i = 0
        while True:  # alternate between the two texts until killed
            atomic_write(path, new if i % 2 == 0 else old)
            i += 1
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def _start_writer(tmp_path: Path, path: Path) -> subprocess.Popen[str]:
    (tmp_path / "old.txt").write_text(OLD)
    (tmp_path / "new.txt").write_text(NEW)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(tmp_path / "old.txt"), str(tmp_path / "new.txt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_kill_9_at_random_moments_leaves_old_or_new_and_no_temp_file(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    path = folder / "l.ledger.yaml"
    path.write_text(OLD)
    rng = random.Random(15)
    left_behind = 0
    for _ in range(50):
        proc = _start_writer(tmp_path, path)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()  # SIGKILL: nothing runs after it
        proc.wait(timeout=30)
        assert path.read_text() in (OLD, NEW)  # never partial
        left_behind += bool(_temps(folder))
    proc = _start_writer(tmp_path, path)  # one more run: its first write removes what killed runs left
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert path.read_text() in (OLD, NEW)
    assert _temps(folder) == []
    print(f"{left_behind} of 50 kill -9 runs left a temp file, removed by the next write")


def test_sigterm_unwinds_and_removes_its_own_temp_file(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    path = folder / "l.ledger.yaml"
    path.write_text(OLD)
    rng = random.Random(150)
    for _ in range(20):
        proc = _start_writer(tmp_path, path)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert path.read_text() in (OLD, NEW)
        assert _temps(folder) == []  # at once, not only after the next write


COUNTER = textwrap.dedent(
    """
    import sys, time
    from ledgerspec.contract.document import load
    from ledgerspec.contract.edit import set_extension
    from ledgerspec.contract.writer import save
    from ledgerspec.errors import LedgerspecError
    path, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    retries = 0
    for _ in range(n):
        while True:  # read, add one, write; a refused write (the file changed meanwhile) reads again
            doc = load(path)
            count = doc.get("x-count").raw
            set_extension(doc, ("x-count",), count + 1)
            set_extension(doc, ("x-last",), me)
            try:
                save(doc, path)
                break
            except LedgerspecError as exc:
                assert "changed since it was read" in exc.message or "another program" in exc.message, exc
                retries += 1
    print(retries)
    """
)


def test_concurrent_writers_never_lose_an_update(tmp_path: Path) -> None:
    path = tmp_path / "count.ledger.yaml"
    path.write_text("ledgerspec: ledger/v1\nstatus: INSUFFICIENT DATA  # kept\nx-count: 0\nx-last: nobody\n")
    writers, each = 4, 25
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COUNTER, str(path), f"w{i}", str(each)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(writers)
    ]
    retries = 0
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        retries += int(out.strip())
    text = path.read_text()
    assert f"x-count: {writers * each}\n" in text, text  # every increment landed
    assert "status: INSUFFICIENT DATA  # kept\n" in text
    assert _temps(tmp_path) == []
    print(f"{writers * each} updates, {retries} refused writes retried")


def test_validate_fix_during_resolve_is_never_lost(cli: CliRunner, tmp_path: Path) -> None:
    """The lost update of issue 15: a ``validate --fix`` made while ``resolve`` ran was overwritten 5 of 5 times.
    Here the fix runs inside resolve's run, after resolve read the file and before it writes; resolve then refuses
    to write (exit 2) and the fixed file stays as ``--fix`` wrote it."""
    import ledgerspec.derivations.resolve.resolver as resolver

    data = TESTS / "data" / "measure"
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_bytes((data / "tiny-llama" / "config.json").read_bytes())
    path = tmp_path / "t.ledger.yaml"
    path.write_text(
        (data / "tiny-llama-lora.yaml").read_text().replace("status: INSUFFICIENT DATA", "status: VALIDATED")
    )
    real = resolver.resolve
    fixed: list[bytes] = []

    def racing(doc: Any, **kwargs: Any) -> Any:
        _, _, err = cli("validate", "--fix", path)  # another terminal, meanwhile
        assert "status lowered from VALIDATED" in err, err
        fixed.append(path.read_bytes())
        return real(doc, **kwargs)

    with mock.patch.object(resolver, "resolve", racing):
        code, _, err = cli("resolve", path)
    assert code == 2, err
    assert err.strip().endswith(
        "write: the file changed since it was read (another command or an editor wrote it meanwhile); nothing "
        "written, so that change is kept (hint: run the command again on the new file)"
    )
    assert path.read_bytes() == fixed[0]
    code, _, err = cli("resolve", path)  # run again: resolves the fixed file
    assert code == 0, err
    assert b"status: INSUFFICIENT DATA" in path.read_bytes() or b"status: CALCULATED" in path.read_bytes()
