"""Inside a worker that torchrun (TorchElastic) started.

torchrun exports, per worker: TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK (the node's rank), GROUP_WORLD_SIZE (the number of nodes) and
MASTER_ADDR/MASTER_PORT. Probed first: torchrun also runs inside Slurm, Kubernetes and
SkyPilot jobs, and the worker's own variables are then the truth.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT
from .base import Platform

MARKERS = "TORCHELASTIC_RUN_ID, LOCAL_RANK and WORLD_SIZE"  # what detect() looks for
NAME = "torchrun"


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        return None
    world = r.need_int("WORLD_SIZE", minimum=1)
    local_rank = r.need_int("LOCAL_RANK", "local_rank")
    nproc = r.int_or("LOCAL_WORLD_SIZE", "nproc_per_node", world, minimum=1,
                     default_source="env WORLD_SIZE (no LOCAL_WORLD_SIZE)")
    if world % nproc:
        raise bad_value("env WORLD_SIZE", world, f"is not a multiple of LOCAL_WORLD_SIZE={nproc}",
                        "meshrun expects the same number of processes on every node")
    nnodes = r.int_or("GROUP_WORLD_SIZE", "nnodes", world // nproc, minimum=1,
                      default_source="env WORLD_SIZE / LOCAL_WORLD_SIZE")
    if nnodes * nproc != world:
        raise bad_value("env GROUP_WORLD_SIZE", nnodes,
                        f"times LOCAL_WORLD_SIZE={nproc} is not WORLD_SIZE={world}",
                        "meshrun expects the same number of processes on every node")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=r.int_or("GROUP_RANK", "node_rank", 0),
        nproc_per_node=nproc,
        master_addr=r.str_or("MASTER_ADDR", "master_addr", "127.0.0.1"),
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        run_id=r.str_or("TORCHELASTIC_RUN_ID", "run_id", "none"),
        local_rank=local_rank,
        sources=r.sources,
    )


class Torchrun(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
