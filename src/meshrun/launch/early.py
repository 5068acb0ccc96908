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


def take() -> list[int]:
    """The signals held so far, oldest first; they are handed over once."""
    out = _pending[:]
    _pending.clear()
    return out
