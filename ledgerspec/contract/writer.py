"""Write-back: a document as text (comments, order, quoting, blank lines, line endings and a BOM kept) and the one
save path (:func:`save`): relocation, rendering, and :func:`atomic_write`, which owns how a file is written (through
symlinks, never over a special file, read-only refused unless forced, hard links and owner kept, under a lock,
never over a change made meanwhile, no temp file left behind)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ledgerspec.contract.document import Document, relocate
from ledgerspec.contract.loader import MAX_FILE_BYTES, file_type, make_yaml
from ledgerspec.errors import EXIT_USAGE, LedgerspecError


def render(data: Any, original_text: str) -> str:
    """Dump ``data`` in the style of ``original_text`` (indentation, line endings); see :func:`document_text`
    for a whole document (its byte order mark, a status-only edit)."""
    yaml = make_yaml()
    mapping, sequence, offset = guess_indent(original_text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    buf = io.StringIO()
    yaml.dump(data, buf)
    return with_line_endings(buf.getvalue(), line_ending(original_text))


def line_ending(text: str) -> str:
    """The line ending ``text`` uses: CRLF (Windows) if any, else a lone CR (classic Mac OS) if any, else LF."""
    if "\r\n" in text:
        return "\r\n"
    if "\r" in text:
        return "\r"
    return "\n"


def with_line_endings(text: str, ending: str) -> str:
    """``text`` with every line break (CRLF, CR or LF: a comment carried over from the file keeps its own) made
    ``ending``. Raw CRs in a dump are line breaks only: ruamel writes a CR inside a value as an escape."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text if ending == "\n" else text.replace("\n", ending)


_KEY_ONLY = re.compile(r"""^[^#'"\s][^#'"]*:\s*(#.*)?$""")


def guess_indent(text: str) -> tuple[int, int, int]:
    """``(mapping, sequence, offset)`` as ``YAML.indent()`` takes them, read off ``text`` (default 2, 2, 0).

    ``mapping``: a nested key's indent relative to its parent key; ``sequence``: a block-sequence item's
    content relative to its parent key; ``offset``: the dash relative to the parent key.
    """
    mapping: int | None = None
    sequence: int | None = None
    offset = 0
    parent: int | None = None  # indent of the last `key:` line with its value on the next lines
    for line in text.splitlines():
        body = line.lstrip(" ")
        if not body.strip() or body.startswith("#"):
            continue
        lead = len(line) - len(body)
        dash = body.startswith("- ")
        if parent is not None and (lead > parent or (dash and lead == parent)):
            if dash and sequence is None:
                after = body[1:]
                offset = lead - parent
                sequence = offset + 1 + len(after) - len(after.lstrip(" "))
            elif not dash and mapping is None:
                mapping = lead - parent
        if mapping is not None and sequence is not None:
            break
        while body.startswith("- "):  # `- key:` opens a mapping at the key's column
            rest = body[1:].lstrip(" ")
            lead, body = lead + len(body) - len(rest), rest
        parent = lead if _KEY_ONLY.match(body) else None
    mapping = mapping or 2
    return mapping, max(sequence or mapping, offset + 2), offset


#: how long a writer waits for another ledgerspec writing the same file before it gives up (seconds); the
#: environment variable ``LEDGERSPEC_LOCK_TIMEOUT`` overrides it
LOCK_TIMEOUT = 10.0
LOCK_TIMEOUT_ENV = "LEDGERSPEC_LOCK_TIMEOUT"
#: the name of a temp file of :func:`atomic_write` for the file NAME (``tempfile.mkstemp``: 8 characters of
#: ``[a-z0-9_]``); one left by an interrupted run is removed by the next write of NAME
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")
FORCE_HINT = "pass --force to write it anyway, or make it writable first (chmod u+w)"


def _error(message: str, path: str, hint: str | None = None) -> LedgerspecError:
    return LedgerspecError(message, path, rule="write", hint=hint, exit_code=EXIT_USAGE)


@dataclass(frozen=True)
class _Target:
    """Where a write to ``shown`` lands: ``real`` with every symlink followed, and its stat (None: a new file)."""

    shown: str
    real: str
    st: os.stat_result | None

    @property
    def folder(self) -> str:
        return os.path.dirname(self.real) or "."


