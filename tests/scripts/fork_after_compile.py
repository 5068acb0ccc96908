"""meshrun.run with fork after the parent compiled with Inductor (cold cache): must not hang."""
import sys

import torch
import torch.distributed as dist

import meshrun


def work():
    double = torch.compile(lambda x: torch.cos(x) * 2 + x)  # a fresh compile in every rank
    t = double(torch.zeros(16)).sum().reshape(1)
    dist.all_reduce(t)
    return t.item()


torch.compile(lambda x: torch.sin(x) * 3 - x)(torch.randn(64))  # Inductor's compile pools exist here now
sys.stdout.write(f"FORKRUN result={meshrun.run(work, nproc=2, start_method='fork', timeout_s=150):.0f}\n")
