"""TensorFlow MultiWorkerMirroredStrategy: every worker gets the whole cluster in TF_CONFIG.

``cluster.worker`` is the same list everywhere (every worker's host:port in rank order,
node-major); ``task.index`` is this worker's position; worker 0 is the chief (the Saturn Cloud
document). A node running several workers gives them consecutive ports from the master port up.
"""

from __future__ import annotations

import json

from ..cluster.topology import Topology
from .command import Command, LaunchSpec, Process
from .common import local_ranks, need_hosts, python_argv, topology_env
from .jax import device_pin, process_env


def worker_addresses(topo: Topology) -> list[str]:
    hosts = need_hosts(topo, "TensorFlow's TF_CONFIG")
    return [f"{h}:{topo.master_port + i}" for h in hosts for i in range(topo.nproc_per_node)]


def tf_config_json(workers: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def build(topo: Topology, spec: LaunchSpec, visible: str | None = None) -> Command:
    workers = worker_addresses(topo)
    procs = []
    for lr in local_ranks(topo):
        index = topo.node_rank * topo.nproc_per_node + lr
        env = {**process_env(topo, lr), **device_pin(lr, topo.nproc_per_node, visible),
               "TF_CONFIG": tf_config_json(workers, index)}
        procs.append(Process(tuple(python_argv(spec)), env))
    return Command(processes=tuple(procs), env=topology_env(topo))
