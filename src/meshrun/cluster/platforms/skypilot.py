"""SkyPilot tasks (the SkyPilot document).

SKYPILOT_NODE_IPS lists every node's IP, one per line, head first; SKYPILOT_NUM_NODES,
SKYPILOT_NODE_RANK and SKYPILOT_NUM_GPUS_PER_NODE complete the picture, and
SKYPILOT_TASK_ID is stable across preemptions (a good rendezvous id).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default
from .base import Platform

MARKERS = "SKYPILOT_NODE_IPS or SKYPILOT_NODE_RANK"  # what detect() looks for
NAME = "skypilot"


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.any("SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK"):
        return None
    ips = tuple(line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip())
    if ips:
        r.note("hosts", "env SKYPILOT_NODE_IPS")
    nnodes = r.int_or("SKYPILOT_NUM_NODES", "nnodes", len(ips) or 1, minimum=1,
                      default_source="count of SKYPILOT_NODE_IPS")
    if ips and len(ips) != nnodes:
        raise bad_value("env SKYPILOT_NUM_NODES", nnodes,
                        f"but SKYPILOT_NODE_IPS lists {len(ips)} address(es)",
                        "the two must agree; SkyPilot sets both, so check the task's environment")
    per_gpu = r.opt_int("SKYPILOT_NUM_GPUS_PER_NODE", "nproc_per_node")
    if not per_gpu:  # unset, or 0 on a CPU-only cluster
        per_gpu, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    if ips:
        r.note("master_addr", "env SKYPILOT_NODE_IPS (first line)")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=r.int_or("SKYPILOT_NODE_RANK", "node_rank", 0),
        nproc_per_node=per_gpu,
        master_addr=ips[0] if ips else lone_master(nnodes),
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        hosts=ips,
        run_id=r.str_or("SKYPILOT_TASK_ID", "run_id", "skypilot"),
        sources=r.sources,
    )


class SkyPilot(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
