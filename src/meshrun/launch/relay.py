"""The children's stderr, relayed through meshrun line by line when the job needs to filter
it: dropped once a rank has explained its failure in one line (``mute``), or passed through
a filter that holds and rewrites torchrun's rendezvous lines (a ``StderrFilter``).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable

from .rdzvwatch import StderrFilter


def relay_stderr(proc: subprocess.Popen[bytes], mute: Callable[[], bool] | None,
                 watch: StderrFilter | None) -> threading.Thread:
    """Copy a child's stderr to ours line by line, dropping lines once ``mute()`` holds, and
    through ``watch`` (a RendezvousWatch) when given. select() with a timeout lets held
    lines out even when the child goes quiet."""

    def write(lines: list[bytes]) -> None:
        for line in lines:
            if mute is None or not mute():
                sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()

    def pump() -> None:
        if proc.stderr is None:  # not piped: nothing to relay
            return
        fd, buf = proc.stderr.fileno(), b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if watch is not None:
                write(watch.stale())
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line += b"\n"
                write(watch.feed(line) if watch is not None else [line])
        tail = [buf] if buf else []
        write((watch.feed(buf) if watch is not None and buf else tail) + (watch.close() if watch is not None else []))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread
