"""Pieces shared by the builders: the variables every process gets, the script's argv."""

from __future__ import annotations

from ..cluster.topology import Topology
from ..errors import bad_value
from .command import LaunchSpec


def topology_env(topo: Topology) -> dict[str, str]:
    """MESHRUN_* variables so a ``meshrun env`` or ``meshrun.detect()`` inside the script sees
    the values the launcher resolved (the port it picked, flags it was given). They are the
    same variables users may set as flag defaults. The platform is not exported: inside a
    torchrun worker, detection must still find the worker's own variables."""
    env = {
        "MESHRUN_NNODES": str(topo.nnodes),
        "MESHRUN_NODE_RANK": str(topo.node_rank),
        "MESHRUN_NPROC_PER_NODE": str(topo.nproc_per_node),
        "MESHRUN_MASTER_ADDR": topo.master_addr,
        "MESHRUN_MASTER_PORT": str(topo.master_port),
        "MESHRUN_RUN_ID": topo.run_id,
    }
    if topo.hosts:
        env["MESHRUN_HOSTS"] = ",".join(topo.hosts)
    return env


def script_argv(spec: LaunchSpec) -> list[str]:
    """The user's program and its arguments, as a launcher's trailing arguments."""
    head = ["-m", spec.script] if spec.module else [spec.script]
    return head + list(spec.script_args)


def python_argv(spec: LaunchSpec) -> list[str]:
    """How to run the user's program directly (no launcher): ``python script.py args``.

    ``python`` is replaced by this interpreter's path when the command runs, so a venv's
    meshrun starts the venv's Python even when the venv is not activated."""
    return ["python", *script_argv(spec)]


def deepspeed_script_args(spec: LaunchSpec) -> list[str]:
    """DeepSpeed scripts take their config through ``deepspeed.add_config_arguments``."""
    if spec.deepspeed_config:
        return ["--deepspeed", "--deepspeed_config", spec.deepspeed_config]
    return []


def local_ranks(topo: Topology) -> list[int]:
    """The local ranks this node starts: all of them, or only its own in worker mode."""
    return [topo.local_rank] if topo.local_rank is not None else list(range(topo.nproc_per_node))


def need_hosts(topo: Topology, who: str) -> tuple[str, ...]:
    """Every node's address, which TensorFlow and DeepSpeed's hostfile cannot do without."""
    if topo.hosts:
        return topo.hosts
    if topo.nnodes == 1:
        return (topo.master_addr,)
    raise bad_value("hosts", "", f"{who} needs every node's address, and platform {topo.platform} gives none",
                    "pass --hosts node0,node1,... in node-rank order")
