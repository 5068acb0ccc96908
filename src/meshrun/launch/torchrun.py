"""torchrun (torch.distributed.run): one launcher per node that starts a worker per GPU.

Rendezvous choice:
- one node whose address nobody chose: ``--standalone`` (torchrun picks a free port);
- a fixed cluster: the static rendezvous, torchrun's documented multi-node recipe
  (``--nnodes --node_rank --master_addr --master_port``);
- ``rdzv=c10d`` or an elastic ``MIN:MAX`` node range: the c10d rendezvous on the master,
  with the platform's run id so concurrent jobs on one master stay apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cluster.topology import Topology
from .command import Command, LaunchSpec, Process
from .common import script_argv, topology_env


def torchrun_args(topo: Topology, spec: LaunchSpec) -> list[str]:
    """Flags in the order of torchrun's documentation, so a user can hold the dry run against their recipe."""
    nproc = f"--nproc_per_node={topo.nproc_per_node}"
    elastic = spec.nnodes_range is not None
    if spec.rdzv == "c10d" or elastic:
        lo, hi = spec.nnodes_range or (topo.nnodes, topo.nnodes)
        args = [
            f"--nnodes={lo}:{hi}" if elastic else f"--nnodes={topo.nnodes}",
            nproc,
            f"--rdzv_id={topo.run_id}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={topo.master_addr}:{topo.master_port}",
        ]
    elif topo.nnodes == 1 and topo.source("master_addr") == "default":
        args = ["--standalone", nproc]
    else:
        args = [
            f"--nnodes={topo.nnodes}",
            f"--node_rank={topo.node_rank}",
            nproc,
            f"--master_addr={topo.master_addr}",
            f"--master_port={topo.master_port}",
        ]
    if spec.rdzv_timeout is not None and "--standalone" not in args:
        key = "join_timeout" if "--rdzv_backend=c10d" in args else "timeout"
        args.append(f"--rdzv_conf={key}={spec.rdzv_timeout}")
    if spec.max_restarts:
        args.append(f"--max_restarts={spec.max_restarts}")
    return args


def build(topo: Topology, spec: LaunchSpec, extra_script_args: list[str] | None = None) -> Command:
    args = torchrun_args(topo, spec)
    argv = ["torchrun", *args, *script_argv(spec), *(extra_script_args or [])]
    env = topology_env(topo)
    if "--standalone" in args:
        # torchrun picks the port itself; do not advertise one that will not be used.
        del env["MESHRUN_MASTER_ADDR"], env["MESHRUN_MASTER_PORT"]
    return Command(processes=(Process(tuple(argv)),), env=env)


def thread_env(nproc_per_node: int, env: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS=1 for each of several processes on a node, as torchrun sets it when
    the user has not, but set here so that torchrun prints no four-line banner about it."""
    if "OMP_NUM_THREADS" in env or nproc_per_node < 2:
        return {}
    return {"OMP_NUM_THREADS": "1"}
