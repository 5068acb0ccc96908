"""Signals for a job's processes: which ones meshrun forwards, which end a job, and which go
to the workers alone (``WorkerSignals``).

SIGUSR1 and SIGUSR2 mean "checkpoint, or prepare to stop" (Slurm's ``--signal`` before the
time limit), not "stop": they start no grace period. A launcher (torchrun, Accelerate,
DeepSpeed) has no handler for them and would die of them, leaving its workers behind; a
scheduler may signal every process of a job directly (Slurm's proctrack/linuxproc), a
launcher included. So launchers start with both ignored; the workers inherit that until they
install a handler of their own (a worker still starting does not die of one), and meshrun
sends each to the launcher's children once they handle it, as below.

`meshrun train` names its preemption signals (SIGTERM, SIGUSR1) ``to_workers``: those go to
the training processes themselves, not to torchrun. torchrun starts each worker in a session
of its own, so a signal to torchrun's group never reaches them; torchrun would die of SIGUSR1
(its default action, leaving the workers behind) and answers SIGTERM by killing its workers
30 s later, while a snapshot may take longer. So meshrun signals torchrun's children, each
one alone: the worker stops after a step, writes its snapshot and exits, and torchrun sees it
exit.
"""

from __future__ import annotations

import os
import signal
import subprocess

from .liveness import children
from .spawn import is_launcher

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # signals that end a job (the others warn it)
WORKER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # ignored by launchers, sent to their workers


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class WorkerSignals:
    """Signals for the training processes alone: a launcher's children, or the process itself
    when it is no launcher. Each worker gets each signal once, as soon as it has its handler:
    torchrun's workers may not exist yet when the signal comes, and a worker still starting
    would die of it. ``deliver()`` runs again at every tick of the supervision loop until the
    job ends. A signal noted ``launchers_only`` goes to launchers' children alone (the caller
    signals the process groups). A ``stopping`` one goes to each worker whether it handles it
    or not: it is meant to end the job, and its default action does. Without /proc (not
    Linux) the signal goes to each process group at once."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], argvs: list[list[str]]) -> None:
        self.procs, self.argvs = procs, argvs
        self.signals: list[tuple[int, bool, bool]] = []  # (signal, launchers' children only, stopping)
        self.sent: set[tuple[int, int]] = set()  # (pid, signal)

    def note(self, sig: int, launchers_only: bool = False, stopping: bool = False) -> None:
        if not os.path.isdir("/proc"):
            if not launchers_only or stopping:  # (a launcher's own group: its workers are not in it)
                for p, argv in zip(self.procs, self.argvs):
                    if not launchers_only or is_launcher(argv):
                        signal_group(p, sig)
            return
        if (sig, launchers_only, stopping) not in self.signals:
            self.signals.append((sig, launchers_only, stopping))
        self.deliver()

    def deliver(self) -> None:
        for p, argv in zip(self.procs, self.argvs):
            if p.poll() is not None:
                continue
            launcher = is_launcher(argv)
            pids = children(p.pid) if launcher else [p.pid]
            for pid in pids:
                for sig, launchers_only, stopping in self.signals:
                    if launchers_only and not launcher:
                        continue
                    if (pid, sig) not in self.sent and (stopping or catches(pid, sig)):
                        self.sent.add((pid, sig))
                        try:
                            os.kill(pid, sig)
                        except (ProcessLookupError, PermissionError):
                            pass
