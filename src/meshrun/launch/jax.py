"""JAX: no launcher; every process runs the script and calls ``jax.distributed.initialize``.

meshrun starts one process per node when the node's processes share its devices (the Saturn
Cloud document's one-process-per-pod layout, nproc_per_node=1), or one per local device
otherwise, and gives each the coordinator (node 0's address, the master port), the process
count and its id. ``meshrun.jax_initialize()`` reads them; JAX itself also reads
JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS.
"""

from __future__ import annotations

from ..cluster.topology import Topology
from .command import Command, LaunchSpec, Process
from .common import local_ranks, python_argv, topology_env


def device_pin(local_rank: int, nproc: int, visible: str | None) -> dict[str, str]:
    """With several processes on a node, give each one device (of those the parent sees)."""
    if nproc == 1:
        return {}
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(nproc)]
    return {"CUDA_VISIBLE_DEVICES": ids[local_rank] if local_rank < len(ids) else str(local_rank)}


def process_env(topo: Topology, local_rank: int) -> dict[str, str]:
    return {
        "MESHRUN_LOCAL_RANK": str(local_rank),
        "MESHRUN_PROCESS_ID": str(topo.node_rank * topo.nproc_per_node + local_rank),
        "MESHRUN_NUM_PROCESSES": str(topo.world_size),
    }


def build(topo: Topology, spec: LaunchSpec, visible: str | None = None) -> Command:
    env = topology_env(topo)
    env["JAX_COORDINATOR_ADDRESS"] = f"{topo.master_addr}:{topo.master_port}"
    procs = tuple(
        Process(tuple(python_argv(spec)),
                {**process_env(topo, lr), **device_pin(lr, topo.nproc_per_node, visible)})
        for lr in local_ranks(topo))
    return Command(processes=procs, env=env)
