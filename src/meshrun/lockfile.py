"""The lock file meshrun holds a directory with (one run per `meshrun train --out`, one
preparation per `meshrun data prepare --out`): ``fcntl.flock`` on a file, and the holder's
record in it.

flock decides; the record (host, pid, start time) only informs the refusal, so a holder on
another host sharing the directory is named by its host. The kernel drops the lock when its
holder exits, however it exits, so the file a killed run leaves behind is simply taken over;
the file is never removed: removing it would let a run lock a new file while another still
holds the old one."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's errors for a lock someone holds


def open_lock(path: str) -> int:
    """The lock file at ``path``, created when missing; never a symlink followed, and refused
    (OSError) when it is not a regular file. Not inherited by the processes meshrun starts."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def try_lock(fd: int, shared: bool = False) -> str:
    """Take the lock without waiting: "taken", "busy" (another holds it), or "unsupported"
    (a filesystem without locks, some NFS mounts: the caller runs unguarded and says so)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        return "busy" if exc.errno in BUSY else "unsupported"
    return "taken"


def write_holder(fd: int) -> None:
    """This process's record in the lock file it holds. A full disk leaves the record out: the
    lock holds all the same."""
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass


def unlock(fd: int, forget: bool = False) -> None:
    """Let go of the lock and close the file; ``forget``: empty the record first, so that a
    free lock names no one."""
    if forget:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def read_holder(fd: int) -> dict[str, object]:
    """The holder's record, or {} while it is still being written or was edited."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def read_holder_at(path: str) -> dict[str, object]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return read_holder(fd)
    finally:
        os.close(fd)


def holder_text(holder: dict[str, object], gone: str = "gone") -> str:
    """``host H, pid P, since T`` of a record; a holder of this host whose process is gone is
    said to be (``gone``: the words that say it)."""
    host, pid = holder.get("host", "?"), holder.get("pid", "?")
    since = f", since {holder['started']}" if holder.get("started") else ""
    if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        since += f", {gone}"
    return f"host {host}, pid {pid}{since}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
