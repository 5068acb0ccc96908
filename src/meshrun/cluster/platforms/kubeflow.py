"""Kubeflow PyTorchJob pods (training-operator).

The operator sets PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE (the variables torchrun
itself reads as defaults) and MASTER_ADDR/MASTER_PORT pointing at the master pod's
service. It also sets RANK and WORLD_SIZE, but there RANK is the *pod index* and WORLD_SIZE
the pod count, not process ranks: they are read only as the node rank's fallback.
"""

from __future__ import annotations

from typing import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default

MARKERS = "PET_NNODES"  # what detect() looks for
NAME = "kubeflow"


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("PET_NNODES"):
        return None
    raw_nnodes = env["PET_NNODES"].strip()
    if ":" in raw_nnodes:
        raise bad_value("env PET_NNODES", raw_nnodes, "is an elastic range",
                        "pass the range to meshrun launch as --nnodes MIN:MAX with --rdzv c10d")
    nnodes = r.need_int("PET_NNODES", "nnodes", minimum=1)
    if r.has("PET_NODE_RANK"):
        node_rank = r.need_int("PET_NODE_RANK", "node_rank")
    else:
        node_rank = r.int_or("RANK", "node_rank", 0)
        if "node_rank" in r.sources and r.sources["node_rank"] == "env RANK":
            r.note("node_rank", "env RANK (the pod index under Kubeflow)")
    raw_nproc = env.get("PET_NPROC_PER_NODE", "").strip()
    if raw_nproc in ("", "auto", "gpu", "cpu"):
        nproc, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    else:
        nproc = r.need_int("PET_NPROC_PER_NODE", "nproc_per_node", minimum=1)
    master = r.opt_str("MASTER_ADDR", "master_addr") or r.opt_str("PET_MASTER_ADDR", "master_addr")
    port = r.opt_int("MASTER_PORT", "master_port", minimum=1) or r.opt_int(
        "PET_MASTER_PORT", "master_port", minimum=1)
    if port is None:
        port = DEFAULT_PORT
        r.note("master_port", "default")
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master or lone_master(nnodes),
        master_port=port,
        run_id=r.str_or("PET_RDZV_ID", "run_id", "kubeflow"),
        sources=r.sources,
    )
