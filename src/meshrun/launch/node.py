"""What a node does around its launcher: refuse a taken port, prepare the network for a
multi-node job (the master's name, the interface that routes to it), and run the command
with a rendezvous that cannot form turned into one line.

Every node starts its launcher at once: torchrun's rendezvous already waits for its peers
(its store client retries for the rendezvous timeout). Whether node 0's port answers is
checked beside it (MasterProbe); the launcher's stderr is held meanwhile, and only a port
that stayed refused or unreachable for the whole bound ends the job, with the one line that
says which. A name that does not resolve fails before anything starts."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..cluster.net import port_is_free
from ..cluster.reach import DEFAULT_TIMEOUT_S, route_interface, wait_reachable
from ..cluster.reach import resolve as resolve_host
from ..cluster.topology import Topology
from ..errors import MeshrunError, bad_value
from .command import Command, LaunchSpec
from .rdzvwatch import StderrFilter
from .torchrun import thread_env

# NCCL's documented variables: set the socket interface, but never override what the user set.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def check_ports(topo: Topology, cmd: Command, spec: LaunchSpec) -> None:
    """Refuse to start when a port this node must listen on is taken: the rendezvous would
    otherwise fail late, after every other node has started and waited."""
    if "--standalone" in cmd.argv or not cmd.processes:
        return
    if topo.platform == "torchrun":  # a torchrun worker: its agent holds the store on that port, by design
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


def rdzv_timeout_s(timeout_s: int | None) -> int:
    timeout = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout < 1:
        raise bad_value("--rdzv-timeout", timeout, "must be >= 1 second")
    return timeout


def prepare_network(topo: Topology, cmd: Command, env: Mapping[str, str], timeout_s: int | None) -> Command:
    """Multi-node only, before anything starts: the master's name must resolve, and the
    interface that routes to the master becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
    unless the user set them."""
    if topo.nnodes == 1 or not cmd.processes:
        return cmd
    addr = resolve_host(topo.master_addr, rdzv_timeout_s(timeout_s), topo.source("master_addr"))
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


class MasterProbe:
    """Connects to node 0's rendezvous port in a thread, for at most the rendezvous timeout,
    while this node's launcher starts: ``reached`` once it answered, ``error`` (the one-line
    diagnosis: refused or unreachable, for how long) once the bound passed without that."""

    def __init__(self, host: str, port: int, timeout_s: int, source: str, who: str = "") -> None:
        self.reached = False
        self.error: MeshrunError | None = None
        self.done = threading.Event()
        self._args = (host, port, timeout_s, source)
        self.who = who
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            wait_reachable(*self._args)
            self.reached = True
        except MeshrunError as exc:
            self.error = MeshrunError(f"{self.who} did not come: {exc}") if self.who else exc
        finally:
            self.done.set()

    def wait(self) -> None:
        self.done.wait(self._args[2] + 30)  # its own bound, and the last connect's

    def cancel(self) -> None:
        """The job is being stopped (a signal): nobody waits for the verdict any more."""
        self.done.set()


class HeldUntilReached:
    """A stderr filter (the relay's ``watch``): the launcher's lines are held while the probe
    runs, let out once node 0 answered, dropped when it never did (the probe's line says
    it all). Wraps the RendezvousWatch of a torchrun job, when there is one."""

    def __init__(self, probe: MasterProbe, inner: StderrFilter | None = None) -> None:
        self.probe, self.inner = probe, inner
        self.held: list[bytes] = []

    def _gate(self, lines: list[bytes]) -> list[bytes]:
        if self.probe.error is not None:
            self.held = []
            return []
        self.held += lines
        if not self.probe.reached:
            return []
        out, self.held = self.held, []
        return out

    def feed(self, line: bytes) -> list[bytes]:
        return self._gate(self.inner.feed(line) if self.inner is not None else [line])

    def stale(self) -> list[bytes]:
        return self._gate(self.inner.stale() if self.inner is not None else [])

    def close(self) -> list[bytes]:
        self.probe.wait()  # the launcher ended first (its own timeout): whose line is it?
        return self._gate(self.inner.close() if self.inner is not None else [])

    def stopping(self) -> None:
        """A signal stops the job: what the launcher says next is not held for the probe."""
        self.probe.cancel()


def master_probe(topo: Topology, cmd: Command, spec: LaunchSpec) -> MasterProbe | None:
    """A probe on every process but node 0's first of a multi-node job, and on every worker
    but the first of a job whose platform started one process per device (``srun
    --ntasks-per-node=G``): rank 0 of such a job is another task, maybe not started at all."""
    if not cmd.processes or (topo.node_rank == 0 and (topo.local_rank or 0) == 0):
        return None
    if topo.nnodes == 1 and topo.local_rank is None:  # this process starts every rank itself
        return None
    return MasterProbe(topo.master_addr, topo.master_port, rdzv_timeout_s(spec.rdzv_timeout),
                       topo.source("master_addr"), who=first_process(topo))


def first_process(topo: Topology) -> str:
    """Who listens on the rendezvous port: rank 0's process, named as its platform knows it."""
    if topo.local_rank is not None:
        return f"rank 0 (node 0's first {topo.platform} task or process)"
    return f"node 0's meshrun ({topo.platform})"


def run_job(cmd: Command, env: Mapping[str, str], topo: Topology, spec: LaunchSpec, report: Any = None,
            stop_when: Callable[[], bool] | None = None, **kw: Any) -> int:
    """Execute; on a multi-node job, a master that never answered, or (torchrun) a rendezvous
    timeout, is one line. ``report``: a failure.TorchrunReport the relayed stderr passes
    through; ``stop_when``: once it holds, the job is stopped (a rank has said why it failed:
    the others would only wait on it in a collective)."""
    from .rdzvwatch import RendezvousWatch
    from .run import execute

    uses_torchrun = bool(cmd.processes) and cmd.processes[0].argv[0] == "torchrun"
    if uses_torchrun:  # every command that starts torchrun passes here: none shows its banner
        cmd = dataclasses.replace(cmd, env={**cmd.env, **thread_env(topo.nproc_per_node, {**env, **cmd.env})})
    rdzv = RendezvousWatch() if topo.nnodes > 1 and uses_torchrun else None
    inner: Any = rdzv
    if report is not None:  # torchrun's failure report held back, around the rendezvous filter
        report.inner, inner = rdzv, report
    probe = master_probe(topo, cmd, spec)
    watch = HeldUntilReached(probe, inner) if probe is not None else inner

    def abort() -> bool:
        return (probe is not None and probe.error is not None) or (stop_when is not None and stop_when())

    code = execute(cmd, env, watch=watch, abort=abort if probe is not None or stop_when is not None else None, **kw)
    if code and probe is not None:
        if code < 128:  # (a job ended by a signal says so; its probe's verdict would come later)
            probe.wait()
        if probe.error is not None:
            raise probe.error
    if code and rdzv is not None and rdzv.timed_out:
        print(f"meshrun: error: {rdzv.message(topo.master_addr, topo.master_port, topo.nnodes, spec.rdzv_timeout)}",
              file=sys.stderr, flush=True)
    return code