def _target(path: str | os.PathLike[str], force: bool) -> _Target:
    """Follow ``path`` to the file it names and check that ledgerspec may write there (see :func:`atomic_write`)."""
    shown = os.fsdecode(path)
    try:
        st: os.stat_result | None = os.stat(path)  # follows symlinks, /proc/self/fd/N included
    except FileNotFoundError:
        st = None  # a new file, or a dangling symlink (whose target is created, as a shell's `>` would)
    except NotADirectoryError:
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(folder) and folder != os.path.dirname(folder):
            folder = os.path.dirname(folder)
        raise _error(
            f"cannot create the folder {os.path.dirname(shown)}: {folder} is a file",
            shown,
            "choose another output path",
        ) from None
    except OSError as exc:
        raise _error(f"cannot write: {exc.strerror or exc}", shown) from None
    real = os.path.realpath(path)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise _error("is a folder", shown, "give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise _error(
                f"is {file_type(st.st_mode)}: ledgerspec writes regular files only and never replaces another kind",
                shown,
                "give the path of a regular file",
            )
        same = False
        for _ in range(5):  # another writer may replace the file (a new inode) between the two stats: look again
            try:
                same = os.path.samestat(st, os.stat(real))
            except OSError:
                same = False
            if same:
                break
            try:
                st = os.stat(path)
            except OSError:
                break
        if not same:  # /proc/self/fd/N of a deleted file, a path that keeps changing under our feet
            raise _error("cannot tell which file this path names; nothing written", shown, "give a plain path")
        if not force and (st.st_mode & 0o222 == 0 or not os.access(real, os.W_OK)):
            raise _error("is read-only; nothing written", shown, FORCE_HINT)
    return _Target(shown, real, st)


def _lock_timeout() -> float:
    try:
        return max(0.0, float(os.environ.get(LOCK_TIMEOUT_ENV, LOCK_TIMEOUT)))
    except ValueError:
        return LOCK_TIMEOUT


@contextmanager
def _locked(t: _Target) -> Iterator[os.stat_result | None]:
    """Hold an exclusive advisory lock (``flock``) on the file ``t.real``, or on its folder while it does not exist,
    and yield the file's stat as it is under the lock (None: absent).

    Every ledgerspec write takes it, for the few milliseconds of compare-and-write; a second writer waits up to
    :data:`LOCK_TIMEOUT` seconds, then fails with one clear line. A writer that waited for a file another one
    replaced meanwhile (a rename makes a new inode) locks the new file instead."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the compare-and-write check still refuses a changed file
        yield _stat_or_none(t.real)
        return
    deadline = time.monotonic() + _lock_timeout()
    while True:
        fd, on_file = _open_lock(t)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise _error(
                            f"another program is writing this file (waited {_lock_timeout():g} s for its lock); "
                            "nothing written",
                            t.shown,
                            f"run the command again when the other one has finished ({LOCK_TIMEOUT_ENV} sets the wait)",
                        ) from None
                    time.sleep(0.02)
            now = _stat_or_none(t.real)
            if (now is not None and on_file and os.path.samestat(now, os.fstat(fd))) or (now is None and not on_file):
                yield now
                return
        finally:
            os.close(fd)  # releases the lock


def _open_lock(t: _Target) -> tuple[int, bool]:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(t.real, flags)
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd, True
        os.close(fd)
        raise _error(f"is {file_type(mode)} now; nothing written", t.shown)
    except (FileNotFoundError, PermissionError):  # absent, or unreadable (mode 0200): lock the folder
        pass
    except OSError as exc:
        raise _error(f"cannot write: {exc.strerror or exc}", t.shown) from None
    try:
        return os.open(t.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)), False
    except OSError as exc:
        raise _error(f"cannot lock the folder {t.folder}: {exc.strerror or exc}", t.shown) from None


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _digest(path: str) -> str | None:
    """sha256 of the bytes of ``path`` now (None: absent)."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read(MAX_FILE_BYTES + 1)).hexdigest()
    except FileNotFoundError:
        return None


