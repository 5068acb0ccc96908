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

Torch-free: the CLI takes it before launching anything.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from types import TracebackType

from ..errors import MeshrunError

LOCK_NAME = ".meshrun.lock"


class OutputLock:
    """``with OutputLock(out, source):`` holds OUT for this process, or raises MeshrunError."""

    def __init__(self, out: str, source: str = "--out") -> None:
        self.out = out
        self.source = source  # where OUT came from, for the refusal
        self.path = os.path.join(out, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take OUT (creating it) or raise MeshrunError naming the run that holds it."""
        os.makedirs(self.out, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # (not inherited by the workers)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise MeshrunError(self._held_message(holder)) from None
            # A filesystem without locks (some NFS mounts): run unguarded, and say so.
            print(f"meshrun: warning: cannot lock {self.path} ({os.strerror(exc.errno or 0)}): a second run on "
                  f"{self.out} would not be refused", file=sys.stderr, flush=True)
            return
        self.fd = fd
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        try:  # shared from here on, so that the workers can join (not atomic: checked)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self.fd = None
            raise MeshrunError(self._held_message(_read_holder_at(self.path))) from None

    def _held_message(self, holder: dict[str, object]) -> str:
        host, pid = holder.get("host", "?"), holder.get("pid", "?")
        since = f", since {holder['started']}" if holder.get("started") else ""
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            since += ", gone, but training processes it started still run"
        return (f"{self.source}={self.out!r}: another meshrun train holds this directory (host {host}, pid {pid}"
                f"{since}; lock {self.path}) (hint: wait for that run to end or stop it, or give another --out)")

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def share(out: str) -> None:
    """A training process's share of OUT's lock, held until the process exits: while any
    process of a run writes in OUT, no other run takes it. Raises MeshrunError when another
    run holds OUT exclusively; a filesystem without locks is left unguarded."""
    path = os.path.join(out, LOCK_NAME)
    try:
        os.makedirs(out, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # (the run reports an unwritable OUT where it writes)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise MeshrunError(OutputLock(out)._held_message(_read_holder_at(path))) from None
        return
    _SHARED.append(fd)  # open, and so locked, until the process exits


_SHARED: list[int] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _read_holder_at(path: str) -> dict[str, object]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, object]:
    """The holder's record, or {} while it is still being written or was edited."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
