"""A job that restarts itself: after a crash the whole job is launched again, up to N times,
each attempt with a fresh rendezvous, and a rank's one-line error ends it at once, as does a
preemption: the job stopped because its machines are going away, not because it failed.
An attempt ends with none of its processes left running (guard.py), so a restarted job never
trains, or writes snapshots, beside the workers of the attempt before it."""

from __future__ import annotations

import glob
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
from .failure import (
    ECHO_SUFFIX,
    TorchrunReport,
    parse_root_cause,
    ranks_named,
    signal_line,
    silent_line,
    timed_out_ranks,
)
from .node import prepare_network, run_job
from .run import NO_WAITS, Waits

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
                      max_restarts: int, rdzv_timeout: int | None, error_file: str,
                      preempt_file: str | None = None, preempt_signals: tuple[int, ...] = (),
                      crash_file: str | None = None, log_dir: str | None = None,
                      waits: Waits = NO_WAITS, ready_file: str | None = None,
                      interrupt_file: str | None = None, last_snapshot: Callable[[], str] | None = None) -> int:
    """Run attempt 0, 1, ... of ``command(attempt)`` until one succeeds or ``max_restarts``
    restarts are spent; returns the last exit code. A rank that explains a bad input in
    ``error_file`` (the first line is the message) ends the job with that message: a restart
    would fail the same way. A job whose ranks wrote ``preempt_file`` stopped on one of
    ``preempt_signals`` (sent to the workers themselves) after its snapshot: its line is
    printed and the job ends with PREEMPTED, not restarted here; the same command resumes it
    later. Once either file is written, torchrun's failure report is noise, and the
    children's stderr stops being relayed.

    A failed attempt ends in one line (launch/failure.py): the first line a rank wrote to
    ``crash_file`` (it raised), else the rank and signal or exit code read from torchrun's
    failure report, which is held back from the terminal and kept, with the rest of what
    torchrun said, in ``log_dir``/torchrun-node-N.log. The job is stopped as soon as a rank has
    written its line: the others would only wait on it in a collective. Once restarts are
    spent the line ends the job as a JobFailed (exit code 1).

    ``waits`` bounds the waits for ranks (run.Waits). With ``ready_file`` (each rank writes
    READY.RANK once past its rendezvous) and ``interrupt_file`` (the step a rank says Ctrl-C
    stopped it at), Ctrl-C ends the job in one line and code 130, which names the snapshot a
    run resumes from (``last_snapshot``, asked once every rank ended), and a stopping signal
    during the rendezvous ends it at once: nothing the processes print after it reaches the
    terminal (their tracebacks, torchrun's), all of it stays in ``log_dir``."""
    code = 0
    said = [path for path in (error_file, preempt_file, crash_file, interrupt_file) if path]
    echo_file = crash_file + ECHO_SUFFIX if crash_file else None
    interrupted: list[tuple[int, bool]] = []  # (signal, whether the ranks were past their rendezvous)

    def mute() -> bool:
        return bool(interrupted) or any(os.path.exists(path) for path in said)

    if ready_file and interrupt_file:
        def ready() -> bool:
            return bool(glob.glob(glob.escape(ready_file) + ".*"))

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
            crashed = CrashWatch(crash_file, ready_file) if crash_file else None
            exits: list[tuple[int, int]] = []
            try:
                code = run_job(cmd, env, topo, spec, report=report, mute_stderr=mute, to_workers=preempt_signals,
                               stop_when=crashed, waits=waits, exits=exits)
            finally:
                if log is not None:
                    log.close()
                for ready_path in glob.glob(glob.escape(ready_file) + ".*") if ready_file else ():
                    os.unlink(ready_path)  # the next attempt has a rendezvous of its own
            if interrupted:
                return _interrupted(*interrupted[0], interrupt_file, last_snapshot)
            if preempt_file and os.path.exists(preempt_file):
                with open(preempt_file) as f:
                    print(f"meshrun: {f.readline().strip()}", file=sys.stderr, flush=True)
                return PREEMPTED
            if code == 0:
                return 0
            if os.path.exists(error_file):
                with open(error_file) as f:
                    first = f.readline().strip()
                if first:  # bad input or a non-finite loss
                    raise MeshrunError(first)
            line = _failure_line(crash_file, echo_file, report, log_dir, crashed, waits.stall_s,
                                 _rank_failure(cmd, exits))
            if line is None:  # torchrun's report says what no line of ours can: shown as it is
                for held in report.release():
                    sys.stderr.buffer.write(held)
                sys.stderr.flush()
            elif attempt < max_restarts:
                print(f"meshrun: {line}", file=sys.stderr, flush=True)
            else:
                raise JobFailed(line)
            for path in (crash_file, echo_file):  # the next attempt's first failure is its own
                if path and os.path.exists(path):
                    os.unlink(path)
        return code
    finally:
        for path in [*said, echo_file]:
            if path and os.path.exists(path):
                os.unlink(path)
        early.settle(preempt_signals)  # the job is over: a late warning has nothing to stop


