"""An sbatch script in the pattern of pytorch/examples' Slurm script (slurm/sbatch_run.sh): one task
per node, srun, rendezvous on the head.

meshrun on each node reads SLURM_JOB_NODELIST (head = its first host), SLURM_NNODES,
SLURM_NODEID and SLURM_GPUS_ON_NODE, and derives the port from SLURM_JOB_ID (15000 + id mod
10000, outside the ephemeral range) unless MASTER_PORT is set. The command runs under
``bash -c '...'`` on each node; it is quoted twice (once for that inner bash, once for the
batch script), so every node runs exactly the argv given, with nothing substituted.

With ``requeue``: ``--signal=USR1@S`` has Slurm send SIGUSR1 S seconds before the time limit
to every job step's tasks, which are each node's meshrun (``bash -c 'exec meshrun ...'``);
the ``B:`` form would signal only this batch shell, which waits for srun and would have to
pass it on. meshrun train stops after a step every rank agrees on, writes its snapshot and
exits with PREEMPTED; on that code the script requeues the job (``--requeue`` allows it),
and the requeued job runs the same command, which resumes from the snapshot.

srun's status is the step's: with requeue it lets every node end on its own, for up to
REQUEUE_WAIT_S after the first (``--wait``), rather than kill the others as one exits 75.

CPUs: ``--cpus-per-task`` only where the user gives it. A fixed number per GPU asks more
cores than some GPU nodes have (8 per GPU is 64 on an 8-GPU node), and such a job never
starts; without a request Slurm gives the partition's default (DefCpuPerGPU, else one CPU per
task, or the whole node under exclusive allocation), which the rendered comment says.

With ``max_restarts`` N: a step that fails (a node lost, a process killed; srun's
``--kill-on-bad-exit``, or ``--wait`` with requeue, ends the other nodes' part) is run again,
up to N times, in the same allocation; meshrun train resumes from its newest committed
snapshot. A restart inside meshrun (``meshrun train --max-restarts``) survives a worker that
dies; only a new step survives a node whose meshrun itself is gone.
"""

from __future__ import annotations

import shlex

from ..errors import PREEMPTED
from .spec import SIGNAL_BEFORE_S, RenderSpec

REQUEUE_WAIT_S = 30  # how long srun lets the other nodes end after one has (requeue scripts)
# The rule for CPUs, in the script's words: it asks for the CPUs --cpus-per-task gives, or none
# of its own, so that it schedules on any node the GPUs fit on
CPU_NOTE = {
    False: ["# CPUs: none asked for here, so each node's task gets the partition's default: DefCpuPerGPU",
            "# per GPU, the whole node where nodes are exclusive, else one CPU. For more, render with",
            "# --cpus-per-task C or --sbatch-arg=--exclusive."],
    True: ["# CPUs: the --cpus-per-task above, as meshrun render was given it."],
}


def render(spec: RenderSpec) -> str:
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={spec.name}",
             f"#SBATCH --nodes={spec.nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    for option, value in (("account", spec.account), ("qos", spec.qos), ("mem", spec.mem),
                          ("constraint", spec.constraint)):
        if value is not None:
            lines.append(f"#SBATCH --{option}={value}")
    lines += [f"#SBATCH {arg}" for arg in spec.sbatch_args]
    lines.append(f"#SBATCH --output={spec.name}-%j.out")
    if spec.requeue:
        # (append: the requeued job keeps its job id, so it writes to the same file)
        lines += ["#SBATCH --open-mode=append", "#SBATCH --requeue",
                  f"#SBATCH --signal=USR1@{spec.signal_before or SIGNAL_BEFORE_S}"]
    lines += [
        "",
        "# Rendered by `meshrun render slurm`. Each node's meshrun finds its rank, the head node",
        "# and the port from Slurm's variables; `meshrun env` on a node shows what it resolved.",
        *CPU_NOTE[spec.cpus_per_task is not None],
        "set -euo pipefail",
    ]
    if spec.setup:
        lines += ["", spec.setup]
    node_cmd = "exec " + spec.shell_command()
    # A preempted job's nodes each exit 75 after the snapshot they write together, a moment
    # apart: --kill-on-bad-exit would kill the later ones as the first exits, and srun's status
    # would no longer say 75 (seen in tests/test_slurm.py). With requeue, srun waits up to
    # REQUEUE_WAIT_S after the first task ends before it ends the rest instead.
    srun = ["srun", "--nodes", str(spec.nodes), "--ntasks-per-node=1",
            *(["--kill-on-bad-exit=0", f"--wait={REQUEUE_WAIT_S}"] if spec.requeue else ["--kill-on-bad-exit=1"])]
    if spec.image:
        srun.append(shlex.quote(f"--container-image={spec.image}"))  # pyxis/enroot
    step = [" ".join(srun) + " \\", f"  bash -c {shlex.quote(node_cmd)}"]
    if not spec.requeue and not spec.max_restarts:
        return "\n".join(lines + ["", *step, ""])
    lines += ["", "status=0"]
    if spec.max_restarts:
        n = spec.max_restarts
        lines += [f"for attempt in $(seq 0 {n}); do",
                  "  status=0",
                  *(f"  {line}" for line in step[:-1]), f"  {step[-1]} || status=$?",
                  f"  # a node or a process failed: run the step again ({PREEMPTED} means preempted, below); meshrun",
                  "  # train resumes from its newest committed snapshot",
                  f'  if [ "$status" -eq 0 ] || [ "$status" -eq {PREEMPTED} ] || [ "$attempt" -eq {n} ]; '
                  'then break; fi',
                  f'  echo "meshrun: job step exited with code $status; restart $((attempt + 1)) of {n}" >&2',
                  "done"]
    else:
        lines += [*step[:-1], f"{step[-1]} || status=$?"]
    if spec.requeue:
        lines += [f"# {PREEMPTED}: meshrun train stopped on SIGUSR1 or SIGTERM after writing a snapshot; the requeued",
                  "# job runs this script again, and the same command resumes from that snapshot",
                  f'if [ "$status" -eq {PREEMPTED} ]; then',
                  '  scontrol requeue "$SLURM_JOB_ID"',
                  "fi"]
    lines += ['exit "$status"', ""]
    return "\n".join(lines)


def node_command(script: str) -> str:
    """The command each node runs: the ``bash -c`` argument of the srun line (tests run it
    on every simulated node with Slurm's variables set)."""
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("bash -c "):
            return shlex.split(line)[2]  # (a requeued job's line goes on with `|| status=$?`)
    raise ValueError("no srun command in the script")
