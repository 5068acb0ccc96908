"""Signals that arrive before a job's processes exist.

A scheduler's warning can come at any moment of a job, also in the second or two
`meshrun train` spends starting (imports, detection, the port checks) before it launches
anything; by default SIGUSR1 and SIGTERM would end it there, and with it the job, without a
snapshot. ``hold()`` runs first thing and keeps such signals; ``execute()`` takes them once the
job's processes are up and passes them on as if they had just come.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

_pending: list[int] = []


def _keep(signum: int, _frame: object) -> None:
    if signum not in _pending:
        _pending.append(signum)


def hold(signals: Iterable[int]) -> None:
    for sig in signals:
        signal.signal(sig, _keep)


def settle(signals: Iterable[int]) -> None:
    """Ignore ``signals`` from here until the process exits: called once the job's processes
    are all gone, when a late warning has nothing left to stop. Python puts the default action
    (the end of the process) back for the signals it handled as it finalises, so a scheduler's
    SIGUSR1 reaching a launcher in its last milliseconds ended a finished job as killed by it
    (a requeued Slurm job that had trained to its last step ended FAILED); an ignored signal
    stays ignored at the OS level."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def take() -> list[int]:
    """The signals held so far, oldest first; they are handed over once."""
    out = _pending[:]
    _pending.clear()
    return out
