"""`meshrun doctor`: check this node (or, under `meshrun launch`, every rank) in seconds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from collections.abc import Mapping
from typing import Any

from ..cluster.gpus import count_visible_gpus
from ..cluster.topology import Topology
from ..doctor.checks import Probes, check_versions_across, run_checks
from ..doctor.facts import Facts, gather
from ..doctor.findings import Finding, worst
from .options import add_option, add_topology_options, topology_from_args

DOCTOR_HELP = """\
Check this node before a job wastes the cluster: GPUs vs processes, torch/CUDA/NCCL/driver
versions, the master's name and port (reachable from here, free on the master), the network
interface gloo/NCCL will use and whether it routes to the master, InfiniBand/EFA vs
NCCL_IB_DISABLE, NVLink vs PCIe, ECC errors and throttling, free disk for snapshots, and the
NCCL variables in effect with what each does (meshrun never overrides yours).

Each finding is ok / warn / fail with a reason and a fix; the exit code is 1 when any fails.

examples:
  meshrun doctor                                  # this node, as detected
  meshrun doctor --nnodes 2 --node-rank 1 --master-addr 10.0.0.1
  meshrun doctor --out /shared/runs --json        # where snapshots will go; machine-readable
  meshrun launch -m meshrun doctor                # every rank of the job: versions compared across nodes
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="check GPUs, versions, master reachability, interfaces, NCCL settings, disk",
                       description=DOCTOR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_topology_options(p)
    add_option(p, "--out", metavar="DIR", default=".", help="where snapshots will be written (disk check)")
    add_option(p, "--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_doctor)


def real_probes() -> Probes:
    from ..cluster.net import port_is_free
    from ..cluster.reach import resolve, route_interface

    def connect(addr: str, port: int, timeout: float) -> str:
        try:
            with socket.create_connection((addr, port), timeout=timeout):
                return "open"
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return f"did not answer within {timeout:.0f} s"
        except OSError as exc:
            return f"is unreachable ({exc.strerror or exc})"

    return Probes(resolve=resolve, connect=connect, port_free=port_is_free, route=route_interface)


def _print(findings: list[Finding], title: str, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    if as_json:
        print(json.dumps({"status": worst(findings), "findings": [f.to_dict() for f in findings], **(extra or {})},
                         indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    colour = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}
    table = Table(title=title)
    with_node = any(f.node is not None for f in findings)
    for col in (["node"] if with_node else []) + ["check", "status", "finding", "fix"]:
        table.add_column(col)
    for f in findings:
        row = [("all" if f.node is None else str(f.node))] if with_node else []
        table.add_row(*row, f.check, f"[{colour[f.status]}]{f.status}[/]", f.reason, f.fix)
    con = Console(width=max(120, Console().width))
    con.print(table)
    con.print(f"overall: [{colour[worst(findings)]}]{worst(findings)}[/]")


def cmd_doctor(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    gpus = count_visible_gpus(env)
    # Resolve without the nproc <= GPUs rule, so that a mismatch is a finding, not an error.
    topo, _ = topology_from_args(ns, env, max(gpus, 1 << 16) if ns.nproc_per_node else gpus)
    facts = gather(env, ns.out)
    if topo.is_worker and topo.world_size > 1:
        return _across_ranks(topo, env, facts, ns.json)
    findings = run_checks(topo, env, facts, real_probes())
    _print(findings, f"meshrun doctor: {facts.hostname} (node {topo.node_rank} of {topo.nnodes}, {topo.platform})",
           ns.json, {"node": topo.node_rank, "hostname": facts.hostname})
    return 1 if worst(findings) == "fail" else 0


def _across_ranks(topo: Topology, env: Mapping[str, str], facts: Facts, as_json: bool) -> int:
    """Under a launcher: every node's local rank 0 runs the node checks; rank 0 gathers them
    over gloo (works before NCCL is trusted), adds the cross-node version comparison, and
    prints one report."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        mine: list[Finding] = []
        if topo.local_rank == 0:
            mine = [dataclasses.replace(f, node=topo.node_rank) for f in
                    run_checks(topo.replace(local_rank=topo.local_rank), env, facts, _in_job_probes())]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (topo.node_rank, topo.local_rank, facts, mine))
        per_node = {node: f for node, local, f, _ in gathered if local == 0}
        findings = [f for *_, fs in gathered for f in fs]
        findings += check_versions_across([per_node[n] for n in sorted(per_node)])
        status = worst(findings)
        if dist.get_rank() == 0:
            _print(findings, f"meshrun doctor: {topo.nnodes} node(s), {topo.world_size} ranks", as_json)
        sys.stdout.flush()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 1 if status == "fail" else 0


def _in_job_probes() -> Probes:
    """Inside a running job the master port is taken by the job itself: that is expected."""
    return dataclasses.replace(real_probes(), port_free=lambda port: True)
