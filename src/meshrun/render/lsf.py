"""IBM Spectrum LSF: a ``bsub`` script that starts meshrun once per host, by one of three launchers
(``--launcher``), each matching what meshrun's ``lsf`` or ``mpi`` platform reads on the node.

blaunch (the default: any LSF cluster). The job asks for slots, one per GPU (``-n NODES*G`` with
``span[ptile=G]``, so G on each host) and G GPUs on each host (``-gpu "num=G/host"``: per host
whatever a site sets for per-task GPU requests). The script runs on the first execution host;
it writes the job's hosts, each once, in the order meshrun's lsf platform takes them for a
blaunch task (LSB_DJOB_RANKFILE, else LSB_MCPU_HOSTS; none dropped), to a file, checks there
are NODES of them, and runs ``blaunch -u FILE``: one task per line, numbered by LSF_PM_TASKID
from 1 in the file's order (as Open MPI's LSF launch relies on), which meshrun reads as node
rank + 1; the master is the first host.

jsrun (an IBM CSM cluster, whose jobs ask for whole nodes with ``-nnodes``; jsrun exists only
there): ``jsrun -n NODES -r 1 -a 1`` starts one task per node (one resource set per host, one
task, all of the host's GPUs and cores), and each task gets JSM_NAMESPACE_SIZE and
JSM_NAMESPACE_RANK, the node count and the node rank; the hosts come from LSB_DJOB_RANKFILE,
whose first slot is the launch node, where this script runs and no training does.

mpirun (Open MPI, whose variables meshrun's mpi platform reads): the same slot request as
blaunch and the same host file; ``mpirun -n NODES --map-by ppr:1:node --hostfile FILE``
places rank i on the file's host i, and ``-x MASTER_ADDR`` passes the first host to every rank.

The port is derived from the job id on every node (the lsf platform), or from mpirun's job id.
"""

from __future__ import annotations

import shlex

from .spec import RenderSpec

# the job's hosts, each once, in order: what meshrun's lsf platform lists for a blaunch task
HOSTS = [
    'hostfile="$(mktemp)"',
    'trap \'rm -f "$hostfile"\' EXIT',
    'if [ -n "${LSB_DJOB_RANKFILE:-}" ]; then',
    '  awk \'NF && !seen[$1]++ { print $1 }\' "$LSB_DJOB_RANKFILE" >"$hostfile"',
    "else",
    '  echo "$LSB_MCPU_HOSTS" | awk \'{ for (i = 1; i < NF; i += 2) if (!seen[$i]++) print $i }\' >"$hostfile"',
    "fi",
]


def _bsub(spec: RenderSpec) -> list[str]:
    lines = [f"#BSUB -J {spec.name}"]
    if spec.launcher == "jsrun":
        lines.append(f"#BSUB -nnodes {spec.nodes}")  # whole nodes: CSM's form, which jsrun divides
    else:
        per_host = max(1, spec.gpus_per_node)  # a slot per GPU (one per process meshrun starts)
        lines += [f"#BSUB -n {spec.nodes * per_host}", f'#BSUB -R "span[ptile={per_host}]"']
        if spec.gpus_per_node:
            lines.append(f'#BSUB -gpu "num={spec.gpus_per_node}/host"')
    lines.append(f"#BSUB -o {spec.name}-%J.out")
    if spec.time:
        lines.append(f"#BSUB -W {spec.time}")
    if spec.partition:
        lines.append(f"#BSUB -q {spec.partition}")
    if spec.account:
        lines.append(f"#BSUB -P {spec.account}")
    return lines


def _launch(spec: RenderSpec) -> list[str]:
    node = f"  bash -c {shlex.quote('exec ' + spec.shell_command())}"
    if spec.launcher == "jsrun":
        gpus = f" -g {spec.gpus_per_node}" if spec.gpus_per_node else ""
        return [f"jsrun -n {spec.nodes} -r 1 -a 1 -c ALL_CPUS{gpus} \\", node]
    check = ['nhosts="$(wc -l <"$hostfile")"',
             f'if [ "$nhosts" -ne {spec.nodes} ]; then',
             f'  echo "meshrun: the job has $nhosts host(s), not {spec.nodes}: $(paste -sd " " "$hostfile")" >&2',
             "  exit 1",
             "fi"]
    if spec.launcher == "blaunch":
        return HOSTS + check + ['blaunch -u "$hostfile" \\', node]
    mpirun = f'mpirun -n {spec.nodes} --map-by ppr:1:node --hostfile "$hostfile" -x MASTER_ADDR="$master" \\'
    return HOSTS + check + ['master="$(head -n 1 "$hostfile")"', mpirun, node]


NOTE = {
    "blaunch": ["# Rendered by `meshrun render lsf`. blaunch starts one task on each host of the job; each",
                "# node's meshrun finds its rank from LSF_PM_TASKID and the hosts from LSB_DJOB_RANKFILE",
                "# (else LSB_MCPU_HOSTS), as below; `meshrun env` in a task shows what it resolved."],
    "jsrun": ["# Rendered by `meshrun render lsf --launcher jsrun`. Each node's meshrun finds its rank from",
              "# jsrun's JSM_NAMESPACE_* variables and the hosts from LSF's LSB_DJOB_RANKFILE; `meshrun env`",
              "# in a job step shows what it resolved."],
    "mpirun": ["# Rendered by `meshrun render lsf --launcher mpirun`. Open MPI's mpirun starts one rank on",
               "# each host of the job; each node's meshrun finds its rank from OMPI_COMM_WORLD_* and the",
               "# master from MASTER_ADDR; `meshrun env` in a rank shows what it resolved."],
}


def render(spec: RenderSpec) -> str:
    lines = ["#!/bin/bash", *_bsub(spec), "", *NOTE[spec.launcher], "set -euo pipefail"]
    if spec.setup:
        lines += ["", spec.setup]
    lines += ["", *_launch(spec), ""]
    return "\n".join(lines)


def node_command(script: str) -> str:
    """The command each node runs: the ``bash -c`` argument of the launch line."""
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("bash -c "):
            return shlex.split(line)[2]
    raise ValueError("no launch line")
