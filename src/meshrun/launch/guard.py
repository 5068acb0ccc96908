"""A job never outlives the meshrun that launched it.

Every process of a job carries ``MESHRUN_JOB_TOKEN=<token>`` in its environment: meshrun sets it
on the processes it starts, and torchrun, Accelerate and DeepSpeed pass their environment on to
the workers. ``job_processes(token)`` finds them in /proc however they were reparented and in
whatever session they run (torchrun starts each worker in a session of its own), together with
the other members of their sessions (a program the worker ran with an environment of its own).

Three things end them:

- ``child_preexec()``: the launched processes get SIGKILL from the kernel when meshrun
  dies (PR_SET_PDEATHSIG), by whatever signal, SIGKILL included;
- a watchdog (``start_watchdog()``, a fork of meshrun), in a session of its own and deaf to
  the signals a terminal or a scheduler sends a job: it waits for the end of a pipe that
  only meshrun holds open, which ends when meshrun exits or dies, and then kills every process
  of the job: the workers, which the kernel's signal never reaches;
- ``stop_job()``, when meshrun ends a job itself: whatever outlived the launcher (workers of a
  torchrun that died of a signal) is killed before meshrun returns or restarts the job.

Without /proc and prctl (not Linux) there is no guard: no token scan, no watchdog, no
parent-death signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

TOKEN_VAR = "MESHRUN_JOB_TOKEN"
PR_SET_PDEATHSIG = 1
# The watchdog ignores these: a scheduler may signal every process of a job step (Slurm's
# process tracking does), and the watchdog must outlive meshrun to do its work.
DEAF_TO = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def new_token() -> str:
    return os.urandom(8).hex()


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, session id, start time in clock ticks after boot) of a process, or None when it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # state, ppid, pgrp, session, ...
        return fields[0], int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


# This process's start: a process that started before it cannot carry a token it made, so its
# environment is not read (a scan then reads the job's few processes, not the host's many).
_STARTED = (_stat("self") or ("", 0, 0))[2] if os.path.isdir("/proc") else 0


def _has_token(pid: str, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def job_processes(token: str) -> list[int]:
    """The live processes of the job: those whose environment holds the token, and every
    process in their sessions. Zombies are left out: they are dead already."""
    entry = f"{TOKEN_VAR}={token}".encode()
    live: dict[int, int] = {}  # pid -> session
    marked: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        stat = _stat(name)
        if stat is None or stat[0] in ("Z", "X") or stat[2] < _STARTED:
            continue
        live[int(name)] = stat[1]
        if _has_token(name, entry):
            marked.add(int(name))
    sessions = {live[pid] for pid in marked}
    return sorted(pid for pid, sid in live.items() if pid in marked or sid in sessions)


def stop_job(token: str, settle_s: float = 0.0, deadline_s: float = 5.0) -> int:
    """SIGKILL every process of the job, again until none is left (one may fork meanwhile) or
    ``deadline_s`` passes; returns how many were killed. ``settle_s`` first lets processes on
    their way out (helpers that exit once their parent has) go on their own. A job already
    gone costs one scan of /proc."""
    if not supported():
        return 0
    pids = job_processes(token)
    end = time.monotonic() + settle_s
    while pids and time.monotonic() < end:
        time.sleep(0.05)
        pids = job_processes(token)
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while pids and time.monotonic() < end:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
        pids = job_processes(token)
    return len(killed)


def _prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        return None


def child_preexec(ignore: tuple[int, ...] = ()) -> Callable[[], None] | None:
    """A preexec_fn for subprocess.Popen: the child ignores the signals ``ignore`` (an ignored
    signal stays ignored across exec, unlike a handler) and, on Linux, is killed when this
    process dies (PR_SET_PDEATHSIG). The kernel sends that signal when the *thread* that forked
    the child ends, so it is set only from the main thread, which lives as long as the process;
    the child checks its parent after setting it: a parent that died before would never send
    it. None when there is nothing to do."""
    prctl = _prctl() if supported() and threading.current_thread() is threading.main_thread() else None
    if prctl is None and not ignore:
        return None
    parent = os.getpid()

    def preexec() -> None:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class Watchdog:
    """The watchdog of one job (a forked copy of meshrun, or none): ``close()`` when the job
    has ended, which lets it go and reaps it."""

    def __init__(self, pid: int | None, write_fd: int | None) -> None:
        self.pid, self.write_fd = pid, write_fd

    def close(self, job_stopped: bool = False) -> None:
        """``job_stopped``: meshrun has already stopped every process of the job (stop_job),
        so the watchdog exits without scanning /proc again."""
        if self.write_fd is not None:
            if job_stopped:
                os.write(self.write_fd, b"stopped")
            os.close(self.write_fd)
            self.write_fd = None
        if self.pid is not None:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                try:
                    if os.waitpid(self.pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.01)
            else:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.pid = None


def start_watchdog(token: str) -> Watchdog:
    """Start the watchdog of the job ``token`` (nothing where unsupported): a fork of this
    process, so it costs no interpreter start, which adds up where many hosts' meshrun start at
    once on few cores (docs/decisions.md#the-launchers-supervision). It runs only the code below
    (no imports, no locks the other threads could hold) and ends with os._exit. The pipe's write
    end stays here alone: its end means this process ended."""
    if not supported():
        return Watchdog(None, None)
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return Watchdog(None, None)
    if pid == 0:  # the watchdog
        try:
            os.close(write_fd)
            os.setsid()  # no terminal's or scheduler's signal to meshrun's group reaches it
            for sig in DEAF_TO:
                signal.signal(sig, signal.SIG_IGN)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # holds no one's pipe open (a test's, srun's) while it works
                os.dup2(null, fd)
            watch(read_fd, token)
        finally:
            os._exit(0)
    os.close(read_fd)
    return Watchdog(pid, write_fd)


def watch(read_fd: int, token: str) -> None:
    """The watchdog's body: wait until meshrun's end of the pipe closes, then stop the job,
    unless meshrun wrote first that it had stopped the job itself."""
    stopped = False
    while True:
        try:
            data = os.read(read_fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        stopped = True
    if not stopped:
        stop_job(token)
