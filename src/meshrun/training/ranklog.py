"""Each rank's whole output in its own file, ``LOGS/rank-N.log``; the terminal keeps rank 0's
progress and one line per distinct warning.

Every rank's stderr (Python's and native code's: NCCL, Triton, CUDA) goes to its log at the
file-descriptor level, so nothing written before a crash is lost, and a native crash leaves
each thread's Python stack there (faulthandler). Ranks other than 0 write their stdout there
too. Rank 0's stdout (the run's lines and metrics) still reaches the terminal, and a copy of
it goes to its log. A Python warning reaches the terminal once, as one line, from rank 0
alone, however often it is raised (Liger's Triton warnings came hundreds of times per rank),
and in full to the log every time.

The log is appended to: a restarted or resumed run adds to the file its earlier attempts
wrote, each part opened by a header line.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import warnings
from typing import Any, TextIO

from ..errors import first_line


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank-{rank}.log")


class _Tee:
    """A text stream writing to the terminal and to the log."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal, self.log = terminal, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()

    def isatty(self) -> bool:
        return self.terminal.isatty()

    def fileno(self) -> int:
        return self.terminal.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.terminal, name)


class _WarnOnce:
    """``warnings.showwarning``: every warning in full to the log; its first line to the
    terminal the first time it is seen (rank 0 only)."""

    def __init__(self, log: TextIO, terminal: TextIO | None) -> None:
        self.log, self.terminal = log, terminal
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
        self.log.write(warnings.formatwarning(message, category, filename, lineno, line))
        self.log.flush()
        text = str(message).strip().splitlines()
        first = text[0] if text else ""
        key = (category.__name__, first)
        if self.terminal is None or key in self.seen:
            return
        self.seen.add(key)
        self.terminal.write(f"meshrun: warning (rank 0, shown once): {category.__name__}: {first_line(first)}\n")
        self.terminal.flush()


def redirect(log_dir: str, rank: int, world: int) -> str:
    """Send this rank's output to its log as the module says; returns the log's path."""
    os.makedirs(log_dir, exist_ok=True)
    path = log_path(log_dir, rank)
    # O_NOFOLLOW: a link planted after the job's check (config/outdir.py: check_kinds) fails here
    # instead of taking this rank's output out of OUT
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    log = os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="replace")
    log.write(f"==== meshrun train: rank {rank} of {world}, pid {os.getpid()}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} ====\n")
    log.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_err = None
    if rank == 0:  # the terminal's stderr, kept for the warning lines
        terminal_err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(fd, 2)
    if rank != 0:
        os.dup2(fd, 1)
    else:
        sys.stdout = _Tee(sys.stdout, log)
    faulthandler.enable(file=log, all_threads=True)
    warnings.showwarning = _WarnOnce(log, terminal_err)
    return path
