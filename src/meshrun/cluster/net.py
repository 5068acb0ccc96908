"""Small socket helpers for rendezvous ports (the side-effecting edge of cluster/)."""

from __future__ import annotations

import socket


def free_port(count: int = 1, host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port the kernel says is free now, for single-node jobs whose port nobody chose.
    With ``count`` > 1, the first of that many consecutive free ports: TensorFlow workers on
    one node listen on master_port + local_rank, and an ephemeral port picked alone may have
    a neighbour an outgoing connection holds."""
    port = 0
    for _ in range(max(1, tries)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port + count - 1 <= 65535 and all(port_is_free(port + i) for i in range(1, count)):
            return port
    return port  # the last candidate; check_ports still names any port that is taken


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
