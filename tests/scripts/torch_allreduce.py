"""Each rank contributes rank+1; every rank must see the sum. Prints one line per rank."""
import os
import sys

import torch
import torch.distributed as dist

if torch.cuda.is_available():  # NCCL on GPUs, one per process
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
else:
    dist.init_process_group("gloo")
    device = torch.device("cpu")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(t)
expected = world * (world + 1) / 2
# One write per line: print() may split text and newline, interleaving ranks' output.
sys.stdout.write(f"ALLREDUCE rank={rank} world={world} local={os.environ['LOCAL_RANK']} "
                 f"sum={t.item():.0f} ok={t.item() == expected} backend={dist.get_backend()}\n")
sys.stdout.flush()
dist.barrier()  # nobody tears down while a peer is still in a collective
dist.destroy_process_group()
