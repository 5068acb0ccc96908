"""A plain machine: one node, one process per visible GPU.

With no GPU, two CPU processes: the smallest world in which collectives, samplers and
rank-0-only code paths really run, so a script debugged here behaves the same on a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..topology import Topology
from ._common import DEFAULT_PORT
from .base import Platform

MARKERS = "nothing"  # what detect() looks for
NAME = "local"
CPU_PROCESSES = 2


def detect(env: Mapping[str, str], gpus: int) -> Topology:
    nproc = gpus if gpus > 0 else CPU_PROCESSES
    return Topology(
        platform=NAME,
        nnodes=1,
        node_rank=0,
        nproc_per_node=nproc,
        master_addr="127.0.0.1",
        master_port=DEFAULT_PORT,
        run_id="local",
        sources={
            "platform": "default (no cluster variables found)",
            "nproc_per_node": "visible GPUs" if gpus else f"default ({CPU_PROCESSES} CPU processes: no GPU)",
        },
    )


class Local(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
