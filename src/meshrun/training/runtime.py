"""The per-process runtime: process group, device, and a clean teardown.

Works under `meshrun train`/`meshrun launch`, plain torchrun, and as a single process (no
RANK in the environment: world of one, no process group needed but one is made anyway so
collectives in the loop need no special case).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cluster.net import free_port


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def init_runtime(timeout_s: float = 600) -> Runtime:
    """NCCL with one GPU per process (from LOCAL_RANK) when CUDA is there, else gloo on CPU.

    ``timeout_s`` bounds every wait for a peer: the rendezvous store's, and each collective's
    (gloo raises in the waiting rank; NCCL's watchdog aborts the process, which
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 asks for unless the user set it: a rank that stopped
    answering then ends the job instead of hanging it)."""
    if "RANK" not in os.environ:  # a plain `python train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return Runtime(rank, local_rank, world, local_world, device, backend)


def take_blas_workspaces(device: torch.device) -> None:
    """Have cuBLAS take its workspaces now, while nothing large is free. cuBLAS takes one
    (32 MiB on Hopper) from the caching allocator the first time a thread multiplies on a
    stream and keeps it for good; the backward runs on autograd's own thread, so without
    this its workspace is taken at the first backward matmul, the head's, just after the
    loss freed its logits-sized blocks, and it pins one of them: the next steps then take
    a new logits-sized segment (as recorded allocator traces show:
    docs/decisions.md#cublas-workspaces). A small product and its backward, in fp32 and under
    bf16 autocast (cuBLASLt's path), take the forward thread's and autograd's workspaces on
    the current stream."""
    if device.type != "cuda":
        return
    w = torch.zeros(64, 64, device=device, requires_grad=True)
    b = torch.zeros(64, device=device, requires_grad=True)
    x = torch.zeros(64, 64, device=device)
    for low in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=low):
            torch.nn.functional.linear(x, w, b).sum().backward()


def teardown() -> None:
    """Collect garbage, then barrier, then destroy. With gloo, destroying the group while a
    DDP reducer caught in a reference cycle still holds it, or while a peer is still inside
    a collective, can abort a finished process ('terminate called without an active
    exception'): seen in about 1 run in 20 here, none in 30 after this order."""
    gc.collect()
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def teardown_at_exit() -> None:
    """For a Trainer in the user's own script, which never calls teardown: do it when the
    interpreter exits, before Python tears down the modules under gloo's threads (the abort
    above, seen under plain torchrun). The barrier is bounded, so a rank whose peer died does
    not wait at exit forever."""
    import atexit

    def bounded() -> None:
        gc.collect()
        if not dist.is_initialized():
            return
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            else:
                dist.barrier()
        except Exception:  # a peer is gone: nothing to wait for
            pass
        finally:
            dist.destroy_process_group()

    atexit.register(bounded)
