"""Processes started by Open MPI's mpirun.

With one process per node (``mpirun -npernode 1 meshrun launch ...``) each MPI process is a
node's launcher. With several per node, each MPI process is already a worker and its local
rank is OMPI_COMM_WORLD_LOCAL_RANK; mpirun places ranks by slot (its default ``--map-by
slot``), so the node index is rank // local size, which holds only when every rank's local
rank is rank % local size: another placement (``--map-by node``) is refused, as it would give
two processes one torch rank.

MPI does not tell peers' addresses: a multi-node job needs MASTER_ADDR, passed to every rank
(``mpirun -x MASTER_ADDR=node0``), or --master-addr. The port, unless MASTER_PORT is set,
comes from the job id mpirun gives every process of one job (OMPI_MCA_ess_base_jobid in Open
MPI 4, OMPI_MCA_orte_ess_jobid before it, PMIX_NAMESPACE in Open MPI 5), so that every rank
derives the same port and two jobs sharing a node do not collide.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default
from .base import Platform

MARKERS = "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK"  # what detect() looks for
NAME = "mpi"
JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")
MASTER_HINT = ("pass node 0's address to every rank: mpirun -x MASTER_ADDR=<node 0> "
               "(or meshrun --master-addr)")


def port_from_job_id(job_id: str) -> int:
    """15000-24999, like Slurm's, below Linux's ephemeral range. Open MPI's job ids are
    family << 16 | job: a CRC spreads them where ``id % 10000`` would take 625 values."""
    return 15000 + zlib.crc32(job_id.encode()) % 10000


def job_id(r: EnvReader) -> tuple[str, str] | None:
    """(id, variable) of the first job-id variable set, else None."""
    for name in JOB_ID_VARS:
        value = r.opt_str(name)
        if value is not None:
            return value, name
    return None


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        return None
    size = r.need_int("OMPI_COMM_WORLD_SIZE", minimum=1)
    rank = r.need_int("OMPI_COMM_WORLD_RANK")
    local_size = r.int_or("OMPI_COMM_WORLD_LOCAL_SIZE", "nproc_per_node", 1, minimum=1)
    local_rank = None
    if local_size == 1:
        nnodes, node_rank = size, rank
        r.note("nnodes", "env OMPI_COMM_WORLD_SIZE")
        r.note("node_rank", "env OMPI_COMM_WORLD_RANK")
        nproc, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    else:
        if size % local_size:
            raise bad_value("env OMPI_COMM_WORLD_SIZE", size,
                            f"is not a multiple of OMPI_COMM_WORLD_LOCAL_SIZE={local_size}",
                            "start the same number of processes on every node (mpirun -npernode N)")
        nnodes, node_rank, nproc = size // local_size, rank // local_size, local_size
        local_rank = r.need_int("OMPI_COMM_WORLD_LOCAL_RANK", "local_rank")
        if local_rank != rank % local_size:
            raise bad_value("env OMPI_COMM_WORLD_LOCAL_RANK", local_rank,
                            f"but OMPI_COMM_WORLD_RANK={rank} with {local_size} per node: ranks are not "
                            "placed node by node, so the node index cannot be derived",
                            "use mpirun's default placement (--map-by slot), or -npernode 1 with one "
                            "launcher per node")
        r.note("nnodes", "env OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE")
        r.note("node_rank", "env OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE")
    master = r.opt_str("MASTER_ADDR", "master_addr")
    if master is None:
        master = lone_master(nnodes)
        r.note("master_addr", "default")
    job = job_id(r)
    if job is None:
        run_id = NAME  # no job id: every rank agrees on the fixed default port
        r.note("run_id", "default")
        port = r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1)
    else:
        run_id = job[0]
        r.note("run_id", f"env {job[1]}")
        port = r.int_or("MASTER_PORT", "master_port", port_from_job_id(job[0]), minimum=1,
                        default_source=f"derived from env {job[1]} (15000 + CRC-32 % 10000)")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master,
        master_port=port,
        run_id=run_id,
        local_rank=local_rank,
        sources=r.sources,
    )


class MPI(Platform):
    NAME = NAME
    MARKERS = MARKERS
    MASTER_HINT = MASTER_HINT
    detect = staticmethod(detect)
