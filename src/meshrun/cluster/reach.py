"""Can this node reach the rendezvous? Bounded probes at the CLI's edge (side effects).

A multi-node job that cannot form should say why within a known time instead of hanging:
the master's name does not resolve, nothing listens on its port (connection refused: node
0 is not up yet, or listens elsewhere), or the packets go nowhere (unreachable, filtered).
A node that starts before node 0 simply keeps trying until the deadline.
"""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import threading
import time

from ..errors import MeshrunError

DEFAULT_TIMEOUT_S = 600  # torchrun's own default for its static and c10d rendezvous


def _lookup(host: str, bound_s: float) -> str:
    """One getaddrinfo, waited for at most ``bound_s``. It runs in a daemon thread: a broken
    resolver can block for long, and a thread stuck in it must not keep the process alive.
    Raises TimeoutError, or socket.gaierror with the resolver's answer."""
    found: list[str | socket.gaierror] = []

    def look() -> None:
        try:
            found.append(str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]))
        except socket.gaierror as exc:
            found.append(exc)

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(bound_s)
    if not found:
        raise TimeoutError
    if isinstance(found[0], socket.gaierror):
        raise found[0]
    return found[0]


def resolve(host: str, timeout_s: float, source: str) -> str:
    """The host's IPv4 address, retrying until ``timeout_s`` (a Kubernetes pod's DNS record
    appears a little after the pod); an address is its own answer. Each try has its own
    bound (getaddrinfo can block for long on a broken resolver)."""
    try:
        socket.inet_pton(socket.AF_INET, host)
        return host
    except (OSError, ValueError):
        pass
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        left = deadline - time.monotonic()
        try:
            return _lookup(host, max(0.1, min(10.0, left)))
        except TimeoutError:
            last = "the resolver did not answer"
        except socket.gaierror as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            raise MeshrunError(
                f"{source}={host!r}: the name does not resolve ({last}; tried for {timeout_s:.0f} s) "
                "(hint: check the spelling and that node 0's DNS record exists; on Kubernetes, the "
                "headless Service)")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def wait_reachable(host: str, port: int, timeout_s: float, source: str) -> None:
    """Until ``timeout_s``: connect to host:port (node 0's rendezvous store). Refused means
    nothing listens yet, so try again; at the deadline, say which failure it was."""
    deadline = time.monotonic() + timeout_s
    addr = resolve(host, timeout_s, source)
    kinds: dict[str, str] = {}
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.2, min(5.0, left))):
                return
        except ConnectionRefusedError:
            kinds["refused"] = "connection refused"
        except TimeoutError:
            kinds["timeout"] = "no answer"
        except OSError as exc:
            kinds["unreachable"] = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    where = f"{host}:{port}" + (f" ({addr})" if addr != host else "")
    if "refused" in kinds and len(kinds) == 1:
        raise MeshrunError(
            f"rendezvous at {where}: connection refused for {timeout_s:.0f} s, nothing listens there "
            "(hint: start meshrun on node 0 with the same --master-port; or raise --rdzv-timeout)")
    reason = kinds.get("unreachable") or kinds.get("timeout") or "unknown"
    raise MeshrunError(
        f"rendezvous at {where}: unreachable ({reason}) for {timeout_s:.0f} s "
        "(hint: a firewall or the wrong network between the nodes; check the address, or that the "
        "port is open)")


def _ipv4_of(ifname: str) -> str | None:
    """An interface's IPv4 address (Linux SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_interface(addr: str) -> str | None:
    """The interface whose address this host would use to reach ``addr`` (an IPv4 address):
    the kernel's routing decision, read by 'connecting' a UDP socket (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None
