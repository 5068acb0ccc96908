"""IBM Spectrum LSF: a ``bsub`` script whose job step runs meshrun once per compute node.

``jsrun -n NODES -r 1 -a 1`` starts one task per node (jsrun's resource sets: one per host,
one task each, all of the host's GPUs and cores), and each task gets JSM_NAMESPACE_SIZE and
JSM_NAMESPACE_RANK, which meshrun's ``lsf`` platform reads as the node count and the node rank;
the hosts and the master come from the job's LSB_DJOB_RANKFILE, the port from the job id. The
job asks for whole nodes (``-nnodes``, the form of LSF clusters that run jsrun); the first host
of the allocation is the launch node, where this script runs and no training does.
"""

from __future__ import annotations

import shlex

from .spec import RenderSpec


def render(spec: RenderSpec) -> str:
    lines = ["#!/bin/bash",
             f"#BSUB -J {spec.name}",
             f"#BSUB -nnodes {spec.nodes}",
             f"#BSUB -o {spec.name}-%J.out"]
    if spec.time:
        lines.append(f"#BSUB -W {spec.time}")
    if spec.partition:
        lines.append(f"#BSUB -q {spec.partition}")
    if spec.account:
        lines.append(f"#BSUB -P {spec.account}")
    lines += [
        "",
        "# Rendered by `meshrun render lsf`. Each node's meshrun finds its rank from jsrun's",
        "# JSM_NAMESPACE_* variables and the hosts from LSF's LSB_DJOB_RANKFILE; `meshrun env` in a",
        "# job step shows what it resolved.",
        "set -euo pipefail",
    ]
    if spec.setup:
        lines += ["", spec.setup]
    gpus = f" -g {spec.gpus_per_node}" if spec.gpus_per_node else ""
    lines += ["", f"jsrun -n {spec.nodes} -r 1 -a 1 -c ALL_CPUS{gpus} \\",
              f"  bash -c {shlex.quote('exec ' + spec.shell_command())}", ""]
    return "\n".join(lines)


def node_command(script: str) -> str:
    """The command each node runs: the ``bash -c`` argument of the jsrun line."""
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("bash -c "):
            return shlex.split(line)[2]
    raise ValueError("no jsrun line")
