"""Two or more "hosts" on this machine: network namespaces on one bridge (itself in a
namespace of its own), with addresses in a private /24 created here and nowhere else.

Names resolve per namespace: ``ip netns exec`` bind-mounts /etc/netns/NAME/hosts over
/etc/hosts, so each host can resolve its peers' DNS names (Saturn Cloud's pod names) as a
cluster's DNS would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass
class Host:
    netns: str
    ifname: str
    addr: str

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        assigns = [f"{k}={v}" for k, v in env.items()]
        return ["ip", "netns", "exec", self.netns, "env", "-i", *assigns, *argv]


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def create_hosts(tag: str, subnet: int, n: int, names: dict[str, int]) -> list[Host]:
    """``n`` hosts 10.231.SUBNET.1..n on one switch: a bridge inside its own namespace
    (nothing is added to the machine's own network), one veth pair per host."""
    hosts = [Host(f"mr{tag}h{i}", f"mv{tag}h{i}", f"10.231.{subnet}.{i + 1}") for i in range(n)]
    switch = f"mr{tag}sw"
    destroy(hosts, switch)
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for i, h in enumerate(hosts):
        _ip("netns", "add", h.netns)
        port = f"mp{tag}h{i}"
        _ip("link", "add", h.ifname, "type", "veth", "peer", "name", port)
        _ip("link", "set", h.ifname, "netns", h.netns)
        _ip("link", "set", port, "netns", switch)
        _ip("-n", switch, "link", "set", port, "master", "br0")
        _ip("-n", switch, "link", "set", port, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
        _ip("-n", h.netns, "link", "set", h.ifname, "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        etc = f"/etc/netns/{h.netns}"
        os.makedirs(etc, exist_ok=True)
        with open(f"{etc}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n")
            for name, index in names.items():
                f.write(f"{hosts[index].addr} {name}\n")
    return hosts


def kill_all(hosts: list[Host]) -> None:
    """SIGKILL every process still running inside the hosts' namespaces (launchers start
    their children in new sessions, so killing the top process is not enough)."""
    for h in hosts:
        out = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True, timeout=30)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass


def destroy(hosts: list[Host], switch: str | None = None) -> None:
    kill_all(hosts)
    for h in hosts:
        subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)
        shutil.rmtree(f"/etc/netns/{h.netns}", ignore_errors=True)
    if switch:
        subprocess.run(["ip", "netns", "del", switch], capture_output=True, timeout=30)
