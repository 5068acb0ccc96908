"""Preemption: a scheduler's warning signal stops training after a step that every rank
agrees on, once the snapshot of that step is written.

Slurm sends SIGUSR1 before the time limit (``sbatch --signal``) and SIGTERM to cancel,
requeue or preempt a job; Kubernetes and SkyPilot send SIGTERM before they take a machine.
``install()`` makes both signals only note themselves (the handler sets one variable, nothing
else: it may run between any two bytecodes of the loop). After every step the loop calls a
``StopVote``: all ranks learn whether any rank has noted a signal, at the same step, and stop
there together. ``Trainer.fit`` then writes the snapshot of that step (the periodic
snapshots' code) and raises ``Preempted``; the worker exits with ``PREEMPTED`` (75), and
the same command resumes from the snapshot.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from ..errors import PREEMPTED

if TYPE_CHECKING:
    import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_noted = 0  # the first preemption signal this process received; 0: none


def _note(signum: int, _frame: Any) -> None:
    global _noted
    if not _noted:
        _noted = signum


def install() -> None:
    """Handle the preemption signals in this process (call it from the main thread, early:
    until then either signal ends the process)."""
    for sig in SIGNALS:
        signal.signal(sig, _note)


def settle() -> None:
    """Past the run's last snapshot (finished, or stopped by a preemption) a preemption signal
    has nothing left to stop: ignore it until the process exits. Left to the handler, one that
    comes while Python finalises would end the process, since Python then puts the default
    action back for the signals it handled (a Slurm time-limit warning that reached the ranks
    of a finished run as they shut down turned it into a failure)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preempted(SystemExit):
    """Training stopped on a preemption signal after step ``step``; ``snapshot`` is the
    committed snapshot of that step (None without a checkpoint directory). Uncaught, it
    exits the process with PREEMPTED and no traceback."""

    def __init__(self, signum: int, step: int, snapshot: str | None) -> None:
        super().__init__(PREEMPTED)
        self.signum, self.step, self.snapshot = signum, step, snapshot

    def message(self) -> str:
        head = f"preempted by {signal.Signals(self.signum).name} at step {self.step}"
        if self.snapshot is None:
            return f"{head}; no snapshot without --out, so the same command starts over"
        return f"{head}; snapshot {self.snapshot} written; the same command resumes it"


class StopVote:
    """Every rank's answer to "stop now?", the same on all ranks at the same step.

    After each step, each rank starts an all-reduce (MAX) of the signal it has noted and reads
    the result of the one it started after the previous step: the ranks stop one step after
    the signal reached the first of them, and the reduction being read finished long ago. On
    CUDA the result comes back through pinned memory on a side stream, so the compute stream
    never waits for the vote and the host waits for the device only up to the previous step's
    end: it still queues a whole step ahead. Every rank calls it after every step (it is a
    collective), and ``close()`` once the loop ends without stopping."""

    def __init__(self, device: torch.device) -> None:
        import torch  # here, not above: the worker installs the handlers before torch is imported

        self.device = device
        self.cuda = device.type == "cuda"
        self._work: Any = None
        self._flag: torch.Tensor | None = None
        if self.cuda:
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._side = torch.cuda.Stream(device)
            self._event = torch.cuda.Event()

    def __call__(self) -> int:
        """After a step: the signal to stop on (every rank gets the same), or 0 to go on."""
        agreed = self._read() if self._work is not None else 0
        if not agreed:
            self._start()
        return agreed

    def close(self) -> None:
        """Finish the reduction still in flight (its answer is no longer needed)."""
        if self._work is not None:
            self._read()

    def _start(self) -> None:
        import torch
        import torch.distributed as dist

        # torch.full on the device is a fill kernel with the value as its argument: no copy
        # from host memory, so nothing here waits for the device.
        self._flag = torch.full((1,), _noted, dtype=torch.int32, device=self.device)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        if self.cuda:
            with torch.cuda.stream(self._side):
                self._work.wait()  # the side stream, not the compute stream, waits for NCCL
                self._host.copy_(self._flag, non_blocking=True)
                self._event.record(self._side)

    def _read(self) -> int:
        if self.cuda:
            self._event.synchronize()
            value = int(self._host[0])
        else:
            self._work.wait()
            value = int(self._flag[0])  # type: ignore[index]
        self._work = self._flag = None
        return value
