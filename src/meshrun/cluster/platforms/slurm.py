"""Slurm allocations (the sbatch pattern of pytorch/examples' slurm/sbatch_run.sh).

The usual layout is one task per node (``--ntasks-per-node=1``) running ``meshrun launch``,
which starts one process per GPU. When the job instead asks Slurm for one task per GPU
(``--ntasks-per-node=G``), each task is already a worker (SLURM_LOCALID is its local rank).

The rendezvous host is the first node of SLURM_JOB_NODELIST (unless MASTER_ADDR is set, as the
pytorch/examples' Slurm script does with the head node's IP). The port, unless MASTER_PORT is set, comes
from the job id so that two jobs sharing a node do not collide, and lies in 15000-24999: below
Linux's ephemeral range (32768-60999), where the kernel hands out client ports.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..nodelist import expand_nodelist
from ..topology import Topology
from ._common import lone_master, per_node_default
from .base import Platform

MARKERS = "SLURM_JOB_ID"  # what detect() looks for
NAME = "slurm"


def port_from_job_id(job_id: int) -> int:
    return 15000 + job_id % 10000


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("SLURM_JOB_ID"):
        return None
    job_id = r.need_int("SLURM_JOB_ID", "run_id")
    nodelist_var = "SLURM_JOB_NODELIST" if r.has("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    hosts = tuple(expand_nodelist(env[nodelist_var], nodelist_var)) if r.has(nodelist_var) else ()
    if hosts:
        r.note("hosts", f"env {nodelist_var}")
    nnodes_var = "SLURM_NNODES" if r.has("SLURM_NNODES") else "SLURM_JOB_NUM_NODES"
    nnodes = r.int_or(nnodes_var, "nnodes", len(hosts) or 1, minimum=1,
                      default_source=f"count of {nodelist_var}")
    if hosts and len(hosts) != nnodes:
        raise bad_value(f"env {nnodes_var}", nnodes, f"but {nodelist_var} lists {len(hosts)} host(s)",
                        "the two must agree; are you running inside the job's allocation?")
    tasks_per_node = r.opt_int("SLURM_NTASKS_PER_NODE", minimum=1)
    local_rank = None
    if tasks_per_node and tasks_per_node > 1 and r.has("SLURM_LOCALID"):
        nproc = tasks_per_node
        r.note("nproc_per_node", "env SLURM_NTASKS_PER_NODE")
        local_rank = r.need_int("SLURM_LOCALID", "local_rank")
    else:
        gpus_on_node = r.opt_int("SLURM_GPUS_ON_NODE", "nproc_per_node")
        if gpus_on_node:
            nproc = gpus_on_node
        else:
            nproc, src = per_node_default(gpus)
            r.note("nproc_per_node", src)
    master = r.opt_str("MASTER_ADDR", "master_addr")
    if master is None:
        master = hosts[0] if hosts else lone_master(nnodes)
        r.note("master_addr", f"first host of {nodelist_var}" if hosts else "default")
    port = r.int_or("MASTER_PORT", "master_port", port_from_job_id(job_id), minimum=1,
                    default_source="derived from SLURM_JOB_ID (15000 + id % 10000)")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=r.int_or("SLURM_NODEID", "node_rank", 0),
        nproc_per_node=nproc,
        master_addr=master,
        master_port=port,
        hosts=hosts,
        run_id=str(job_id),
        local_rank=local_rank,
        sources=r.sources,
    )


class Slurm(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
