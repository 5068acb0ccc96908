"""Small socket helpers for rendezvous ports (the side-effecting edge of cluster/)."""

from __future__ import annotations

import atexit
import socket
from collections.abc import Iterator
from contextlib import contextmanager

# Ports free_port picked, each with its bound sockets, until released or this process exits.
_held: dict[int, list[socket.socket]] = {}


def free_port(count: int = 1, host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port the kernel says is free now, for single-node jobs whose port nobody chose.
    With ``count`` > 1, the first of that many consecutive free ports: TensorFlow workers on
    one node listen on master_port + local_rank, and an ephemeral port picked alone may have
    a neighbour an outgoing connection holds.

    The ports stay bound by this process (SO_REUSEADDR, not listening) until ``release_port``
    or its exit. The kernel then gives them to no other process's bind to port 0 nor outgoing
    connection, while the rank that listens there binds them as well: torch's TCPStore (2.7
    to 2.15) and gRPC set SO_REUSEADDR too, and Linux lets sockets that all set it share a
    port that none listens on. Picked and let go, a port was taken by another process's
    connection in the seconds before rank 0 listened (two suites on one 2-core box: "port
    ... is already in use on this node")."""
    port = 0
    for _ in range(max(1, tries)):
        first = _bound(host, 0)
        if first is None:
            continue
        port = int(first.getsockname()[1])
        socks = [first]
        for i in range(1, count):
            nxt = _bound(host, port + i) if port + i <= 65535 else None
            if nxt is None:
                break
            socks.append(nxt)
        if len(socks) == count:
            if not _held:  # closed at exit: a socket left to the interpreter's teardown warns
                atexit.unregister(_release_all)
                atexit.register(_release_all)
            _held[port] = socks
            return port
        for s in socks:
            s.close()
    return port  # the last candidate; check_ports still names any port that is taken


def release_port(port: int) -> None:
    """Let go of a port ``free_port`` holds (its job is over)."""
    for s in _held.pop(port, []):
        s.close()


@contextmanager
def ports_released_after() -> Iterator[None]:
    """Let go, when the block ends, of the ports ``free_port`` picked inside it: the command that
    used them is over. A process that runs many commands (``meshrun.train()`` in a notebook, the
    CLI called in-process) would otherwise hold one socket per command until it exits."""
    before = set(_held)
    try:
        yield
    finally:
        for port in [p for p in _held if p not in before]:
            release_port(port)


def _release_all() -> None:
    for port in list(_held):
        release_port(port)


def _bound(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def port_is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every interface. SO_REUSEADDR, as
    torch's TCPStore sets it, so a port in TIME_WAIT counts as free, as it is for it."""
    s = _bound("", port)
    if s is None:
        return False
    s.close()
    return True


def host_problem(host: str) -> str | None:
    """What is wrong with ``host`` as a rendezvous address, or None: an IPv4 or IPv6 literal
    (brackets allowed), or an RFC 1123 host name: ASCII letters, digits and hyphens, labels of
    1-63 characters that neither start nor end with a hyphen, at most 253 characters in all
    (one trailing dot allowed). An underscore is let through: the resolver accepts it, and
    Docker Compose service names carry it. Checked before anything starts: torchrun and the resolver
    retry a malformed name for the whole rendezvous timeout, then blame the network."""
    if not host.isascii() or not host.isprintable():
        return "is not an ASCII host name (only letters, digits, '-' and '.')"
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, literal)
            return None
        except (OSError, ValueError):
            pass
    if ":" in host:
        return "is neither an IPv6 address nor a host name"
    name = host.removesuffix(".")
    if len(name) > 253:
        return f"is {len(name)} characters long; a host name has at most 253"
    for label in name.split("."):
        if not label:
            return "has an empty label (two dots in a row, or a leading dot)"
        if len(label) > 63:
            return f"has a label of {len(label)} characters ({label[:12]}...); a label has at most 63"
        if not all(c.isalnum() or c in "-_" for c in label):
            bad = next(c for c in label if not (c.isalnum() or c in "-_"))
            return f"has {bad!r} in label {label!r}; a host name holds letters, digits and '-'"
        if label.startswith("-") or label.endswith("-"):
            return f"has label {label!r} starting or ending with '-'"
    return None
