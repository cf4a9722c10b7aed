"""How ledgerspec writes a file (issue 15, items 4-7; docs: "Writing files back"): through symlinks, never over a
special file, read-only refused unless forced, hard links and owner kept, stale temp files removed, an advisory lock,
and a compare-and-write that never loses a change made meanwhile. The loops that kill writers and race them are in
``tests/acceptance/test_write_back.py``."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from pathlib import Path
from unittest import mock

import pytest

from ledgerspec.contract.document import load
from ledgerspec.contract.edit import set_extension
from ledgerspec.contract.writer import atomic_write, check_writable, save
from ledgerspec.errors import LedgerspecError
from tests.support import EXAMPLES, CliRunner

OVERCLAIMED = (EXAMPLES / "downgraded.ledger.yaml").read_bytes()


def _ledger(folder: Path, name: str = "l.ledger.yaml", data: bytes = OVERCLAIMED) -> Path:
    """A ledger whose declared status claims more than its evidence: `validate --fix` rewrites it."""
    folder.mkdir(parents=True, exist_ok=True)
    _configs(folder)
    path = folder / name
    path.write_bytes(data)
    return path


def _configs(folder: Path) -> None:
    """The model configs the examples name (identity.config_path is relative to the document: LS008)."""
    if not (folder / "configs").exists():
        shutil.copytree(EXAMPLES / "configs", folder / "configs")


def _fix(cli: CliRunner, *paths: Path | str, force: bool = False) -> tuple[int, str, str]:
    return cli("validate", "--fix", *(["--force"] if force else []), *paths)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_the_example_is_overclaimed(cli: CliRunner, tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    code, _, err = _fix(cli, path)
    assert "status lowered" in err and path.read_bytes() != OVERCLAIMED, err
    assert code == 0


# -- symlinks: written through, the link kept ------------------------------------------------------------------


def test_fix_writes_through_a_symlink(cli: CliRunner, tmp_path: Path) -> None:
    """--fix on a symlink used to turn the link into a regular file and leave its target unchanged."""
    target = _ledger(tmp_path / "real")
    link = tmp_path / "link.ledger.yaml"
    _configs(tmp_path)
    link.symlink_to(os.path.relpath(target, tmp_path))
    code, out, err = _fix(cli, link)
    assert code == 0, out + err
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(target, tmp_path)
    assert target.read_bytes() != OVERCLAIMED and b"status: CANDIDATE" in target.read_bytes()
    assert link.read_bytes() == target.read_bytes()
    assert _temps(tmp_path) == [] and _temps(tmp_path / "real") == []


def test_a_chain_of_symlinks_and_a_dangling_one(tmp_path: Path) -> None:
    target = _ledger(tmp_path / "a" / "b")
    first = tmp_path / "first"
    second = tmp_path / "a" / "second"
    second.symlink_to(target)
    first.symlink_to(second)
    atomic_write(first, "ledgerspec: ledger/v1\n")
    assert first.is_symlink() and second.is_symlink() and target.read_text() == "ledgerspec: ledger/v1\n"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "made-by-the-write.yaml")
    atomic_write(dangling, "x: 1\n")  # as a shell's `>` does: the target is created, the link stays
    assert dangling.is_symlink() and (tmp_path / "made-by-the-write.yaml").read_text() == "x: 1\n"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(LedgerspecError, match="cannot write") as err:
        atomic_write(loop, "x\n")
    assert err.value.exit_code == 2


# -- special files: refused, never replaced --------------------------------------------------------------------


def test_html_onto_a_fifo_is_refused_and_the_fifo_kept(cli: CliRunner, tmp_path: Path) -> None:
    """report --html onto a FIFO used to replace it with a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, out, err = cli("report", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--html", fifo)
    assert code == 2 and out == ""
    assert err.startswith(f"{fifo}: write: is a FIFO: ledgerspec writes regular files only")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_symlink_to_proc_self_fd_of_a_pipe_is_refused(cli: CliRunner, tmp_path: Path) -> None:
    """A symlink to /proc/self/fd/N (here a pipe) used to be replaced by a regular file."""
    read, write = os.pipe()
    try:
        link = tmp_path / "out.html"
        link.symlink_to(f"/proc/self/fd/{write}")
        code, _, err = cli("report", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--html", link)
        assert code == 2 and "is a FIFO" in err, err
        assert link.is_symlink() and os.readlink(link) == f"/proc/self/fd/{write}"
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_character_device_is_refused_and_kept(cli: CliRunner, tmp_path: Path) -> None:
    """As root, ``-o /dev/stdout`` would have replaced the device node; here a copy of /dev/null's node in tmp."""
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for args in (["report", EXAMPLES / "llama-2-7b-lora.ledger.yaml", "--html", node], ["init", "-o", node, "--force"]):
        code, _, err = cli(*args)
        assert code == 2 and "is a character device" in err, err
        assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerspecError, match="is a folder"):
        atomic_write(tmp_path, "x\n")
    with pytest.raises(LedgerspecError, match="is a folder"):
        check_writable(tmp_path)


# -- read-only files: refused (exit 2) unless --force -------------------------------------------------------------


def test_fix_refuses_a_read_only_file_unless_forced(cli: CliRunner, tmp_path: Path) -> None:
    """A mode-0444 ledger in a writable folder used to be rewritten by --fix (and by resolve)."""
    path = _ledger(tmp_path)
    path.chmod(0o444)
    code, out, err = _fix(cli, path)
    assert code == 2, out + err
    assert f"{path}:1:1: write: error: is read-only; nothing written (hint: pass --force" in out
    assert path.read_bytes() == OVERCLAIMED and stat.S_IMODE(path.stat().st_mode) == 0o444
    code, out, err = _fix(cli, path, force=True)
    assert code == 0 and "status lowered" in err
    assert path.read_bytes() != OVERCLAIMED and stat.S_IMODE(path.stat().st_mode) == 0o444  # the mode is kept


def test_fix_on_several_files_one_unwritable(cli: CliRunner, tmp_path: Path) -> None:
    """One unwritable file used to abort the run with no findings printed for any file."""
    first, locked, last = (_ledger(tmp_path, f"{n}.ledger.yaml") for n in ("a", "b", "c"))
    locked.chmod(0o444)
    code, out, err = _fix(cli, first, locked, last)
    assert code == 2
    assert first.read_bytes() != OVERCLAIMED and last.read_bytes() != OVERCLAIMED
    assert locked.read_bytes() == OVERCLAIMED
    for p in (first, locked, last):
        assert f"{p}: ledger/v1, status" in out, out  # every file's summary
    assert f"{locked}:1:1: write: error: is read-only" in out
    assert err.count("status lowered") == 2


@pytest.mark.parametrize(
    "args",
    [
        ["resolve", "FILE"],
        ["resolve", "INTAKE", "-o", "FILE"],
        ["estimate", "FILE", "--target", "cpu"],
        ["measure", "FILE"],
        ["triage", "FILE"],
        ["report", "LEDGER", "--html", "FILE"],
    ],
    ids=lambda a: "-".join(x for x in a if x.isalpha() or x.startswith("-")),
)
def test_every_writing_command_refuses_a_read_only_target_before_working(
    args: list[str], cli: CliRunner, tmp_path: Path
) -> None:
    """The check comes first (before a model is built); --force is the one opt-in, the same flag everywhere."""
    path = _ledger(tmp_path, data=(EXAMPLES / "llama-2-7b-lora.ledger.yaml").read_bytes())
    path.chmod(0o444)
    subst = {"FILE": str(path), "LEDGER": str(EXAMPLES / "llama-2-7b-lora.ledger.yaml")}
    subst["INTAKE"] = str(EXAMPLES / "llama-2-7b-lora.intake.yaml")
    with mock.patch("ledgerspec.derivations.resolve.resolver.resolve", side_effect=AssertionError("built")):
        code, _, err = cli(*[subst.get(a, a) for a in args])
    assert code == 2, err
    assert err == (
        f"{path}: write: is read-only; nothing written (hint: pass --force to write it anyway, or make it "
        "writable first (chmod u+w))\n"
    )
    assert "--force" in cli(args[0], "--help")[1]


def test_init_output_read_only_needs_force(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "new.ledger.yaml"
    out.write_text("old\n")
    out.chmod(0o444)
    assert "file exists" in cli("init", "-o", out)[2]
    code, _, err = cli("init", "-o", out, "--force")
    assert code == 0, err
    assert out.read_text().startswith("# Training Memory Ledger skeleton")
    assert stat.S_IMODE(out.stat().st_mode) == 0o444


# -- hard links and ownership ----------------------------------------------------------------------------------


def test_fix_keeps_hard_links(cli: CliRunner, tmp_path: Path) -> None:
    """Rename-based writing used to break hard links: the other name kept the old text."""
    path = _ledger(tmp_path)
    other = tmp_path / "other-name.yaml"
    os.link(path, other)
    inode = path.stat().st_ino
    _fix(cli, path)
    assert path.read_bytes() != OVERCLAIMED
    assert other.read_bytes() == path.read_bytes()
    assert path.stat().st_ino == inode == other.stat().st_ino and path.stat().st_nlink == 2
    assert _temps(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_fix_keeps_owner_and_group(cli: CliRunner, tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    os.chown(path, 12345, 23456)
    _fix(cli, path)
    st = path.stat()
    assert path.read_bytes() != OVERCLAIMED and (st.st_uid, st.st_gid) == (12345, 23456)


def test_when_the_owner_cannot_be_kept_the_file_is_written_in_place(tmp_path: Path) -> None:
    """A user who may write a file but not give it away (a group-writable file of someone else): the rename would
    change its owner, so the fsynced temp is copied into the file itself."""
    path = _ledger(tmp_path)
    inode = path.stat().st_ino
    real_fstat = os.fstat

    def other_owner(fd: int) -> os.stat_result:  # the temp file looks owned by someone else
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *st[5:10]))

    with (
        mock.patch("ledgerspec.contract.writer.os.fstat", other_owner),
        mock.patch("ledgerspec.contract.writer.os.fchown", side_effect=PermissionError(1, "Operation not permitted")),
    ):
        atomic_write(path, "ledgerspec: ledger/v1\n")
    assert path.read_text() == "ledgerspec: ledger/v1\n" and path.stat().st_ino == inode
    assert _temps(tmp_path) == []


# -- stale temp files --------------------------------------------------------------------------------------------


def test_stale_temp_files_of_interrupted_runs_are_removed(cli: CliRunner, tmp_path: Path) -> None:
    """kill -9 after the temp file is created used to leave ``.NAME.*.tmp`` behind for good."""
    path = _ledger(tmp_path)
    stale = [tmp_path / ".l.ledger.yaml.abc_1234.tmp", tmp_path / ".l.ledger.yaml.zzzzzzzz.tmp"]
    for s in stale:
        s.write_text("half a ledger")
        s.chmod(0o600)
    kept = [
        tmp_path / ".other.ledger.yaml.abc_1234.tmp",  # another file's
        tmp_path / ".l.ledger.yaml.notmine.tmp",  # not mkstemp's pattern (7 characters)
        tmp_path / "l.ledger.yaml.abc_1234.tmp",  # no leading dot
    ]
    for k in kept:
        k.write_text("x")
    link = tmp_path / ".l.ledger.yaml.lnk_5678.tmp"
    link.symlink_to(kept[0])
    _fix(cli, path)
    assert not any(s.exists() for s in stale)
    assert all(k.exists() for k in kept) and link.is_symlink()


# -- the lock and the compare-and-write --------------------------------------------------------------------------


def test_a_second_writer_waits_then_fails_clearly(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _ledger(tmp_path)
    monkeypatch.setenv("LEDGERSPEC_LOCK_TIMEOUT", "0.3")
    with path.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another ledgerspec in the middle of its write
        code, out, _ = _fix(cli, path)
    assert code == 2
    assert (
        f"{path}:1:1: write: error: another program is writing this file (waited 0.3 s for its lock); nothing " in out
    )
    assert path.read_bytes() == OVERCLAIMED
    assert _fix(cli, path)[0] == 0 and path.read_bytes() != OVERCLAIMED  # released: the next run writes


def test_a_change_made_since_the_read_is_never_overwritten(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    doc = load(path)
    set_extension(doc, ("x-note",), "mine")
    path.write_bytes(OVERCLAIMED + b"# an edit made meanwhile\n")
    with pytest.raises(LedgerspecError, match="the file changed since it was read") as err:
        save(doc, str(path))
    assert err.value.exit_code == 2
    assert path.read_bytes().endswith(b"# an edit made meanwhile\n")
    save(doc, str(tmp_path / "elsewhere.yaml"))  # -o OUT: another file, written
    doc2 = load(path)
    set_extension(doc2, ("x-note",), "one")
    save(doc2, str(path))
    set_extension(doc2, ("x-note",), "two")  # a second save of the same document: what it wrote is expected
    save(doc2, str(path))
    assert load(path).get("x-note").raw == "two"


def test_a_file_replaced_while_waiting_for_the_lock_is_locked_anew(tmp_path: Path) -> None:
    """The lock is on the file's inode: a writer that waited on a file another one replaced (rename) locks the new
    file before it compares and writes."""
    from ledgerspec.contract import writer

    path = _ledger(tmp_path)
    calls: list[int] = []
    real = writer._open_lock

    def replaced_on_first_open(t: writer._Target) -> tuple[int, bool]:
        fd, on_file = real(t)
        if not calls:
            tmp = tmp_path / "new"
            tmp.write_bytes(b"ledgerspec: ledger/v1\n")
            os.replace(tmp, path)  # another writer's rename, after we opened the old inode
        calls.append(fd)
        return fd, on_file

    with mock.patch.object(writer, "_open_lock", replaced_on_first_open):
        atomic_write(path, "x: 1\n")
    assert len(calls) == 2 and path.read_text() == "x: 1\n"


def test_line_endings_cr_only_are_kept(tmp_path: Path) -> None:
    """A CR-only file used to come back with mixed line endings."""
    path = tmp_path / "cr.ledger.yaml"
    path.write_bytes(OVERCLAIMED.replace(b"\n", b"\r"))
    doc = load(path)
    set_extension(doc, ("x-note",), "added")  # a tree edit: the whole document is rendered
    save(doc, str(path))
    raw = path.read_bytes()
    assert b"\n" not in raw and raw.count(b"\r") > 10 and b"x-note: added\r" in raw
    assert load(path).plain == {**doc.plain}


def test_text_that_utf8_cannot_encode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerspecError, match="UTF-8 cannot encode"):
        atomic_write(tmp_path / "x.yaml", "name: \udcff\n")
    assert not (tmp_path / "x.yaml").exists() and _temps(tmp_path) == []
