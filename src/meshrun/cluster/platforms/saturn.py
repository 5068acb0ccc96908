"""Saturn Cloud jobs (the Saturn Cloud document).

Every pod gets SATURN_JOB_SCALE (pods in the job), SATURN_JOB_RANK (this pod's index) and
SATURN_JOB_LEADER (DNS name of pod 0). Peers resolve at
``${SATURN_JOB_RUN}-N.${SATURN_INTERNAL_SUBDOMAIN}.${SATURN_NAMESPACE}.svc.cluster.local``.
Saturn Cloud's multi-node guide also spells the middle variable SATURN_INTERNAL_DOMAIN once;
both are read.
All pod-to-pod ports are open, so torchrun's port 29500 is the default.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, lone_master, per_node_default
from .base import Platform

MARKERS = "SATURN_JOB_SCALE and SATURN_JOB_RANK"  # what detect() looks for
NAME = "saturn"


def peer_hosts(run: str, subdomain: str, namespace: str, scale: int) -> tuple[str, ...]:
    return tuple(f"{run}-{i}.{subdomain}.{namespace}.svc.cluster.local" for i in range(scale))


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("SATURN_JOB_SCALE", "SATURN_JOB_RANK"):
        return None
    scale = r.need_int("SATURN_JOB_SCALE", "nnodes", minimum=1)
    rank = r.need_int("SATURN_JOB_RANK", "node_rank")
    run = r.opt_str("SATURN_JOB_RUN", "run_id")
    subdomain = r.opt_str("SATURN_INTERNAL_SUBDOMAIN") or r.opt_str("SATURN_INTERNAL_DOMAIN")
    namespace = r.opt_str("SATURN_NAMESPACE")
    hosts: tuple[str, ...] = ()
    if run and subdomain and namespace:
        hosts = peer_hosts(run, subdomain, namespace, scale)
        r.note("hosts", "env SATURN_JOB_RUN, SATURN_INTERNAL_SUBDOMAIN, SATURN_NAMESPACE")
    leader = r.opt_str("SATURN_JOB_LEADER", "master_addr")
    if leader is None:
        leader = hosts[0] if hosts else lone_master(scale)
        r.note("master_addr", "first peer host" if hosts else "default")
    nproc, nproc_src = per_node_default(gpus)
    r.note("nproc_per_node", nproc_src)
    return Topology(
        platform=NAME,
        nnodes=scale,
        node_rank=rank,
        nproc_per_node=nproc,
        master_addr=leader,
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        hosts=hosts,
        run_id=run or "saturn",
        sources=r.sources,
    )


class Saturn(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
