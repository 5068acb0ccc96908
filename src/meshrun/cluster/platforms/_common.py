from __future__ import annotations

DEFAULT_PORT = 29500  # torchrun's default rendezvous port


def per_node_default(gpus: int) -> tuple[int, str]:
    """One process per visible GPU; one process on a CPU-only node."""
    if gpus > 0:
        return gpus, "visible GPUs"
    return 1, "default (no GPU: one process per node)"


def lone_master(nnodes: int) -> str:
    """The rendezvous address when the platform names none: loopback for one node, else
    empty, which validation turns into an error that asks for --master-addr."""
    return "127.0.0.1" if nnodes == 1 else ""
