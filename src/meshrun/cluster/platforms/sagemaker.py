"""Amazon SageMaker training jobs.

SM_HOSTS is a JSON list of the job's host names (``["algo-1","algo-2"]``), SM_CURRENT_HOST
this container's name (its position in the list is the node rank), SM_NUM_GPUS the GPUs of
this instance.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import DEFAULT_PORT, per_node_default
from .base import Platform

MARKERS = "SM_HOSTS and SM_CURRENT_HOST"  # what detect() looks for
NAME = "sagemaker"


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("SM_HOSTS", "SM_CURRENT_HOST"):
        return None
    raw = env["SM_HOSTS"]
    try:
        hosts = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise bad_value("env SM_HOSTS", raw, "is not a JSON list of host names",
                        'SageMaker sets it like ["algo-1","algo-2"]')
    current = env["SM_CURRENT_HOST"].strip()
    if current not in hosts:
        raise bad_value("env SM_CURRENT_HOST", current, f"is not in SM_HOSTS {hosts}")
    for field in ("hosts", "nnodes", "master_addr"):
        r.note(field, "env SM_HOSTS")
    r.note("node_rank", "env SM_CURRENT_HOST (position in SM_HOSTS)")
    nproc = r.opt_int("SM_NUM_GPUS", "nproc_per_node")
    if not nproc:
        nproc, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    return Topology(
        platform=NAME,
        nnodes=len(hosts),
        node_rank=hosts.index(current),
        nproc_per_node=nproc,
        master_addr=hosts[0],
        master_port=r.int_or("MASTER_PORT", "master_port", DEFAULT_PORT, minimum=1),
        hosts=tuple(hosts),
        run_id=r.str_or("TRAINING_JOB_NAME", "run_id", "sagemaker"),
        sources=r.sources,
    )


class SageMaker(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
