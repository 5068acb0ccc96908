"""Small socket helpers for rendezvous ports (the side-effecting edge of cluster/)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel says is free now (for single-node jobs whose port nobody chose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every interface. SO_REUSEADDR, as
    torch's TCPStore sets it, so a port in TIME_WAIT counts as free, as it is for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
