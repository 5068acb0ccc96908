"""Execute a Command: write its files, start its processes, forward signals (signals.py),
relay their stderr (relay.py), and supervise them to the job's exit code.

Each child starts in its own session so that signals reach it exactly once, through
meshrun: a Ctrl-C or a scheduler's SIGTERM is forwarded to the child's whole process group,
as a terminal would have delivered it, and starts a grace period after which whatever is
left is killed. When one of several processes (JAX, TensorFlow) fails, the rest are stopped:
a collective would otherwise wait for the dead peer forever.

The job never outlives meshrun (guard.py): its processes carry a token in their environment,
the launched ones die with meshrun (PR_SET_PDEATHSIG), a watchdog kills the rest (torchrun's
workers, in sessions of their own) when meshrun dies by any signal, SIGKILL included, and
whatever is left when meshrun ends a job (the workers of a torchrun that died) is killed
before meshrun returns or restarts it.

Every wait on ranks is bounded (``Waits``, liveness.py): a rank of this node stopped (state T)
for the collective timeout, or ranks still running the finish timeout after another finished,
end the job with one line naming them; a stopping signal ends the job at once while a rank is
stopped, or while the ranks are still in their rendezvous, where none can stop at a step.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import RANK_STOPPED, JobFailed
from . import early, guard
from .command import Command
from .liveness import RankWatch
from .rdzvwatch import StderrFilter
from .relay import relay_stderr
from .signals import FORWARDED, STOPPING, WORKER_SIGNALS, WorkerSignals, signal_group
from .spawn import is_launcher, resolved_argv

INTERRUPT_GRACE_S = 10.0  # after Ctrl-C: how long the workers have to exit before they are killed


def exit_code(returncode: int) -> int:
    """A child killed by signal N exits like a shell reports it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class Waits:
    """The bounds and hooks of a job's waits (all optional).

    ``stall_s``: a rank of this node stopped (state T) this long ends the job with a line
    naming it (the collective timeout: its peers give up then too). ``finish_s``: ranks still
    running this long after another rank of this node finished are named and stopped.
    ``ready``: whether the ranks are past their rendezvous; before that a stopping signal
    ends the job at once (no rank can stop at a step, none has a snapshot to write).
    ``on_interrupt``: called with the signal when the job ends on SIGINT, or on a stopping
    signal before ``ready``; SIGINT then goes to the workers alone (not to a launcher, which
    would print its own traceback), and the caller says the one line."""

    stall_s: float | None = None
    finish_s: float | None = None
    ready: Callable[[], bool] | None = None
    on_interrupt: Callable[[int], None] | None = None


NO_WAITS = Waits()


class _Ending:
    """Set by the signal handler or the loop: the job must end now, and why."""

    def __init__(self) -> None:
        self.kill_now = False
        self.code = 1
        self.line: str | None = None


