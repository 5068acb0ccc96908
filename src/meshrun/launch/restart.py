"""A job that restarts itself: after a crash the whole job is launched again, up to N times,
each attempt with a fresh rendezvous, and a rank's one-line error ends it at once, as does a
preemption: the job stopped because its machines are going away, not because it failed.
An attempt ends with none of its processes left running (guard.py), so a restarted job never
trains, or writes snapshots, beside the workers of the attempt before it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import BinaryIO

from ..cluster.net import free_port
from ..cluster.topology import Topology
from ..errors import PREEMPTED, RANK_STOPPED, JobFailed, MeshrunError
from . import early
from .command import Command, LaunchSpec
from .failure import TorchrunReport, parse_root_cause, signal_line, silent_line
from .node import prepare_network, run_job
from .run import NO_WAITS, Waits
from .rundir import CRASH, ERROR, INTERRUPT, PREEMPT, Report, ReportReader, RunDir

SETTLE_S = 5.0  # after a rank's collective timed out: how long the others may take to say they waited too
RETRY_PORT_STRIDE = 1  # attempt k rendezvous on master_port + k: every node computes the same port


def attempt_topology(topo: Topology, attempt: int) -> Topology:
    """The topology of attempt ``attempt``: a new rendezvous port (torchrun's in-place restarts
    kept the failed rendezvous's state; a fresh launch on a fresh port resumes cleanly). A
    port meshrun picked itself is picked anew; one the nodes agreed on moves up by the stride,
    which every node computes alike."""
    if attempt == 0:
        return topo
    if topo.source("master_port").startswith("free port"):
        return topo.replace(master_port=free_port())
    return topo.replace(master_port=topo.master_port + attempt * RETRY_PORT_STRIDE)


def run_with_restarts(command: Callable[[int], tuple[Command, LaunchSpec, Topology]], env: Mapping[str, str],
                      max_restarts: int, rdzv_timeout: int | None, run_dir: RunDir,
                      preempt_signals: tuple[int, ...] = (), waits: Waits = NO_WAITS,
                      last_snapshot: Callable[[], str] | None = None) -> int:
    """Run attempt 0, 1, ... of ``command(attempt)`` until one succeeds or ``max_restarts``
    restarts are spent; returns the last exit code. The ranks report to ``run_dir``
    (launch/rundir.py). A rank's ``error`` record (a bad input explained; its first line is
    the message) ends the job with that message: a restart would fail the same way. A job
    whose ranks wrote a ``preempt`` record stopped on one of ``preempt_signals`` (sent to the
    workers themselves) after its snapshot: its line is printed and the job ends with
    PREEMPTED, not restarted here; the same command resumes it later. Once a rank has said
    anything but an echo of another's failure, torchrun's failure report is noise, and the
    children's stderr stops being relayed.

    A failed attempt ends in one line (launch/failure.py): the first ``crash`` record a rank
    wrote (it raised), else the rank and signal or exit code read from torchrun's failure
    report, which is held back from the terminal and kept, with the rest of what torchrun
    said, in the run's log directory (torchrun-node-N.log). The job is stopped as soon as a
    rank has written its line: the others would only wait on it in a collective. Once
    restarts are spent the line ends the job as a JobFailed (exit code 1).

    ``waits`` bounds the waits for ranks (run.Waits). Each rank writes ``ready.RANK`` once
    past its rendezvous and an ``interrupt`` record with the step Ctrl-C stopped it at: Ctrl-C
    ends the job in one line and code 130, which names the snapshot a run resumes from
    (``last_snapshot``, asked once every rank ended), and a stopping signal during the
    rendezvous ends it at once: nothing the processes print after it reaches the terminal
    (their tracebacks, torchrun's), all of it stays in the log directory."""
    code = 0
    log_dir = run_dir.log_dir
    reports = ReportReader(run_dir)
    interrupted: list[tuple[int, bool]] = []  # (signal, whether the ranks were past their rendezvous)

    def mute() -> bool:
        return bool(interrupted) or reports.any()

    def ready() -> bool:
        return bool(run_dir.ready_ranks())

    waits = Waits(waits.stall_s, waits.finish_s, ready, lambda signum: interrupted.append((signum, ready())))

    try:
        for attempt in range(max_restarts + 1):
            if attempt:
                print(f"meshrun: job exited with code {code}; restart {attempt} of {max_restarts}, "
                      "resuming from the newest snapshot", file=sys.stderr, flush=True)
            cmd, spec, topo = command(attempt)
            cmd = prepare_network(topo, cmd, env, rdzv_timeout)
            log = _launcher_log(log_dir, _log_name(cmd, topo.node_rank))
            report = TorchrunReport(log=log)
            crashed = CrashWatch(run_dir, reports)
            exits: list[tuple[int, int]] = []
            try:
                code = run_job(cmd, env, topo, spec, report=report, mute_stderr=mute, to_workers=preempt_signals,
                               stop_when=crashed, waits=waits, exits=exits)
            finally:
                if log is not None:
                    log.close()
                run_dir.clear_ready()  # the next attempt has a rendezvous of its own
            if interrupted:
                said = reports.first(INTERRUPT)
                return _interrupted(*interrupted[0], said.line if said else None, last_snapshot)
            preempted = reports.first(PREEMPT)
            if preempted is not None:
                print(f"meshrun: {preempted.line}", file=sys.stderr, flush=True)
                return PREEMPTED
            if code == 0:
                return 0
            error = reports.first(ERROR)
            if error is not None and error.line:  # bad input or a non-finite loss
                raise MeshrunError(error.line)
            line = _failure_line(reports, report, log_dir, crashed, waits.stall_s, _rank_failure(cmd, exits))
            if line is None:  # torchrun's report says what no line of ours can: shown as it is
                for held in report.release():
                    sys.stderr.buffer.write(held)
                sys.stderr.flush()
            elif attempt < max_restarts:
                print(f"meshrun: {line}", file=sys.stderr, flush=True)
            else:
                raise JobFailed(line)
            reports.clear()  # the next attempt's first failure is its own
        return code
    finally:
        reports.clear()
        early.settle(preempt_signals)  # the job is over: a late warning has nothing to stop


def _interrupted(signum: int, ready: bool, said: str | None, last_snapshot: Callable[[], str] | None) -> int:
    """Say where a job ended on Ctrl-C (the step a rank said, and the snapshot it resumes
    from), or on a stopping signal during start-up; return its exit code."""
    if signum == signal.SIGINT:
        # (no rank said a step when each was killed before its handler ran: the grace ran out)
        line = said or ("interrupted while training" if ready else "interrupted during start-up")
        if ready and last_snapshot is not None:
            line += f"; {last_snapshot()}"
        print(f"meshrun: {line}", file=sys.stderr, flush=True)
        return 128 + signum
    print(f"meshrun: stopped by {signal.Signals(signum).name} during start-up, before the ranks' rendezvous "
          "formed; nothing to snapshot, and the same command starts the job again", file=sys.stderr, flush=True)
    return PREEMPTED


def _log_name(cmd: Command, node_rank: int) -> str:
    """Where this node's relayed stderr is kept: what torchrun said (torchrun-node-N.log), or
    what the ranks meshrun started itself wrote before their own logs took over
    (ranks-node-N.log: an import that failed, a warning at start-up)."""
    if cmd.processes and cmd.processes[0].rank is not None:
        return f"ranks-node-{node_rank}.log"
    return f"torchrun-node-{node_rank}.log"


def _launcher_log(log_dir: str, name: str) -> BinaryIO | None:
    try:
        os.makedirs(log_dir, exist_ok=True)
        return open(os.path.join(log_dir, name), "ab")
    except OSError:  # the run goes on; its ranks' logs say the rest
        return None


def _rank_failure(cmd: Command, exits: list[tuple[int, int]]) -> tuple[int | None, int] | None:
    """(rank, exit code) of the first rank meshrun started itself that failed, from the exit
    statuses seen; None for a launcher's job (its own report says it) or when none failed."""
    for index, code in exits:
        rank = cmd.processes[index].rank if index < len(cmd.processes) else None
        if rank is not None and code not in RANK_STOPPED:
            return rank, code
    return None


def _crashes(reports: ReportReader) -> list[Report]:
    """The ranks' own failures, each a line, without the echoes of another rank's."""
    return [r for r in reports.records(CRASH) if not r.echo and r.line]


def _echoes(reports: ReportReader) -> list[Report]:
    return [r for r in reports.records(CRASH) if r.echo and r.line]


class CrashWatch:
    """``stop_when`` of a job whose ranks write their one line as a ``crash`` record: a rank's
    error stops the job at once. A collective that timed out does so once every rank of
    this node that passed its rendezvous (``ready.RANK``) has said that it waited too (a
    timeout, or the peer-gone echo of one), or SETTLE_S later: a rank that said nothing by
    then is the one that stopped answering."""

    def __init__(self, run_dir: RunDir, reports: ReportReader) -> None:
        self.run_dir, self.reports = run_dir, reports
        self.ready: set[int] = set()  # the ranks of this node past their rendezvous
        self.first_timeout: float | None = None

    def __call__(self) -> bool:
        self.ready |= self.run_dir.ready_ranks()
        crashes = _crashes(self.reports)
        if not crashes:
            return False
        if len(self.waited()) < len(crashes):  # a rank's own error
            return True
        if self.first_timeout is None:
            self.first_timeout = time.monotonic()
        return not self.silent() or time.monotonic() - self.first_timeout >= SETTLE_S

    def waited(self) -> set[int]:
        """The ranks whose collective waited out its timeout."""
        return {r.rank for r in _crashes(self.reports) if r.timed_out}

    def silent(self) -> set[int]:
        """The ranks of this node that neither waited nor failed."""
        return self.ready - {r.rank for r in _crashes(self.reports) + _echoes(self.reports)}


def _failure_line(reports: ReportReader, report: TorchrunReport, log_dir: str, crashed: CrashWatch,
                  timeout_s: float | None = None, rank_exit: tuple[int | None, int] | None = None) -> str | None:
    """The one line of a failed attempt: the rank that stopped answering when the others'
    collectives timed out on it, else a rank's own account of its exception, else the rank and
    the signal or exit code it died of (``rank_exit``, for ranks meshrun started itself, or
    torchrun's root cause), else the line of a rank that saw another go; None when nothing
    says anything."""
    crashes = _crashes(reports)
    if timeout_s is not None and crashed.waited() and crashed.silent():
        if len(crashed.waited()) == len(crashes):
            return silent_line(sorted(crashed.silent()), sorted(crashed.waited()), int(timeout_s), log_dir)
    if crashes:
        return crashes[0].line
    cause = rank_exit or parse_root_cause(report.text())
    if cause is not None:
        rank, exitcode = cause
        path = os.path.join(log_dir, f"rank-{rank}.log") if rank is not None else log_dir
        return signal_line(rank, exitcode, path)
    echoes = _echoes(reports)
    return echoes[0].line if echoes else None
