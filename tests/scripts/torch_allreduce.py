"""Each rank contributes rank+1; every rank must see the sum. Prints one line per rank."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
print(f"ALLREDUCE rank={rank} world={world} local={os.environ['LOCAL_RANK']} sum={t.item():.0f} "
      f"ok={t.item() == expected}", flush=True)
dist.destroy_process_group()
