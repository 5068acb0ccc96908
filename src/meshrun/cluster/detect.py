"""Resolve one Topology from the environment, the GPU count and the user's flags.

Probe order (first match wins), and why:

1. ``torchrun``   a TorchElastic worker: torchrun runs inside every platform below (and the
                  user's), and its per-worker variables are then the truth.
1a. user platforms (userplatforms.py: MESHRUN_PLATFORMS, then the ``meshrun.platforms`` entry
                  points), before every other built-in one: the user added them for this cluster.
2. ``lsf``        LSB_JOBID (IBM LSF); jsrun's JSM_NAMESPACE_* say which job step placed this
                  process. Before ``mpi`` because jsrun also sets Open MPI's variables; mpirun
                  inside an LSF job (no JSM_*) is left to ``mpi``.
3. ``mpi``        mpirun may start meshrun inside a Slurm allocation; MPI's layout is the
                  one that actually placed this process.
4. ``skypilot``   SKYPILOT_* describe this task even on Kubernetes or Slurm infrastructure.
5. ``saturn``     SATURN_JOB_* (Saturn Cloud runs on Kubernetes).
6. ``kubeflow``   PET_* from the training operator, or, in a Kubernetes pod, MASTER_ADDR with
                  WORLD_SIZE and RANK counting pods; before ``generic`` because it also sets
                  MASTER_ADDR, and its RANK/WORLD_SIZE count pods, not processes.
7. ``sagemaker``  SM_HOSTS / SM_CURRENT_HOST.
8. ``slurm``      SLURM_JOB_ID.
9. ``generic``    MASTER_ADDR (+ NNODES, NODE_RANK, MASTER_PORT, NPROC_PER_NODE).
10. ``local``     nothing found: this machine alone.

``--platform NAME`` skips the probing. Flags (or their MESHRUN_* variables) then override
single values, and the result is validated as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields

from ..errors import MeshrunError, bad_value
from . import userplatforms
from .net import host_problem
from .platforms import generic, kubeflow, local, lsf, mpi, sagemaker, saturn, skypilot, slurm, torchrun
from .platforms.base import DEFAULT_MASTER_HINT, Platform
from .topology import MAX_NODES, Topology

PROBE_ORDER: tuple[Platform, ...] = (
    torchrun.Torchrun(), lsf.LSF(), mpi.MPI(), skypilot.SkyPilot(), saturn.Saturn(), kubeflow.Kubeflow(),
    sagemaker.SageMaker(), slurm.Slurm(), generic.Generic(), local.Local(),
)
PLATFORMS: dict[str, Platform] = {p.NAME: p for p in PROBE_ORDER}  # the built-in ones
Detector = Callable[[Mapping[str, str], int], Topology | None]


def probe_order(env: Mapping[str, str]) -> list[tuple[Platform, Detector]]:
    """Every platform with its detect, in the order they are tried: a torchrun worker's own
    variables, then the user's platforms (their detect guarded: see
    userplatforms.Registration.detect), then the other built-in ones."""
    users: list[tuple[Platform, Detector]] = [(r.platform, r.detect) for r in userplatforms.load(env, PLATFORMS)]
    worker, *rest = PROBE_ORDER
    return [(worker, worker.detect), *users, *((p, p.detect) for p in rest)]


@dataclass(frozen=True)
class Overrides:
    """Values the user gave explicitly; ``sources`` says how (``flag --nnodes``)."""

    nnodes: int | None = None
    node_rank: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hosts: tuple[str, ...] | None = None
    run_id: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def given(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "sources" and getattr(self, f.name) is not None}


def detect_platform(env: Mapping[str, str], gpus: int, platform: str | None = None,
                    order: list[tuple[Platform, Detector]] | None = None) -> Topology:
    """The first platform whose detect matches (``order``: probe_order(env)), or ``platform``'s."""
    order = probe_order(env) if order is None else order
    if platform is not None:
        named = {p.NAME: (p, d) for p, d in order}
        if platform not in named:
            raise bad_value("--platform", platform, "unknown platform",
                            f"choose one of {', '.join(named)}")
        chosen, detect = named[platform]
        topo = detect(env, gpus)
        if topo is None:
            raise bad_value("--platform", platform, "its variables are not set here",
                            f"{platform} is recognised by {chosen.MARKERS}")
        return topo.replace(sources={"platform": "flag --platform"})
    for candidate, detect in order:
        topo = detect(env, gpus)
        if topo is not None:
            src = topo.sources.get("platform") or f"detected ({candidate.MARKERS} set)"
            return topo.replace(sources={"platform": src})
    raise MeshrunError("no platform matched")  # unreachable: local always matches


