"""Processes started by Open MPI's mpirun.

With one process per node (``mpirun -npernode 1 meshrun launch ...``) each MPI process is a
node's launcher. With several per node, each MPI process is already a worker and its local
rank is OMPI_COMM_WORLD_LOCAL_RANK; mpirun places ranks by slot, so the node index is
rank // local size. MPI does not tell peers' addresses: a multi-node job needs MASTER_ADDR
(or --master-addr).
"""

from __future__ import annotations

from typing import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default

MARKERS = "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK"  # what detect() looks for
NAME = "mpi"


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
        r.note("nnodes", "env OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE")
        r.note("node_rank", "env OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE")
    master = r.opt_str("MASTER_ADDR", "master_addr")
    if master is None:
        master = lone_master(nnodes)
        r.note("master_addr", "default")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master,
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        run_id=r.str_or("OMPI_MCA_orte_ess_jobid", "run_id", "mpi"),
        local_rank=local_rank,
        sources=r.sources,
    )
