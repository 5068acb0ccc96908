"""One ``meshrun data prepare`` per output directory: a lock (lockfile.py) on
``OUT/.meshrun-prepare.lock``.

Two preparations writing one directory would interleave their shards and their index. The
lock is taken on the directory's real path (``os.path.realpath``), before anything in it is
read or written, and held until the preparation ends; the holder empties its record when done."""

from __future__ import annotations

import fcntl
import os
import sys
from types import TracebackType

from ..errors import MeshrunError, bad_value
from ..lockfile import holder_text, open_lock, read_holder, try_lock, unlock, write_holder

LOCK_NAME = ".meshrun-prepare.lock"


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
            fd = open_lock(self.path)
        except OSError as exc:
            raise bad_value(self.source, self.out, f"cannot write there ({exc.strerror})",
                            "give a directory you can write to") from None
        state = try_lock(fd)
        if state == "unsupported":
            print(f"meshrun: warning: cannot lock {self.path}: a second meshrun data prepare on {self.out} "
                  "would not be refused", file=sys.stderr, flush=True)
        elif state == "busy":
            holder = read_holder(fd)
            if not self.wait:
                os.close(fd)
                raise MeshrunError(f"{self.source}={self.out!r}: another meshrun data prepare "
                                   f"({holder_text(holder)}) is writing this directory (lock {self.path}) "
                                   "(hint: wait for it to end, or give another --out)")
            print(f"meshrun data: waiting for meshrun data prepare ({holder_text(holder)}), which is preparing "
                  f"{self.out}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        if state != "unsupported":
            write_holder(fd)

    def release(self) -> None:
        """Empty the record (the file names no one once free), then unlock."""
        if self.fd is not None:
            unlock(self.fd, forget=True)
            self.fd = None

    def __enter__(self) -> PrepareLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