def apply_overrides(topo: Topology, ov: Overrides) -> Topology:
    changes = ov.given()
    if not changes:
        return topo
    srcs = {k: ov.sources.get(k, f"flag --{k.replace('_', '-')}") for k in changes}
    if "hosts" in changes and "master_addr" not in changes:
        hosts = changes["hosts"]
        if hosts:
            changes["master_addr"] = hosts[0]  # type: ignore[index]
            srcs["master_addr"] = srcs["hosts"] + " (first host)"
    if "nnodes" in changes and "hosts" not in changes and topo.hosts:
        # A different node count makes the platform's host list meaningless.
        if changes["nnodes"] != len(topo.hosts):
            changes["hosts"] = ()
            srcs["hosts"] = "dropped: " + srcs["nnodes"] + " differs from the platform's host count"
    nnodes = changes.get("nnodes", topo.nnodes)
    node_rank = changes.get("node_rank", topo.node_rank)
    if ("master_addr" not in changes and nnodes > 1 and node_rank > 0  # type: ignore[operator]
            and topo.source("master_addr") == "default"):
        # The platform's address is its single-node default (loopback): on another node it
        # would point at the wrong machine, so it is dropped and validation asks for one, as
        # it does when NNODES/NODE_RANK come from the environment.
        changes["master_addr"] = ""
        srcs["master_addr"] = "dropped: a single-node default"
    return topo.replace(sources=srcs, **changes)


def validate(topo: Topology, gpus: int, platforms: Iterable[Platform] = PROBE_ORDER) -> Topology:
    """Refuse a topology that cannot run; ``platforms`` (user ones too) give the master hint."""
    s = topo.source
    if topo.nnodes < 1:
        raise bad_value(s("nnodes"), topo.nnodes, "must be at least 1")
    if topo.nnodes > MAX_NODES:
        raise bad_value(s("nnodes"), topo.nnodes, f"more than {MAX_NODES:,} nodes, past any cluster built",
                        "the number of machines in the job")
    if topo.nproc_per_node < 1:
        raise bad_value(s("nproc_per_node"), topo.nproc_per_node, "must be at least 1")
    if not 0 <= topo.node_rank < topo.nnodes:
        raise bad_value(s("node_rank"), topo.node_rank,
                        f"node rank must be in 0..{topo.nnodes - 1} (nnodes={topo.nnodes} from {s('nnodes')})",
                        "node ranks count from 0")
    if topo.hosts and len(topo.hosts) != topo.nnodes:
        raise bad_value(s("hosts"), ",".join(topo.hosts),
                        f"lists {len(topo.hosts)} host(s) but nnodes={topo.nnodes} (from {s('nnodes')})",
                        "give one address per node, in node-rank order")
    if not 1 <= topo.master_port <= 65535:
        raise bad_value(s("master_port"), topo.master_port, "is not a TCP port (1-65535)")
    if topo.nnodes > 1 and not topo.master_addr:
        hint = next((p.MASTER_HINT for p in platforms if p.NAME == topo.platform), DEFAULT_MASTER_HINT)
        raise bad_value("master address", "", f"unknown for a {topo.nnodes}-node job on platform {topo.platform}", hint)
    for host, name in [(topo.master_addr, s("master_addr")), *((h, s("hosts")) for h in topo.hosts)]:
        problem = host_problem(host) if host else None
        if problem:
            raise bad_value(name, host, problem, "give an IPv4/IPv6 address or a host name such as node-0.cluster")
    if topo.local_rank is not None and not 0 <= topo.local_rank < topo.nproc_per_node:
        raise bad_value(s("local_rank"), topo.local_rank,
                        f"must be below nproc_per_node={topo.nproc_per_node} (from {s('nproc_per_node')})")
    if gpus > 0 and topo.local_rank is None and topo.nproc_per_node > gpus:
        raise bad_value(s("nproc_per_node"), topo.nproc_per_node,
                        f"is more processes than the {gpus} GPU(s) visible on this node",
                        "use one process per GPU: lower --nproc, or check CUDA_VISIBLE_DEVICES")
    return topo


