"""One ``meshrun data prepare`` per output directory: ``fcntl.flock`` on ``OUT/.meshrun-prepare.lock``.

Two preparations writing one directory would interleave their shards and their index. The
lock is taken on the directory's real path (``os.path.realpath``), before anything in it is
read or written, and held until the preparation ends; the kernel drops it when its holder
exits, however it exits, so a file a killed run leaves behind is simply taken over. The
holder writes its host and pid into the file and empties it when done; flock decides, the
text only informs the refusal. The file is never removed: removing it would let a run lock a new file while
another still holds the old one."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from types import TracebackType

from ..errors import MeshrunError, bad_value

LOCK_NAME = ".meshrun-prepare.lock"
BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class PrepareLock:
    """``with PrepareLock(out, source, wait):`` holds OUT for this process. Busy: raises a
    one-line MeshrunError naming the holder, or (``wait``) says so and waits for it."""

    def __init__(self, out: str, source: str = "--out", wait: bool = False) -> None:
        self.out = os.path.realpath(out)
        self.source, self.wait = source, wait
        self.path = os.path.join(self.out, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            os.makedirs(self.out, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise bad_value(self.source, self.out, f"cannot write there ({exc.strerror})",
                            "give a directory you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in BUSY:  # a filesystem without locks: run unguarded, and say so
                print(f"meshrun: warning: cannot lock {self.path} ({exc.strerror}): a second meshrun data "
                      f"prepare on {self.out} would not be refused", file=sys.stderr, flush=True)
                self.fd = fd
                return
            if not self.wait:
                holder = _holder(fd)
                os.close(fd)
                raise MeshrunError(self._held_message(holder)) from None
            print(f"meshrun data: waiting for {self._who(_holder(fd))}, which is preparing {self.out}",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:  # (a full disk: the lock holds all the same; the preparation says so when it writes)
            pass

    @staticmethod
    def _who(holder: dict[str, object]) -> str:
        since = f", since {holder['started']}" if holder.get("started") else ""
        return f"meshrun data prepare (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{since})"

    def _held_message(self, holder: dict[str, object]) -> str:
        return (f"{self.source}={self.out!r}: another {self._who(holder)} is writing this directory "
                f"(lock {self.path}) (hint: wait for it to end, or give another --out)")

    def release(self) -> None:
        """Empty the record (the file names no one once free), then unlock."""
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> PrepareLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _holder(fd: int) -> dict[str, object]:
    """The holder's record, or {} while it is still being written."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
