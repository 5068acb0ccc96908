"""Kubeflow PyTorchJob pods (training-operator).

The operator sets PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE (the variables torchrun
itself reads as defaults) and MASTER_ADDR/MASTER_PORT pointing at the master pod's
service. It also sets RANK and WORLD_SIZE, but there RANK is the *pod index* and WORLD_SIZE
the pod count, not process ranks: they are read only as the node rank's fallback.

A PyTorchJob without PET_* variables (an operator, or a job, without ``nprocPerNode``) gives
each pod only MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, for one process per pod: WORLD_SIZE
is the pod count and RANK the pod's index (the master pod 0, worker i the index i + 1), the
variables Lightning's KubeflowEnvironment reads. Each pod is then one node, WORLD_SIZE the node
count and RANK the node rank, and meshrun starts the pod's processes (one per visible GPU) as
on any node. These variables alone are read as Kubeflow's only inside a Kubernetes pod
(KUBERNETES_SERVICE_HOST or KUBERNETES_PORT set, as the kubelet sets them in every pod), and not
when LOCAL_RANK, LOCAL_WORLD_SIZE or GROUP_RANK say a launcher already started one process per
device (there WORLD_SIZE counts processes), nor when NNODES or NODE_RANK name the nodes
explicitly (as ``meshrun render kubernetes``'s Indexed Job does): the ``generic`` platform then
reads them.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default
from .base import Platform

MARKERS = "PET_NNODES, or MASTER_ADDR, WORLD_SIZE and RANK in a Kubernetes pod"  # what detect() looks for
NAME = "kubeflow"
POD_VARS = ("MASTER_ADDR", "WORLD_SIZE", "RANK")
WORKER_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")  # a launcher's per-process variables
GENERIC_VARS = ("NNODES", "NODE_RANK")


def in_pod(r: EnvReader) -> bool:
    return r.any("KUBERNETES_SERVICE_HOST", "KUBERNETES_PORT")


def detect_pod_per_node(r: EnvReader, gpus: int) -> Topology:
    """A PyTorchJob without PET_*: one node per pod, WORLD_SIZE pods, this pod's index RANK."""
    r.note("platform", "detected (MASTER_ADDR, WORLD_SIZE and RANK in a Kubernetes pod, no PET_*)")
    nnodes = r.need_int("WORLD_SIZE", "nnodes", minimum=1)
    r.note("nnodes", "env WORLD_SIZE (the pod count under Kubeflow without PET_NNODES)")
    node_rank = r.need_int("RANK", "node_rank")
    r.note("node_rank", "env RANK (the pod index under Kubeflow)")
    if node_rank >= nnodes:
        raise bad_value("env RANK", node_rank, f"must be below WORLD_SIZE={nnodes}, the pod count",
                        "the training operator sets both; check the pod's environment")
    nproc, src = per_node_default(gpus)
    r.note("nproc_per_node", src)
    return Topology(
        platform=NAME,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=r.str_or("MASTER_ADDR", "master_addr", lone_master(nnodes)),
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        run_id=r.str_or("PET_RDZV_ID", "run_id", "kubeflow"),
        sources=r.sources,
    )


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("PET_NNODES"):
        if in_pod(r) and r.has(*POD_VARS) and not r.any(*WORKER_VARS, *GENERIC_VARS):
            return detect_pod_per_node(r, gpus)
        return None
    r.note("platform", "detected (PET_NNODES set)")
    raw_nnodes = env["PET_NNODES"].strip()
    if ":" in raw_nnodes:
        lo, _, hi = raw_nnodes.partition(":")
        if not (lo.strip().isdigit() and hi.strip().isdigit()):  # neither a count nor a MIN:MAX range
            raise bad_value("env PET_NNODES", raw_nnodes, "not a node count nor a MIN:MAX range of whole numbers",
                            "set it to N, e.g. 2")
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


class Kubeflow(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
