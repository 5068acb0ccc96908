"""What a node does around its launcher: refuse a taken port, prepare the network for a
multi-node job (the master's name, its port, the interface that routes to it), and run the
command with a rendezvous that cannot form turned into one line."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping

from ..cluster.net import port_is_free
from ..cluster.reach import DEFAULT_TIMEOUT_S, route_interface, wait_reachable
from ..cluster.reach import resolve as resolve_host
from ..cluster.topology import Topology
from ..errors import MeshrunError, bad_value
from .command import Command, LaunchSpec

# The documents' NCCL table: set the socket interface, but never override what the user set.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def check_ports(topo: Topology, cmd: Command, spec: LaunchSpec) -> None:
    """Refuse to start when a port this node must listen on is taken: the rendezvous would
    otherwise fail late, after every other node has started and waited."""
    if "--standalone" in cmd.argv or not cmd.processes:
        return
    ports: list[int] = []
    if spec.framework == "tensorflow":
        ports = [topo.master_port + lr for lr in range(topo.nproc_per_node)
                 if topo.local_rank in (None, lr)]
    elif topo.node_rank == 0 and topo.local_rank in (None, 0):
        ports = [topo.master_port]
    for port in ports:
        if not port_is_free(port):
            raise bad_value(topo.source("master_port"), port,
                            f"port {port} is already in use on this node (the rendezvous master)",
                            "choose another with --master-port, or stop what holds it")


def prepare_network(topo: Topology, cmd: Command, env: Mapping[str, str], timeout_s: int | None) -> Command:
    """Multi-node only, before anything starts: the master's name must resolve; a node other
    than 0 waits (bounded) until the master's port answers; and the interface that routes to
    the master becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless the user set them."""
    if topo.nnodes == 1 or not cmd.processes:
        return cmd
    timeout = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout < 1:
        raise bad_value("--rdzv-timeout", timeout, "must be >= 1 second")
    source = topo.source("master_addr")
    addr = resolve_host(topo.master_addr, timeout, source)
    if topo.node_rank != 0 or (topo.local_rank or 0) != 0:
        wait_reachable(topo.master_addr, topo.master_port, timeout, source)
    extra = dict(cmd.env)
    ifname = route_interface(addr)
    if ifname:
        for var in IFNAME_VARS:
            if var not in env:
                extra[var] = ifname
    return dataclasses.replace(cmd, env=extra)


def socket_interface(topo: Topology, env: Mapping[str, str]) -> tuple[str | None, str]:
    """(interface, where it comes from) for `meshrun env`: the user's variable, else the
    interface that routes to the master (multi-node only)."""
    for var in IFNAME_VARS:
        if env.get(var):
            return env[var], f"env {var}"
    if topo.nnodes == 1:
        return None, "single node: not needed"
    try:
        addr = resolve_host(topo.master_addr, 5, topo.source("master_addr"))
    except MeshrunError:
        return None, f"{topo.master_addr} does not resolve here"
    ifname = route_interface(addr)
    return ifname, f"routes to {topo.master_addr}" if ifname else "no route found"


def run_job(cmd: Command, env: Mapping[str, str], topo: Topology, spec: LaunchSpec, **kw: Any) -> int:
    """Execute; on a multi-node torchrun job, turn a rendezvous timeout into one line."""
    from .rdzvwatch import RendezvousWatch
    from .run import execute

    uses_torchrun = bool(cmd.processes) and cmd.processes[0].argv[0] == "torchrun"
    watch = RendezvousWatch() if topo.nnodes > 1 and uses_torchrun else None
    code = execute(cmd, env, watch=watch, **kw)
    if code and watch is not None and watch.timed_out:
        print(f"meshrun: error: {watch.message(topo.master_addr, topo.master_port, topo.nnodes, spec.rdzv_timeout)}",
              file=sys.stderr, flush=True)
    return code
