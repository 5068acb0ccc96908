"""DeepSpeed, two ways.

``torchrun`` path (default; the Saturn Cloud document's advice for Kubernetes-style platforms):
every node runs torchrun exactly as for plain PyTorch, and the script calls
``deepspeed.initialize``.

``native`` path (the SkyPilot document's recipe): only the head node runs ``deepspeed
--hostfile``, which starts workers on every node over SSH (passwordless SSH and sshd needed);
the other nodes have nothing to start. The hostfile lists ``host slots=N`` per node.
"""

from __future__ import annotations

import os
import tempfile

from ..cluster.topology import Topology
from ..errors import bad_value
from . import torchrun
from .command import Command, LaunchSpec, Process
from .common import deepspeed_script_args, need_hosts, script_argv, topology_env


def hostfile_text(hosts: tuple[str, ...], slots: int) -> str:
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def default_hostfile(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"meshrun-{run_id}.hostfile")


def build(topo: Topology, spec: LaunchSpec) -> Command:
    if spec.deepspeed_launcher == "torchrun":
        return torchrun.build(topo, spec, deepspeed_script_args(spec))
    if topo.is_worker:
        raise bad_value("--deepspeed-launcher", "native",
                        f"platform {topo.platform} already started this process as a worker",
                        "run one task per node, or use the torchrun path")
    tail = [*script_argv(spec), *deepspeed_script_args(spec)]
    env = topology_env(topo)
    if topo.nnodes == 1:
        argv = ["deepspeed", f"--num_gpus={topo.nproc_per_node}", f"--master_port={topo.master_port}", *tail]
        return Command(processes=(Process(tuple(argv)),), env=env)
    if topo.node_rank != 0:
        return Command(processes=(), env=env, note=(
            f"node {topo.node_rank}: nothing to start; the head node's deepspeed launcher "
            "starts this node's workers over SSH"))
    path = spec.hostfile or default_hostfile(topo.run_id)
    argv = ["deepspeed", f"--hostfile={path}", f"--master_addr={topo.master_addr}",
            f"--master_port={topo.master_port}", *tail]
    hosts = need_hosts(topo, "DeepSpeed's native launcher")
    return Command(processes=(Process(tuple(argv)),), env=env,
                   files={path: hostfile_text(hosts, topo.nproc_per_node)})
