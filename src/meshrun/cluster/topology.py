"""The resolved shape of a job: one frozen value passed everywhere instead of os.environ."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# A job's shape past any cluster or machine built is a typo: refused in one line before
# anything is sized by it. The largest training clusters hold about 100,000 GPUs on 12,500 to
# 25,000 nodes; a node holds 8 GPUs (16 in the largest HGX systems, 4 per host in an NVL72 rack).
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 64

FIELDS = (
    "platform",
    "nnodes",
    "node_rank",
    "nproc_per_node",
    "master_addr",
    "master_port",
    "hosts",
    "run_id",
    "local_rank",
)


@dataclass(frozen=True)
class Topology:
    """Where this node sits in the job.

    ``hosts`` lists every node's address in node-rank order when the platform tells it
    (SkyPilot, Saturn Cloud, Slurm, LSF, SageMaker), else is empty. ``local_rank`` is set only
    when the platform itself already started one process per device (a torchrun worker,
    ``srun --ntasks-per-node=G``, ``mpirun -npernode G``): this process is then one worker,
    not the launcher of a node. ``sources`` maps each field to where its value came from
    (``env SLURM_NNODES``, ``flag --nnodes``, ``default``).
    """

    platform: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    hosts: tuple[str, ...] = ()
    run_id: str = "meshrun"
    local_rank: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # A read-only view so nobody mutates the shared record of where values came from.
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_worker(self) -> bool:
        """True when the platform already started this process as one rank of the job."""
        return self.local_rank is not None

    @property
    def rank(self) -> int | None:
        """Global rank of this process in worker mode (node-major packing), else None."""
        if self.local_rank is None:
            return None
        return self.node_rank * self.nproc_per_node + self.local_rank

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def replace(self, sources: Mapping[str, str] | None = None, **changes: Any) -> Topology:
        merged = dict(self.sources)
        merged.update(sources or {})
        return dataclasses.replace(self, sources=merged, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of ``meshrun env --json``."""
        return {
            "platform": self.platform,
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "hosts": list(self.hosts),
            "run_id": self.run_id,
            "local_rank": self.local_rank,
            "rank": self.rank,
            "sources": dict(self.sources),
        }
