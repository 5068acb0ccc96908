"""`meshrun env`: the topology meshrun resolves on this node, and where each value came from."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from ..cluster.gpus import count_visible_gpus
from ..cluster.topology import FIELDS
from ..launch.node import socket_interface
from .options import add_topology_options, topology_from_args

ENV_HELP = """\
Show the topology meshrun resolves on this node and where each value came from.

examples:
  meshrun env                         # a table: value and source of each field
  meshrun env --json                  # one JSON object (platform, nnodes, node_rank, ...)
  SLURM_JOB_ID=7 SLURM_NNODES=2 SLURM_NODEID=1 SLURM_JOB_NODELIST='gpu[1-2]' meshrun env
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("env", help="show the detected topology and where each value came from",
                           description=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_topology_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_env)


def cmd_env(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    topo, _ = topology_from_args(ns, env, count_visible_gpus(env))
    ifname, if_source = socket_interface(topo, env)
    if ns.json:
        out = topo.to_dict()
        out["socket_ifname"] = ifname
        out.setdefault("sources", {})["socket_ifname"] = if_source
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"meshrun topology ({topo.platform})")
    table.add_column("field")
    table.add_column("value")
    table.add_column("source")
    for name in FIELDS + ("world_size",):
        value = getattr(topo, name)
        if name == "hosts":
            value = ", ".join(value) if value else "(not given by the platform)"
        if name == "local_rank" and value is None:
            value = "(launcher mode: meshrun starts the node's processes)"
        src = "nnodes x nproc_per_node" if name == "world_size" else topo.source(name)
        table.add_row(name, str(value), src)
    table.add_row("socket interface", ifname or "-", if_source + (" (GLOO/NCCL_SOCKET_IFNAME)" if ifname and
                                                                   not if_source.startswith("env") else ""))
    Console().print(table)
    return 0
