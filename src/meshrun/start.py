"""The `meshrun` command's first lines (the console script and ``python -m meshrun``), run
before the CLI is imported.

A scheduler's preemption warning may come in the second `meshrun train` spends importing and
detecting before it launches anything: SIGTERM and SIGUSR1 are held from here (launch/early.py)
and passed on once the job's processes exist, instead of ending the job without a snapshot.
Importing ``meshrun.cli`` itself changes no process state."""

from __future__ import annotations

import signal
import sys


def run() -> None:
    if sys.argv[1:2] == ["train"]:
        from .launch.early import hold

        hold((signal.SIGTERM, signal.SIGUSR1))
    from .cli import entry

    entry()
