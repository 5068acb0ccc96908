"""A cluster described by the usual variables: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK
(and NPROC_PER_NODE). Any scheduler or hand-written script can set these."""

from __future__ import annotations

from collections.abc import Mapping

from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default
from .base import Platform

MARKERS = "MASTER_ADDR, NNODES or NODE_RANK"  # what detect() looks for
NAME = "generic"


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.any("MASTER_ADDR", "NNODES", "NODE_RANK"):
        return None
    nproc = r.opt_int("NPROC_PER_NODE", "nproc_per_node", minimum=1)
    if nproc is None:
        nproc, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    nnodes = r.int_or("NNODES", "nnodes", 1, minimum=1)
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=r.int_or("NODE_RANK", "node_rank", 0),
        nproc_per_node=nproc,
        master_addr=r.str_or("MASTER_ADDR", "master_addr", lone_master(nnodes)),
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        sources=r.sources,
    )


class Generic(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
