"""The checks: each a function of the topology, the environment and the node's facts (and,
for the network, injected probes), returning findings. The SkyPilot document's NCCL
table and its common mistakes are the advice."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..cluster.topology import Topology
from ..errors import MeshrunError
from ..units import fmt_bytes
from .facts import Facts
from .findings import Finding

# What each NCCL variable does, from the SkyPilot document's table, and when it is a mistake.
NCCL_ADVICE = {
    "NCCL_DEBUG": "debug logging; INFO prints NCCL's setup on every rank (unset it for production runs)",
    "NCCL_IB_DISABLE": "1 disables InfiniBand (0, the default, enables it)",
    "NCCL_NET_GDR_LEVEL": "GPUDirect RDMA level (5: use GDR whenever the NIC and GPU allow)",
    "NCCL_SOCKET_IFNAME": "the interface NCCL's bootstrap and socket transport use",
    "NCCL_P2P_DISABLE": "1 disables peer-to-peer (NVLink / PCIe) between GPUs of a node",
    "NCCL_CROSS_NIC": "1 lets rings and trees cross NICs",
    "NCCL_NVLS_ENABLE": "NVLink SHARP (multicast); 0 turns it off",
}
MIN_FREE_DISK = 20 * 2**30


@dataclass(frozen=True)
class Probes:
    """The network side effects, injected so the checks stay testable."""

    resolve: Callable[[str, float, str], str]
    connect: Callable[[str, int, float], str]  # "open" | "refused" | "unreachable: why" | "timeout"
    port_free: Callable[[int], bool]
    route: Callable[[str], str | None]


def check_gpus(topo: Topology, facts: Facts) -> list[Finding]:
    if facts.gpus_visible == 0:
        return [Finding("gpus", "warn", f"no GPU visible; {topo.nproc_per_node} CPU process(es) will use gloo",
                        "fine for testing; on a GPU node check the driver and CUDA_VISIBLE_DEVICES")]
    if topo.nproc_per_node > facts.gpus_visible:
        return [Finding("gpus", "fail", f"{topo.nproc_per_node} processes per node but {facts.gpus_visible} GPU(s) "
                        "visible: two processes would share a GPU", "one process per GPU: lower --nproc")]
    if topo.nproc_per_node < facts.gpus_visible:
        return [Finding("gpus", "warn", f"{topo.nproc_per_node} processes for {facts.gpus_visible} GPUs: "
                        f"{facts.gpus_visible - topo.nproc_per_node} idle", "use --nproc to match, or mean it")]
    names = ", ".join(sorted(set(facts.gpu_names))) or "GPU"
    return [Finding("gpus", "ok", f"{facts.gpus_visible} x {names}, one process each")]


def check_versions(facts: Facts) -> list[Finding]:
    if facts.torch is None:
        return [Finding("versions", "warn", "torch is not installed here", "pip install 'meshrun[torch]'")]
    v = ", ".join(f"{k} {val}" for k, val in facts.versions().items() if val)
    return [Finding("versions", "ok", v)]


def check_versions_across(all_facts: list[Facts]) -> list[Finding]:
    """Under `meshrun launch`: every node must run the same torch / CUDA / NCCL / driver."""
    out = []
    for key in ("torch", "cuda", "nccl", "driver"):
        seen: dict[str | None, list[int]] = {}
        for node, f in enumerate(all_facts):
            seen.setdefault(f.versions()[key], []).append(node)
        if len(seen) > 1:
            desc = "; ".join(f"{val} on node(s) {','.join(map(str, nodes))}" for val, nodes in seen.items())
            out.append(Finding("versions", "fail", f"{key} differs across nodes: {desc}",
                               "install the same versions everywhere (one container image)"))
    if not out:
        out.append(Finding("versions", "ok", f"torch, CUDA, NCCL and driver agree on all {len(all_facts)} nodes"))
    return out


def check_master(topo: Topology, probes: Probes, timeout_s: float = 5) -> list[Finding]:
    if topo.is_worker:  # inside a running job: the rendezvous already happened
        return [Finding("master", "ok", f"the job met at {topo.master_addr}:{topo.master_port}")]
    if topo.nnodes == 1:
        if topo.source("master_port").startswith("free port"):
            return [Finding("master", "ok", "single node: a free port is picked at launch")]
        ok = probes.port_free(topo.master_port)
        return [Finding("master port", "ok" if ok else "fail",
                        f"port {topo.master_port} is {'free' if ok else 'in use'} on this node",
                        "" if ok else "choose another with --master-port, or stop what holds it")]
    src = topo.source("master_addr")
    try:
        addr = probes.resolve(topo.master_addr, timeout_s, src)
    except MeshrunError as exc:
        return [Finding("master address", "fail", str(exc).split(" (hint:")[0],
                        "check the name; on Kubernetes the headless Service must exist")]
    out = [Finding("master address", "ok", f"{topo.master_addr} resolves to {addr}")]
    if topo.node_rank == 0:
        ok = probes.port_free(topo.master_port)
        out.append(Finding("master port", "ok" if ok else "fail",
                           f"port {topo.master_port} is {'free' if ok else 'in use'} on the master (this node)",
                           "" if ok else "choose another with --master-port, or stop what holds it"))
        return out
    state = probes.connect(addr, topo.master_port, timeout_s)
    if state == "open":
        out.append(Finding("master port", "ok", f"{topo.master_addr}:{topo.master_port} answers (the job is up)"))
    elif state == "refused":
        out.append(Finding("master port", "warn", f"{topo.master_addr} is reachable but nothing listens on "
                           f"{topo.master_port}", "normal before node 0 starts its job; if it runs, the port "
                           "is closed (a firewall?) or node 0 uses another --master-port"))
    else:
        out.append(Finding("master port", "fail", f"{topo.master_addr}:{topo.master_port} {state}",
                           "a firewall or the wrong network between the nodes: open the port, check the route"))
    return out


def check_interface(topo: Topology, env: Mapping[str, str], facts: Facts, probes: Probes) -> list[Finding]:
    out = []
    names = sorted(facts.interfaces)
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = env.get(var)
        if not value:
            continue
        # NCCL accepts a comma list, prefixes and ^exclusions; check plain names exactly.
        wanted = [v for v in value.split(",") if v and not v.startswith(("^", "="))]
        missing = [w for w in wanted if not any(n == w or n.startswith(w) for n in names)]
        if missing:
            out.append(Finding("interface", "fail", f"{var}={value}: no interface {', '.join(missing)} on this node",
                               f"interfaces here: {', '.join(names)}"))
        else:
            out.append(Finding("interface", "ok", f"{var}={value} (yours; meshrun leaves it)"))
    if topo.nnodes > 1 and not out:
        try:
            addr = probes.resolve(topo.master_addr, 5, topo.source("master_addr"))
        except MeshrunError:
            return out
        ifname = probes.route(addr)
        out.append(Finding("interface", "ok" if ifname else "fail",
                           f"{ifname} routes to the master; meshrun sets GLOO/NCCL_SOCKET_IFNAME to it" if ifname
                           else f"no interface routes to {addr}", "" if ifname else "check the node's routes"))
    elif topo.nnodes > 1 and out and all(f.status == "ok" for f in out):
        try:
            addr = probes.resolve(topo.master_addr, 5, topo.source("master_addr"))
            route = probes.route(addr)
        except MeshrunError:
            route = None
        chosen = env.get("NCCL_SOCKET_IFNAME") or env.get("GLOO_SOCKET_IFNAME") or ""
        if route and chosen and not route.startswith(chosen.split(",")[0]):
            out.append(Finding("interface", "warn", f"the master is reached through {route}, not {chosen}",
                               "fine if that network also connects the nodes; else set it to " + route))
    return out


def check_fabric(topo: Topology, env: Mapping[str, str], facts: Facts) -> list[Finding]:
    ib = facts.ib_devices
    if ib and env.get("NCCL_IB_DISABLE") == "1":
        return [Finding("fabric", "warn", f"InfiniBand/EFA present ({', '.join(ib)}) but NCCL_IB_DISABLE=1",
                        "unset NCCL_IB_DISABLE unless you are debugging")]
    if ib:
        return [Finding("fabric", "ok", f"InfiniBand/EFA devices: {', '.join(ib)}")]
    if topo.nnodes > 1 and facts.gpus_visible:
        return [Finding("fabric", "warn", "no InfiniBand/EFA: inter-node traffic goes over TCP sockets",
                        "multi-node training is bound by it; on SkyPilot: resources.network_tier: best")]
    return [Finding("fabric", "ok" if facts.gpus_visible else "info", "no InfiniBand/EFA (not needed on one node)")]


def check_gpu_topology(facts: Facts) -> list[Finding]:
    if not facts.topology or facts.gpus_visible < 2:
        return []
    nvlink = "NV" in facts.topology
    return [Finding("gpu topology", "ok" if nvlink else "warn",
                    "GPUs are linked by NVLink" if nvlink else "GPUs talk over PCIe only (no NVLink)",
                    "" if nvlink else "expect lower all-reduce bandwidth; tensor parallelism is a poor fit")]


def check_gpu_health(facts: Facts) -> list[Finding]:
    out = []
    for i, h in enumerate(facts.gpu_health):
        ecc = h.get("ecc_uncorrected", "")
        if ecc.isdigit() and int(ecc) > 0:
            out.append(Finding("gpu health", "fail", f"GPU {i}: {ecc} uncorrected ECC errors",
                               "drain the node; report the GPU"))
        reasons = h.get("throttle", "")
        if reasons.startswith("0x") and int(reasons, 16) & ~0x1:  # 0x1 is plain idle
            out.append(Finding("gpu health", "warn", f"GPU {i}: clock event reasons {reasons} (throttled)",
                               "check power and temperature (nvidia-smi -q -d PERFORMANCE)"))
        limit, default = _watts(h.get("power_limit", "")), _watts(h.get("power_default", ""))
        if limit is not None and default is not None and limit < 0.95 * default:
            # Training runs at the power limit on these cards, so a lowered limit is a slower
            # job (docs/decisions.md#power-limit).
            out.append(Finding("gpu health", "warn", f"GPU {i}: power limit {limit:.0f} W, below its default "
                               f"{default:.0f} W", f"training is power-bound: raise it (nvidia-smi -pl {default:.0f}) "
                               "unless it was lowered on purpose"))
    if facts.gpu_health and not out:
        out.append(Finding("gpu health", "ok", f"{len(facts.gpu_health)} GPU(s): no ECC errors, not throttled"))
    return out


def _watts(text: str) -> float | None:
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):  # '[N/A]', '[Not Supported]', ''
        return None


def check_disk(facts: Facts) -> list[Finding]:
    if facts.disk_base:
        if os.path.abspath(facts.disk_path) == facts.disk_base:  # it exists, but not as a directory
            return [Finding("disk", "fail", f"{facts.disk_path} is not a directory",
                            "point --out at a directory (snapshots are written into it)")]
        if not os.path.isdir(facts.disk_base):
            return [Finding("disk", "fail", f"{facts.disk_path} does not exist and cannot be created: "
                            f"{facts.disk_base} is a file", "point --out at a directory")]
        ok = facts.disk_free >= MIN_FREE_DISK
        return [Finding("disk", "warn", f"{facts.disk_path} does not exist yet; {fmt_bytes(facts.disk_free)} free "
                        f"at {facts.disk_base}, its closest existing parent",
                        "check the path: meshrun train --out creates it" + ("" if ok else
                        "; snapshots need room: a 1.3B model's is 16 GB"))]
    ok = facts.disk_free >= MIN_FREE_DISK
    return [Finding("disk", "ok" if ok else "warn", f"{fmt_bytes(facts.disk_free)} free at {facts.disk_path}",
                    "" if ok else "snapshots need room: a 1.3B model's is 16 GB; point --out at a larger disk")]


def check_nccl_env(env: Mapping[str, str], facts: Facts) -> list[Finding]:
    out = []
    for var in sorted(k for k in env if k.startswith("NCCL_")):
        value = env[var]
        what = NCCL_ADVICE.get(var, "see NCCL's documentation")
        status, fix = "info", ""
        if var == "NCCL_DEBUG" and value.upper() in ("INFO", "TRACE"):
            status, fix = "warn", "keep it for debugging only"
        if var == "NCCL_P2P_DISABLE" and value == "1" and facts.gpus_visible > 1:
            status, fix = "warn", "NVLink/PCIe peer-to-peer is off: set 0 unless debugging"
        out.append(Finding("nccl env", status, f"{var}={value}: {what}", fix))
    return out


def run_checks(topo: Topology, env: Mapping[str, str], facts: Facts, probes: Probes) -> list[Finding]:
    return (check_gpus(topo, facts) + check_versions(facts) + check_master(topo, probes)
            + check_interface(topo, env, facts, probes) + check_fabric(topo, env, facts)
            + check_gpu_topology(facts) + check_gpu_health(facts) + check_disk(facts) + check_nccl_env(env, facts))
