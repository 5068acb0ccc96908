"""Processes started with the variables ``torch.distributed``'s ``env://`` init reads, with no
launcher between.

Worker mode (``build``): the platform already started one process per device (``srun
--ntasks-per-node=G``, ``mpirun -npernode G``, a torchrun worker), so meshrun starts the
script directly in it.

A node's ranks (``build_node``): `meshrun train` on one node starts every rank itself.
torchrun there would only add an interpreter (its own import of torch, seconds of a short run)
and a second supervisor: meshrun's launcher already owns restarts, signals, the failure line
and the bounded waits (docs/decisions.md#direct-ranks).
torchrun stays where its rendezvous is the contract: several nodes, and `meshrun launch`."""

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


def build_node(topo: Topology, module: str) -> Command:
    """Every rank of a one-node job: ``python -u -m MODULE`` per local rank (unbuffered, as
    torchrun starts its workers), each with its rank's variables."""
    if topo.nnodes != 1 or topo.local_rank is not None:
        raise ValueError("build_node starts every rank of one node")  # a programming error
    argv = ("python", "-u", "-m", module)
    return Command(processes=tuple(Process(argv, torch_worker_env(topo, lr), rank=lr)
                                   for lr in range(topo.nproc_per_node)),
                   env=topology_env(topo))


def build(topo: Topology, spec: LaunchSpec, extra_script_args: list[str] | None = None) -> Command:
    if topo.local_rank is None:
        raise ValueError("direct launch is for worker mode only")  # a programming error
    argv = (*python_argv(spec), *(extra_script_args or []))
    return Command(processes=(Process(argv, torch_worker_env(topo, topo.local_rank)),),
                   env=topology_env(topo))