def remove_stale_temps(folder: str, name: str) -> list[str]:
    """Remove the temp files of ``name`` that interrupted runs left in ``folder`` (``.NAME.XXXXXXXX.tmp``, a regular
    file, not a link); called under the lock of ``name``, so no live writer owns one. Returns what was removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        m = TEMP_NAME.match(entry)
        if m is None or m.group("name") != name:
            continue
        path = os.path.join(folder, entry)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def atomic_write(path: str | os.PathLike[str], text: str, *, force: bool = False, expect: str | None = None) -> None:
    """Write ``text`` to ``path``: the one way ledgerspec writes a file (docs: "Writing files back").

    - a symlink is written through: its target gets the text, the link stays a link;
    - only a regular file (or a new one) is written: a folder, FIFO, device or socket is refused, never replaced;
    - a read-only file is refused (exit 2) unless ``force``;
    - under an advisory lock (:func:`_locked`); with ``expect`` (the sha256 of the bytes a command read), a file that
      changed since is refused: nothing is written, no update is lost;
    - temp files of earlier interrupted runs (``.NAME.*.tmp``) are removed;
    - the text goes to a temp file in the same folder (fsync), then atomically replaces the file (mode, owner and
      group kept); when that would break a hard link or change the owner, the file is instead rewritten in place
      from the fsynced temp (not atomic: see the docs), so links and ownership are kept.
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise _error(
            "cannot write: the text holds characters UTF-8 cannot encode (a file name that is not UTF-8?)",
            os.fsdecode(path),
        ) from None
    t = _target(path, force)
    try:
        os.makedirs(t.folder, exist_ok=True)  # `-o out/new.ledger.yaml` creates out/
    except OSError as exc:
        raise _error(f"cannot create the folder {t.folder}: {exc.strerror or exc}", t.shown) from None
    with _locked(t) as st:
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _error(f"is {file_type(st.st_mode)} now; nothing written", t.shown)
        if expect is not None and _digest(t.real) != expect:
            raise _error(
                "the file changed since it was read (another command or an editor wrote it meanwhile); nothing "
                "written, so that change is kept",
                t.shown,
                "run the command again on the new file",
            )
        remove_stale_temps(t.folder, os.path.basename(t.real))
        _write(t, st, data)


#: set by the CLI's Ctrl-C handler (:func:`note_interrupt`): an interrupt that a library swallowed (a bare ``except``
#: around an optional import catches KeyboardInterrupt too) still stops every later write
_INTERRUPTED = False


def note_interrupt(on: bool = True) -> None:
    """Remember a Ctrl-C for the rest of the command: no file is written after it, whoever caught the
    KeyboardInterrupt it raised (``on=False``: a new command starts, in the same process)."""
    global _INTERRUPTED
    _INTERRUPTED = on


def interrupted() -> bool:
    return _INTERRUPTED


