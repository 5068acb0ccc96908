"""Worker mode: the platform already started one process per device (``srun
--ntasks-per-node=G``, ``mpirun -npernode G``, a torchrun worker), so meshrun starts the
script directly with the variables ``torch.distributed``'s ``env://`` init reads."""

from __future__ import annotations

from ..cluster.topology import Topology
from .command import Command, LaunchSpec, Process
from .common import python_argv, topology_env


def torch_worker_env(topo: Topology, local_rank: int) -> dict[str, str]:
    return {
        "RANK": str(topo.node_rank * topo.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(topo.world_size),
        "LOCAL_WORLD_SIZE": str(topo.nproc_per_node),
        "GROUP_RANK": str(topo.node_rank),
        "MASTER_ADDR": topo.master_addr,
        "MASTER_PORT": str(topo.master_port),
    }


def build(topo: Topology, spec: LaunchSpec, extra_script_args: list[str] | None = None) -> Command:
    if topo.local_rank is None:
        raise ValueError("direct launch is for worker mode only")  # a programming error
    argv = (*python_argv(spec), *(extra_script_args or []))
    return Command(processes=(Process(argv, torch_worker_env(topo, topo.local_rank)),),
                   env=topology_env(topo))
