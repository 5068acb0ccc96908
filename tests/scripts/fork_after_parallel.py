"""meshrun.run with fork after the parent has used OpenMP's thread pool: must not hang."""
import sys

import torch
import torch.distributed as dist

import meshrun


def work():
    x = torch.randn(512, 512)
    t = torch.tensor([float((x @ x).shape[0])])
    dist.all_reduce(t)
    return t.item()


a = torch.randn(1000, 1000, requires_grad=True)
(a @ a).sum().backward()  # parallel CPU work here: the pool exists in this process now
sys.stdout.write(f"FORKRUN result={meshrun.run(work, nproc=2, start_method='fork', timeout_s=60):.0f}\n")