def _write(t: _Target, st: os.stat_result | None, data: bytes) -> None:
    if _INTERRUPTED:
        raise KeyboardInterrupt
    tmp: str | None = None
    try:
        # signals held back while the temp file is created: a SIGTERM between its creation and the assignment of
        # its name would leave it behind (seen: delivered inside mkstemp, right after os.open); delivered here, at
        # the end of the block, it unwinds through the cleanup below
        with _signals_deferred():
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(t.real)}.", suffix=".tmp", dir=t.folder)
            except OSError as exc:
                raise _error(f"cannot write: {exc.strerror or exc}", t.shown) from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            in_place = st is not None and (st.st_nlink > 1 or not _take_owner(fh.fileno(), st))
            os.fchmod(fh.fileno(), (st.st_mode & 0o7777) if st is not None else _new_file_mode())
        with _signals_deferred():  # Ctrl-C or SIGTERM never cut an in-place copy short
            if _INTERRUPTED:  # a Ctrl-C caught while the temp file was written
                raise KeyboardInterrupt
            copied = in_place and st is not None and _rewrite_in_place(t.real, data)
        if copied:
            os.unlink(tmp)
        else:  # the usual case, and a read-only file with --force that cannot be opened for writing
            os.replace(tmp, t.real)
        _fsync_folder(t.folder)
    except BaseException as exc:
        if tmp is None:  # the temp file was not created (a LedgerspecError from mkstemp, or a signal before it)
            raise
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):  # a full disk, a quota, a target replaced by a folder meanwhile
            raise _error(f"cannot write: {exc.strerror or exc}", t.shown) from None
        raise


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered when the block ends) in the main thread; elsewhere, or without
    ``pthread_sigmask``, nothing changes."""
    import signal
    import threading

    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


def _take_owner(fd: int, st: os.stat_result) -> bool:
    """Give the temp file the target's owner and group; False when that is not allowed (then the file is written
    in place, which keeps them)."""
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) == (st.st_uid, st.st_gid):
        return True
    try:
        os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:
        return False
    return True


def _rewrite_in_place(real: str, data: bytes) -> bool:
    """Overwrite ``real`` with ``data`` through its own inode (hard links and owner kept); False when it cannot be
    opened for writing (a read-only file under --force: it is replaced instead)."""
    try:
        fd = os.open(real, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.truncate(len(data))
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _new_file_mode() -> int:
    """The usual 0666 & ~umask of a new file (not mkstemp's 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_folder(folder: str) -> None:
    """Make the rename durable (best effort: not every file system lets a folder be opened or synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable(path: str | os.PathLike[str], force: bool = False) -> None:
    """Fail early (before minutes of work) when :func:`atomic_write` would refuse or fail to write ``path``;
    changes nothing."""
    t = _target(path, force)
    folder = os.path.abspath(t.folder)
    while not os.path.exists(folder) and folder != os.path.dirname(folder):  # atomic_write creates missing folders
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise _error(
            f"cannot create the folder {os.path.dirname(t.real)}: {folder} is a file",
            t.shown,
            "choose another output path",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _error(f"cannot write: no write permission in {folder}", t.shown)


def document_text(doc: Document) -> str:
    """The text of ``doc`` as it is now: the original text with the status line edited when the status is all that
    changed (every other byte kept), else the round-trip tree rendered in the file's style; a BOM kept."""
    text = None
    if doc.edits == {("status",)} and doc.status_edit is not None:
        text = _status_line_edit(doc, *doc.status_edit)
    if text is None:
        text = render(doc.data, doc.text)
    return ("\ufeff" + text) if doc.bom else text


def render_to(doc: Document, target: str) -> str:
    """:func:`document_text` for ``doc`` written at ``target``: a relative ``identity.config_path`` is rebased so it
    still names the same config (``-o OUT`` in another folder)."""
    relocate(doc, target)
    return document_text(doc)


def save(doc: Document, target: str, force: bool = False) -> bool:
    """The one save path: write ``doc`` to ``target`` (its own file or ``-o OUT``) with :func:`render_to` and
    :func:`atomic_write`. Written back to the file it was read from, the file must be as it was read: a command
    that ran meanwhile (``validate --fix`` during ``resolve``) keeps its change, and this save is refused. Whether
    it wrote: written back to the file it was read from with the very text it was read with, nothing is written
    (False; the command says the file is up to date)."""
    expect = None
    if doc.origin is not None and os.path.realpath(target) == doc.origin[0]:
        expect = doc.origin[1]
    text = render_to(doc, target)
    digest = _text_digest(text)
    if expect is not None and digest == expect:  # the bytes it would write are the bytes it read
        return False
    atomic_write(target, text, force=force, expect=expect)
    # saved again later: the file is now what was just written (digest is None only for a text atomic_write refuses)
    if doc.origin is not None and expect is not None and digest is not None:
        doc.origin = (doc.origin[0], digest)
    return True


def _text_digest(text: str) -> str | None:
    """The sha256 of the bytes :func:`atomic_write` writes for ``text`` (as :func:`_digest` and the loader take it of
    a file's bytes); None when UTF-8 cannot encode it (``atomic_write`` then refuses it in one line)."""
    try:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:
        return None


# the scalar after `status:` and what follows it on the line: a quoted or plain token, then an optional comment
_STATUS_VALUE_RE = re.compile(r"""(?P<token>"[^"\n]*"|'[^'\n]*'|[^#\n]*?)(?P<gap>[ \t]*)(?P<comment>\#.*)?$""")
#: how a comment ledgerspec wrote beside the status begins (a user's comment is kept after ``| was:``)
STATUS_COMMENT_PREFIXES = ("ledgerspec: ",)


def _status_line_edit(doc: Document, old: Any, status: str, comment: str) -> str | None:
    """The original text with the one line that holds ``status:`` rewritten; None when the status is not a one-line
    scalar of a block mapping (flow style, multi-line: the tree is rendered instead)."""
    try:
        line, col = doc.data.lc.value("status")
    except (AttributeError, KeyError, TypeError):
        return None
    lines = doc.text.splitlines(keepends=True)
    if line >= len(lines):
        return None
    raw = lines[line]
    body = raw.rstrip("\r\n")
    ending = raw[len(body) :]
    m = _STATUS_VALUE_RE.match(body, col)
    if m is None:
        return None
    token = m.group("token")
    if token.strip("\"' ") != str(old):
        return None  # not a one-line scalar we understand (multi-line, flow style, ...)
    quote = token[0] if token[:1] in ("'", '"') else ""
    previous = (m.group("comment") or "")[1:].strip()
    if previous and not previous.startswith(STATUS_COMMENT_PREFIXES):
        comment += f" | was: {previous}"
    lines[line] = f"{body[:col]}{quote}{status}{quote}  # {comment}{ending}"
    return "".join(lines)