# (rank variable, size variable): torchrun's per-worker variables and the node-count pair,
# wherever they come from; a rank must lie in 0..size-1.
RANK_PAIRS = (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("GROUP_RANK", "GROUP_WORLD_SIZE"),
              ("GROUP_RANK", "NNODES"), ("NODE_RANK", "NNODES"))


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_value(f"env {name}", raw, "not an integer",
                        f"{name} must be a whole number; fix or unset it") from None


def check_worker_variables(env: Mapping[str, str]) -> None:
    """Refuse rank and size variables that contradict each other (RANK=5 with WORLD_SIZE=2, a
    negative rank): a platform that reads one of them would start a worker with a rank no
    peer expects, and one that ignores them would run the script as another rank than the
    environment says."""
    for rank_var, size_var in RANK_PAIRS:
        rank, size = _env_int(env, rank_var), _env_int(env, size_var)
        if rank is not None and rank < 0:
            raise bad_value(f"env {rank_var}", env[rank_var], "a rank is never negative", f"fix or unset {rank_var}")
        if size is not None and size < 1:
            raise bad_value(f"env {size_var}", env[size_var], "must be at least 1", f"fix or unset {size_var}")
        if rank is not None and size is not None and rank >= size:
            raise bad_value(f"env {rank_var}", env[rank_var],
                            f"must be below env {size_var}={size} (ranks count 0..{size - 1})",
                            f"fix or unset {rank_var} and {size_var}: they come from another job's launcher or "
                            "a shell profile")


def resolve(
    env: Mapping[str, str],
    gpus: int,
    platform: str | None = None,
    overrides: Overrides = Overrides(),
    free_port: Callable[[int], int] | None = None,
) -> Topology:
    """Detect, override, validate. Pure unless ``free_port`` is given: on a single node whose
    port nobody chose, that callable picks a free one (the first of ``nproc_per_node`` free
    consecutive ports, enough for any framework's listeners) so parallel local runs do not
    collide. Not for a worker: the platform started every rank, and each would pick its own.
    User platforms (MESHRUN_PLATFORMS in ``env``, entry points) are tried before the built-in
    ones, a torchrun worker's variables excepted."""
    order = probe_order(env)
    topo = apply_overrides(detect_platform(env, gpus, platform, order), overrides)
    check_worker_variables(env)  # (after the platform's own checks, which say more)
    # Validated before a port is picked: a refused --nproc 5000 binds no 5,000 sockets.
    topo = validate(topo, gpus, [p for p, _ in order])
    if (free_port is not None and topo.nnodes == 1 and not topo.is_worker
            and topo.source("master_port") == "default"):
        topo = topo.replace(master_port=free_port(topo.nproc_per_node),
                            sources={"master_port": "free port (single node)"})
    return topo


# Ranks per core on the CPU: each is a Python interpreter with torch (about 300 MB) and its own
# threads; four per core still trains (the suite runs 4 gloo ranks on 2 cores), far past that a
# node runs out of memory or processes before the first step.
CPU_RANKS_PER_CORE = 4


def processes_fit(topo: Topology, gpus: int | None, cpus: int) -> None:
    """This node's processes against what it has: a GPU each where there are GPUs (two ranks
    on one GPU: NCCL refuses them), at most CPU_RANKS_PER_CORE per core on the CPU."""
    n, given = topo.nproc_per_node, topo.sources.get("nproc_per_node", "default")
    name = "--nproc" if given.startswith(("flag", "default")) else f"--nproc (from {given})"
    if gpus and n > gpus:
        raise bad_value(name, n, f"more processes than this node's {gpus} GPU(s): each rank takes one GPU",
                        f"--nproc {gpus} or fewer")
    if gpus == 0 and n > CPU_RANKS_PER_CORE * cpus:
        raise bad_value(name, n, f"more than {CPU_RANKS_PER_CORE} processes per core on the CPU ({cpus} core(s) "
                        f"here: at most {CPU_RANKS_PER_CORE * cpus})", f"--nproc {cpus}")
