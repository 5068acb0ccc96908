"""A job that restarts itself: after a crash the whole job is launched again, up to N times,
each attempt with a fresh rendezvous, and a rank's one-line error ends it at once, as does a
preemption: the job stopped because its machines are going away, not because it failed.
An attempt ends with none of its processes left running (guard.py), so a restarted job never
trains, or writes snapshots, beside the workers of the attempt before it."""

from __future__ import annotations

import os
import sys
from typing import BinaryIO, Callable, Mapping

from ..cluster.net import free_port
from ..cluster.topology import Topology
from ..errors import PREEMPTED, JobFailed, MeshrunError
from .command import Command, LaunchSpec
from .failure import ECHO_SUFFIX, TorchrunReport, parse_root_cause, signal_line
from .node import prepare_network, run_job

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
                      crash_file: str | None = None, log_dir: str | None = None) -> int:
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
    spent the line ends the job as a JobFailed (exit code 1)."""
    code = 0
    said = [path for path in (error_file, preempt_file, crash_file) if path]
    echo_file = crash_file + ECHO_SUFFIX if crash_file else None

    def mute() -> bool:
        return any(os.path.exists(path) for path in said)

    try:
        for attempt in range(max_restarts + 1):
            if attempt:
                print(f"meshrun: job exited with code {code}; restart {attempt} of {max_restarts}, "
                      "resuming from the newest snapshot", file=sys.stderr, flush=True)
            cmd, spec, topo = command(attempt)
            cmd = prepare_network(topo, cmd, env, rdzv_timeout)
            log = _launcher_log(log_dir, topo.node_rank)
            report = TorchrunReport(log=log)
            try:
                code = run_job(cmd, env, topo, spec, report=report, mute_stderr=mute, to_workers=preempt_signals,
                               stop_when=(lambda: os.path.exists(crash_file)) if crash_file else None)
            finally:
                if log is not None:
                    log.close()
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
            line = _failure_line(crash_file, echo_file, report, log_dir)
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


def _launcher_log(log_dir: str | None, node_rank: int) -> BinaryIO | None:
    if not log_dir:
        return None
    try:
        os.makedirs(log_dir, exist_ok=True)
        return open(os.path.join(log_dir, f"torchrun-node-{node_rank}.log"), "ab")
    except OSError:  # the run goes on; its ranks' logs say the rest
        return None


def _first_line(path: str | None) -> str | None:
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.readline().strip() or None


def _failure_line(crash_file: str | None, echo_file: str | None, report: TorchrunReport,
                  log_dir: str | None) -> str | None:
    """The one line of a failed attempt: a rank's own account of its exception, else
    torchrun's root cause (the rank and the signal or exit code it died of), else the line of
    a rank that saw another go; None when nothing says anything."""
    first = _first_line(crash_file)
    if first:
        return first
    cause = parse_root_cause(report.text())
    if cause is not None:
        rank, exitcode = cause
        path = os.path.join(log_dir, f"rank-{rank}.log") if log_dir and rank is not None else log_dir
        return signal_line(rank, exitcode, path)
    return _first_line(echo_file)