def execute(cmd: Command, base_env: Mapping[str, str], grace_s: float = 15.0,
            mute_stderr: Callable[[], bool] | None = None, watch: StderrFilter | None = None,
            to_workers: tuple[int, ...] = (), abort: Callable[[], bool] | None = None,
            waits: Waits = NO_WAITS, exits: list[tuple[int, int]] | None = None,
            stop_workers: bool = False) -> int:
    """Run the command; returns the job's exit code.

    ``mute_stderr``: when given, the children's stderr is relayed through this process and
    dropped once it returns True. `meshrun train` uses it to keep torchrun's own failure
    report (a traceback) off the screen after a rank has explained a bad input in one line.
    ``watch``: a RendezvousWatch the relayed stderr passes through (multi-node torchrun).
    ``to_workers``: signals sent to the training processes only (see above); they start no
    grace period: the workers end on their own once their snapshot is written, and whatever
    sent the signal enforces its own deadline.
    ``abort``: checked at every tick; once it holds, the job is killed and ends with code 1
    (the caller says why: node 0's port never answered), or with a JobFailed naming a rank
    of this node found stopped: the rank whose silence made its peers fail.
    ``waits``: the bounds on waits for ranks (see Waits); a bound that passes ends the job
    with a JobFailed whose line names the ranks.
    ``exits``: when given, (process index, exit code) is appended for each process as it ends.
    ``stop_workers``: a stopping signal (SIGINT, SIGTERM, SIGHUP) goes to a launcher's workers,
    each one, whether it handles it or not, and not to the launcher: torchrun answers one with
    its own SignalException, a traceback and exit 1 whatever its workers did. The job's code is
    then the launcher's: 0 where the workers handled the signal and exited 0, else 128+N.

    Ranks meshrun started itself (``Process.rank``) are one job: the first that fails (any
    code but 0, PREEMPTED after its snapshot, and 130 after Ctrl-C) ends the others at once,
    without a line (the caller names the rank)."""
    for path, text in cmd.files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    if cmd.note:
        print(f"meshrun: {cmd.note}", file=sys.stderr, flush=True)
    if not cmd.processes:
        return 0
    argvs = [resolved_argv(p.argv) for p in cmd.processes]  # fail before starting anything
    procs: list[subprocess.Popen[bytes]] = []
    stopping_since: list[float] = []
    relayed: list[int] = []  # stopping signals sent to the workers (stop_workers)

    workers = WorkerSignals(procs, argvs)
    relays: list[threading.Thread] = []
    ranks = RankWatch(procs, [is_launcher(a) for a in argvs], waits.stall_s, waits.finish_s)
    ending = _Ending()

    def forward(signum: int, _frame: object) -> None:
        if signum in STOPPING and watch is not None and hasattr(watch, "stopping"):
            watch.stopping()
        if signum in STOPPING and _ends_now(signum, ranks, waits, ending):
            return
        if signum == signal.SIGINT and waits.on_interrupt is not None:
            waits.on_interrupt(signum)
            workers.note(signum)
            if not stopping_since:
                stopping_since.append(time.monotonic() - grace_s + INTERRUPT_GRACE_S)
            return
        if signum in to_workers:
            workers.note(signum)
            return
        if stop_workers and signum in STOPPING:
            relayed.append(signum)
            workers.note(signum, launchers_only=True, stopping=True)
            for p, argv in zip(procs, argvs):
                if not is_launcher(argv):
                    signal_group(p, signum)
            if not stopping_since:
                stopping_since.append(time.monotonic())
            return
        if signum in WORKER_SIGNALS:
            workers.note(signum, launchers_only=True)
        elif not stopping_since:
            stopping_since.append(time.monotonic())
        for p in procs:
            signal_group(p, signum)

    token = guard.new_token()
    watchdog = guard.start_watchdog(token)  # before any process of the job exists
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for argv, p in zip(argvs, cmd.processes):
            env = {**base_env, **cmd.env, **p.env, guard.TOKEN_VAR: token}
            preexec = guard.child_preexec(WORKER_SIGNALS if is_launcher(argv) or p.rank is not None else ())
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=preexec,
                                          stderr=subprocess.PIPE if (mute_stderr or watch) else None))
        relays = [relay_stderr(p, mute_stderr, watch) for p in procs] if (mute_stderr or watch) else []
        for sig in early.take():  # came while meshrun was starting: passed on now
            forward(sig, None)
        ranked = bool(cmd.processes) and all(p.rank is not None for p in cmd.processes)
        code = _supervise(procs, stopping_since, grace_s, workers, abort, ranks, ending,
                          exits if exits is not None else [], ranked)
        if ending.line is not None:
            raise JobFailed(ending.line)
        if relayed and code != 0 and not ending.kill_now and any(map(is_launcher, argvs)):
            return 128 + relayed[0]  # the launcher's 1 says only that a worker failed
        return code
    finally:
        # a job stopped on ``abort``, or ended at once, leaves workers behind by design: no line for them
        _end_job(procs, token, watchdog, relays, quiet=ending.kill_now or (abort is not None and abort()))
        for s, h in previous.items():
            signal.signal(s, h)


def _end_job(procs: list[subprocess.Popen[bytes]], token: str, watchdog: guard.Watchdog,
             relays: list[threading.Thread], quiet: bool = False) -> None:
    """Kill what is left of the job: the launched processes still running, then any process of
    the job that outlived them (it would hold the stderr pipe open, keep training, and write
    snapshots next to a restarted job's); then let the watchdog go and the relays drain."""
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGKILL)
            p.wait()
    left = guard.stop_job(token, settle_s=1.0)
    if left and not quiet:
        print(f"meshrun: stopped {left} process(es) of the job still running after its launcher ended",
              file=sys.stderr, flush=True)
    watchdog.close(job_stopped=True)
    for relay in relays:
        relay.join(timeout=5)
    for p in procs:  # the relayed stderr pipes, drained: closed here, not left to the collector
        if p.stderr is not None and not any(r.is_alive() for r in relays):
            p.stderr.close()


TICK_S = 0.05  # while signals wait for workers' handlers, or a grace period runs
IDLE_S = 0.5  # otherwise: how late an ``abort`` may be seen


