"""A job that restarts itself: after a crash the whole job is launched again, up to N times,
each attempt with a fresh rendezvous, and a rank's one-line error ends it at once, as does a
preemption: the job stopped because its machines are going away, not because it failed.
An attempt ends with none of its processes left running (guard.py), so a restarted job never
trains, or writes snapshots, beside the workers of the attempt before it."""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

from ..cluster.net import free_port
from ..cluster.topology import Topology
from ..errors import PREEMPTED, MeshrunError
from .command import Command, LaunchSpec
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
                      preempt_file: str | None = None, preempt_signals: tuple[int, ...] = ()) -> int:
    """Run attempt 0, 1, ... of ``command(attempt)`` until one succeeds or ``max_restarts``
    restarts are spent; returns the last exit code. A rank that explains a bad input in
    ``error_file`` (the first line is the message) ends the job with that message: a restart
    would fail the same way. A job whose ranks wrote ``preempt_file`` stopped on one of
    ``preempt_signals`` (sent to the workers themselves) after its snapshot: its line is
    printed and the job ends with PREEMPTED, not restarted here; the same command resumes it
    later. Once either file is written, torchrun's failure report is noise, and the
    children's stderr stops being relayed."""
    code = 0
    said = [path for path in (error_file, preempt_file) if path]

    def mute() -> bool:
        return any(os.path.exists(path) for path in said)

    try:
        for attempt in range(max_restarts + 1):
            if attempt:
                print(f"meshrun: job exited with code {code}; restart {attempt} of {max_restarts}, "
                      "resuming from the newest snapshot", file=sys.stderr, flush=True)
            cmd, spec, topo = command(attempt)
            cmd = prepare_network(topo, cmd, env, rdzv_timeout)
            code = run_job(cmd, env, topo, spec, mute_stderr=mute, to_workers=preempt_signals)
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
        return code
    finally:
        for path in said:
            if os.path.exists(path):
                os.unlink(path)
