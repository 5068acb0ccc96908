"""One `meshrun train` per output directory: a lock on ``OUT/.meshrun.lock``.

Two runs writing one OUT would interleave their snapshots (both write ``.tmp-step-N``; one
prunes the other's) and their metrics. The launching `meshrun train` of node rank 0 takes
this lock before it touches OUT and holds it until the run ends, restarts included; a second
run is refused with a line naming the holder. The lock is ``fcntl.flock`` on the file: the
kernel drops it when its holder exits, however it exits, so the file a killed run leaves
behind is simply taken over. The launcher takes it exclusively (no one else may hold it),
writes its host, pid and start time into the file, and keeps it shared; each training
process takes it shared too (``share``), so a launcher's death does not free OUT while
processes it started still write there. flock decides; the file's text only informs the
refusal (a holder on another host sharing the directory is named by its host). The file is
never removed: removing it would let a run lock a new file while another still holds the old one.

The directory snapshots are written to is locked the same way, flock on the directory itself
(its real path; nothing is added to it): a ``checkpoints`` that is a symlink into another run's
directory is refused while that run lives, instead of taking over its snapshots. A name in
OUT of the wrong kind (a directory at ``.meshrun.lock``) is a one-line refusal.

Torch-free: the CLI takes it before launching anything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from types import TracebackType

from ..errors import MeshrunError, bad_value
from ..lockfile import BUSY, holder_text, open_lock, read_holder, read_holder_at, try_lock, unlock, write_holder

LOCK_NAME = ".meshrun.lock"
CHECKPOINTS = "checkpoints"  # outdir.CHECKPOINTS


class OutputLock:
    """``with OutputLock(out, source):`` holds OUT for this process, or raises MeshrunError."""

    def __init__(self, out: str, source: str = "--out") -> None:
        self.out = out
        self.source = source  # where OUT came from, for the refusal
        self.path = os.path.join(out, LOCK_NAME)
        self.fd: int | None = None
        self.snapshots_fd: int | None = None  # the lock inside OUT/checkpoints, by its real path
        self.snapshots_dir: str | None = None

    def acquire(self) -> None:
        """Take OUT (creating it), and the checkpoints directory it has, or raise MeshrunError
        naming the run that holds either."""
        os.makedirs(self.out, exist_ok=True)
        fd = _open_lock(self.path, self.source, self.out)
        if fd is None:
            return
        self.fd = fd
        if os.path.isdir(os.path.join(self.out, CHECKPOINTS)):
            self.hold_snapshots()

    def hold_snapshots(self) -> None:
        """Lock the directory snapshots go to, by its real path (made when missing): call again
        after --overwrite moved the earlier one aside."""
        root = os.path.join(self.out, CHECKPOINTS)
        if not os.path.lexists(root):
            os.makedirs(root)
        if not os.path.isdir(root):
            raise bad_value(self.source, self.out, f"{root} is not a directory, where the run keeps its snapshots",
                            "move it away, or give another --out")
        real = os.path.realpath(root)
        if self.snapshots_fd is not None and self.snapshots_dir == real and _same(self.snapshots_fd, real):
            return
        self._release_snapshots()
        self.snapshots_fd = _lock_dir(real, self.source, self.out, root)
        self.snapshots_dir = real

    def _release_snapshots(self) -> None:
        if self.snapshots_fd is not None:
            unlock(self.snapshots_fd)
            self.snapshots_fd = None

    def release(self) -> None:
        self._release_snapshots()
        if self.fd is not None:
            unlock(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _open_lock(path: str, source: str, out: str, where: str | None = None) -> int | None:
    """Open and lock ``path``: exclusively, then shared, with this process's record in it.
    None on a filesystem without locks (said once on stderr)."""
    try:
        fd = open_lock(path)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise bad_value(source, out, f"its lock file {path} is not a regular file", "move it away") from None
        raise bad_value(source, out, f"its lock file {path} cannot be opened ({exc.strerror})",
                        "move that name away, or give another --out") from None
    state = try_lock(fd)
    if state != "taken":
        holder = read_holder(fd)
        os.close(fd)
        if state == "busy":
            raise MeshrunError(held_message(source, out, path, holder, where))
        print(f"meshrun: warning: cannot lock {path}: a second run on {out} would not be refused",
              file=sys.stderr, flush=True)
        return None
    write_holder(fd)
    if try_lock(fd, shared=True) != "taken":  # shared from here on, so that the workers can join (not atomic)
        os.close(fd)
        raise MeshrunError(held_message(source, out, path, read_holder_at(path), where))
    return fd


def _same(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_dir(real: str, source: str, out: str, where: str) -> int | None:
    """flock the directory ``real`` exclusively, then shared (the workers share it). Its
    holder is named from the lock of the run directory it sits in, where that is one."""
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in BUSY:
            holder = read_holder_at(os.path.join(os.path.dirname(real), LOCK_NAME))
            raise MeshrunError(held_message(source, out, real, holder, where)) from None
        return None  # a filesystem without locks: OUT's own lock said so already
    return fd


def held_message(source: str, out: str, path: str, holder: dict[str, object], where: str | None = None) -> str:
    who = holder_text(holder, gone="gone, but training processes it started still run")
    what = (f"its snapshot directory {where} (really {path}) is another meshrun train's" if where
            else "another meshrun train holds this directory")
    lock = "" if where else f"; lock {path}"
    return (f"{source}={out!r}: {what} ({who}{lock}) (hint: wait for that run to "
            "end or stop it, or give another --out" + (" with a checkpoints directory of its own" if where else "")
            + ")")


def share(out: str) -> None:
    """A training process's share of OUT's lock and of its checkpoints directory's, held until
    the process exits: while any process of a run writes there, no other run takes them.
    Raises MeshrunError when another run holds one exclusively; a filesystem without locks is
    left unguarded."""
    _share(os.path.join(out, LOCK_NAME), out)
    root = os.path.join(out, CHECKPOINTS)
    if os.path.isdir(root):
        _share(os.path.realpath(root), out, root)


def _share(path: str, out: str, where: str | None = None) -> None:
    try:
        if where:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # (the run reports an unwritable OUT where it writes)
    state = try_lock(fd, shared=True)
    if state != "taken":
        os.close(fd)
        if state == "busy":
            holder = read_holder_at(os.path.join(os.path.dirname(path), LOCK_NAME) if where else path)
            raise MeshrunError(held_message("--out", out, path, holder, where))
        return
    _SHARED.append(fd)  # open, and so locked, until the process exits


_SHARED: list[int] = []