class _Waiter:
    """Sleeps until a launched process exits, a signal arrives, or the timeout passes: each
    process's pidfd becomes readable when it exits, and a wakeup pipe when a signal comes, so a
    running job costs meshrun no CPU between wakes (waking every 0.05 s to poll costs CPU all
    along: docs/decisions.md#the-launchers-supervision).
    Where pidfds are missing (not Linux 5.3+) it sleeps the short tick."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.pidfds: dict[int, int] | None = {}
        try:
            for p in procs:
                self.pidfds[p.pid] = os.pidfd_open(p.pid)
        except (AttributeError, OSError):
            self._close_pidfds()
            self.pidfds = None
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)

    def wait(self, timeout_s: float) -> None:
        if self.pidfds is None:
            time.sleep(min(timeout_s, TICK_S))
            return
        running = [self.pidfds[p.pid] for p in self.procs if p.returncode is None]
        try:
            ready, _, _ = select.select([*running, self.read_fd], [], [], timeout_s)
        except OSError:
            ready = []
        if self.read_fd in ready:
            try:
                while os.read(self.read_fd, 512):
                    pass
            except BlockingIOError:
                pass

    def _close_pidfds(self) -> None:
        for fd in (self.pidfds or {}).values():
            os.close(fd)

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        self._close_pidfds()
        os.close(self.read_fd)
        os.close(self.write_fd)


def _ends_now(signum: int, ranks: RankWatch, waits: Waits, ending: _Ending) -> bool:
    """Whether a stopping signal ends the job at once, not after the workers stop: a rank is
    stopped (it can stop at no step, and its peers wait on it), or the ranks are still in their
    rendezvous (there is nothing to snapshot, and a worker waiting there does not see it)."""
    line = ranks.stopped_line(f"the job was ended on {signal.Signals(signum).name}")
    if line is not None:
        ending.line = line
    elif waits.ready is not None and not waits.ready():
        if waits.on_interrupt is not None:
            waits.on_interrupt(signum)
        ending.code = 128 + signum
    else:
        return False
    ending.kill_now = True
    return True


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGKILL)
            p.wait()


def _supervise(procs: list[subprocess.Popen[bytes]], stopping_since: list[float], grace_s: float,
               workers: WorkerSignals, abort: Callable[[], bool] | None, ranks: RankWatch, ending: _Ending,
               exits: list[tuple[int, int]], ranked: bool) -> int:
    waiter = _Waiter(procs)
    try:
        return _supervise_loop(procs, stopping_since, grace_s, workers, abort, waiter, ranks, ending, exits, ranked)
    finally:
        waiter.close()


def _record_exits(codes: list[int | None], ended: set[int], exits: list[tuple[int, int]]) -> None:
    """Append (process index, exit code) to ``exits`` for each process first seen ended."""
    for i, code in enumerate(codes):
        if code is not None and i not in ended:
            ended.add(i)
            exits.append((i, exit_code(code)))


def _supervise_loop(procs: list[subprocess.Popen[bytes]], stopping_since: list[float], grace_s: float,
                    workers: WorkerSignals, abort: Callable[[], bool] | None, waiter: _Waiter,
                    ranks: RankWatch, ending: _Ending, exits: list[tuple[int, int]], ranked: bool) -> int:
    first_failure: int | None = None
    ended: set[int] = set()
    while True:
        if not ending.kill_now and first_failure is None:
            ending.line = ranks.tick()
            ending.kill_now = ending.line is not None
        if ending.kill_now:
            _kill_all(procs)
            return ending.code
        if abort is not None and abort():
            ending.line = ranks.stopped_line()
            _kill_all(procs)
            return 1
        if workers.signals:
            workers.deliver()
        codes = [p.poll() for p in procs]
        _record_exits(codes, ended, exits)
        if ranked and first_failure is None:
            failed = next((exit_code(c) for c in codes if c is not None and exit_code(c) not in RANK_STOPPED), None)
            if failed is not None:  # the others cannot finish a step without it: ended now
                ending.line = ranks.stopped_line()  # (a rank found stopped is the cause: named)
                _kill_all(procs)
                _record_exits([p.poll() for p in procs], ended, exits)
                return 1 if ending.line is not None else failed
        for code in codes:
            if code not in (None, 0) and first_failure is None:
                ending.line = ranks.stopped_line()  # a rank stopped: its peers died waiting on it (NCCL's abort)
                if ending.line is not None:
                    ending.kill_now = True
                    _kill_all(procs)
                    return 1
                first_failure = exit_code(code)
                if len(procs) > 1:
                    print(f"meshrun: a process exited with code {first_failure}; stopping the others",
                          file=sys.stderr, flush=True)
                stopping_since.append(time.monotonic())
                for p in procs:
                    if p.poll() is None:
                        signal_group(p, signal.SIGTERM)
        if all(c is not None for c in codes):
            if first_failure is not None:
                return first_failure
            return max(exit_code(c) for c in codes if c is not None)
        if stopping_since and time.monotonic() - stopping_since[0] > grace_s:
            for p in procs:
                if p.poll() is None:
                    signal_group(p, signal.SIGKILL)
        waiter.wait(TICK_S if (workers.signals or stopping_since) else IDLE_S)
