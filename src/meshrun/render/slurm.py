"""An sbatch script in the pattern of the PyTorch Distributed slides' Slurm script: one task
per node, srun, rendezvous on the head.

meshrun on each node reads SLURM_JOB_NODELIST (head = its first host), SLURM_NNODES,
SLURM_NODEID and SLURM_GPUS_ON_NODE, and derives the port from SLURM_JOB_ID (15000 + id mod
10000, outside the ephemeral range) unless MASTER_PORT is set. The command runs under
``bash -c '...'`` on each node, so per-node variables expand there, not on the batch host.
"""

from __future__ import annotations

import shlex

from .spec import RenderSpec


def render(spec: RenderSpec) -> str:
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={spec.name}",
             f"#SBATCH --nodes={spec.nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task or max(4, 8 * max(1, spec.gpus_per_node))}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    lines.append(f"#SBATCH --output={spec.name}-%j.out")
    lines += [
        "",
        "# Rendered by `meshrun render slurm`. Each node's meshrun finds its rank, the head node",
        "# and the port from Slurm's variables; `meshrun env` on a node shows what it resolved.",
        "set -euo pipefail",
    ]
    if spec.setup:
        lines += ["", spec.setup]
    node_cmd = "exec " + spec.shell_command()
    srun = ["srun", "--nodes", str(spec.nodes), "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if spec.image:
        srun.append(f"--container-image={spec.image}")  # pyxis/enroot
    lines += ["", " ".join(srun) + " \\", f"  bash -c {shlex.quote(node_cmd)}", ""]
    return "\n".join(lines)


def node_command(script: str) -> str:
    """The command each node runs: the ``bash -c`` argument of the srun line (tests run it
    on every simulated node with Slurm's variables set)."""
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("bash -c "):
            return shlex.split(line)[2]
    raise ValueError("no srun command in the script")