def _interrupted(signum: int, ready: bool, interrupt_file: str | None,
                 last_snapshot: Callable[[], str] | None) -> int:
    """Say where a job ended on Ctrl-C (the step a rank said, and the snapshot it resumes
    from), or on a stopping signal during start-up; return its exit code."""
    if signum == signal.SIGINT:
        # (no rank said a step when each was killed before its handler ran: the grace ran out)
        line = _first_line(interrupt_file) or ("interrupted while training" if ready else "interrupted during start-up")
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


def _launcher_log(log_dir: str | None, name: str) -> BinaryIO | None:
    if not log_dir:
        return None
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


def _first_line(path: str | None) -> str | None:
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.readline().strip() or None


class CrashWatch:
    """``stop_when`` of a job whose ranks write their one line to ``crash_file``: a rank's
    error stops the job at once. A collective that timed out does so once every rank of
    this node that passed its rendezvous (``ready_file``.RANK) has said that it waited too
    (a timeout, or the peer-gone echo of one), or SETTLE_S later: a rank that said nothing by
    then is the one that stopped answering."""

    def __init__(self, crash_file: str, ready_file: str | None) -> None:
        self.crash_file, self.echo_file, self.ready_file = crash_file, crash_file + ECHO_SUFFIX, ready_file
        self.ready: set[int] = set()  # the ranks of this node past their rendezvous
        self.first_timeout: float | None = None

    def __call__(self) -> bool:
        if self.ready_file:
            self.ready |= {int(p.rpartition(".")[2]) for p in glob.glob(glob.escape(self.ready_file) + ".*")
                           if p.rpartition(".")[2].isdigit()}
        lines = _lines(self.crash_file)
        if not lines:
            return False
        if len(timed_out_ranks(lines)) < len(lines):  # a rank's own error
            return True
        if self.first_timeout is None:
            self.first_timeout = time.monotonic()
        return not self.silent() or time.monotonic() - self.first_timeout >= SETTLE_S

    def waited(self) -> set[int]:
        return timed_out_ranks(_lines(self.crash_file))

    def silent(self) -> set[int]:
        """The ranks of this node that neither waited nor failed."""
        return self.ready - ranks_named(_lines(self.crash_file) + _lines(self.echo_file))


def _lines(path: str | None) -> list[str]:
    if not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [line.strip() for line in f if line.strip()]


def _failure_line(crash_file: str | None, echo_file: str | None, report: TorchrunReport,
                  log_dir: str | None, crashed: CrashWatch | None = None, timeout_s: float | None = None,
                  rank_exit: tuple[int | None, int] | None = None) -> str | None:
    """The one line of a failed attempt: the rank that stopped answering when the others'
    collectives timed out on it, else a rank's own account of its exception, else the rank and
    the signal or exit code it died of (``rank_exit``, for ranks meshrun started itself, or
    torchrun's root cause), else the line of a rank that saw another go; None when nothing
    says anything."""
    if crashed is not None and timeout_s is not None and crashed.waited() and crashed.silent():
        lines = _lines(crash_file)
        if len(crashed.waited()) == len(lines):
            return silent_line(sorted(crashed.silent()), sorted(crashed.waited()), int(timeout_s), log_dir)
    first = _first_line(crash_file)
    if first:
        return first
    cause = rank_exit or parse_root_cause(report.text())
    if cause is not None:
        rank, exitcode = cause
        path = os.path.join(log_dir, f"rank-{rank}.log") if log_dir and rank is not None else log_dir
        return signal_line(rank, exitcode, path)
    return _first_line(echo_file)
