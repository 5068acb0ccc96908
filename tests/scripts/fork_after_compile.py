"""meshrun.run after the parent compiled with Inductor (cold cache): forked ranks must not hang,
and ranks started after a compiled backward pass (which starts autograd's device threads on
some torch versions, after which a forked child refuses every backward) must train."""
import sys

import torch
import torch.distributed as dist

import meshrun
from meshrun.api import _autograd_threads_started


def work():
    double = torch.compile(lambda x: torch.cos(x) * 2 + x)  # a fresh compile in every rank
    t = double(torch.zeros(16)).sum().reshape(1)
    dist.all_reduce(t)
    return t.item()


def backward():
    w = torch.ones(4, requires_grad=True)
    (w * (dist.get_rank() + 1)).sum().backward()
    g = w.grad.clone()
    dist.all_reduce(g)
    return g.sum().item()


if __name__ == "__main__":
    torch.compile(lambda x: torch.sin(x) * 3 - x)(torch.randn(64))  # Inductor's compile pools exist here now
    sys.stdout.write(f"FORKRUN result={meshrun.run(work, nproc=2, start_method='fork', timeout_s=150):.0f}\n")
    x = torch.randn(8, requires_grad=True)
    torch.compile(lambda t: torch.tanh(t) * 2)(x).sum().backward()
    sys.stdout.write(f"AUTOGRAD threads={int(_autograd_threads_started())} "
                     f"result={meshrun.run(backward, nproc=2, timeout_s=150):.0f}\n")
    sys.stdout.flush()
