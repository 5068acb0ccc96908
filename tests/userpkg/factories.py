"""User code for `meshrun train --model ... --data ...` tests."""
import os
import time

import torch
from torch.utils.data import TensorDataset


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def regression():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 20, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return TensorDataset(x, y), TensorDataset(x[:128], y[:128])


def broken():
    raise RuntimeError("database unreachable")


class _OutOfMemoryAtFirstStep(torch.nn.Module):
    """Raises the exception CUDA raises when a step does not fit (this suite has no GPU)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(20, 1)

    def forward(self, x):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def oom_model():
    return _OutOfMemoryAtFirstStep()


def nan_data():
    x = torch.full((256, 20), float("nan"))
    return TensorDataset(x, torch.zeros(256, 1))


class _GatedBlock(torch.nn.Module):
    """A Llama-shaped block (no attention math needed: the planner only reads shapes)."""

    def __init__(self, h=64, f=176, heads=4):
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate = torch.nn.Linear(h, f, bias=False)
        self.up = torch.nn.Linear(h, f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)


class TinyLlama(torch.nn.Module):
    def __init__(self, vocab=1000, h=64, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(_GatedBlock(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab, bias=False)


def tiny_llama():
    return TinyLlama()


class _Tokens(torch.utils.data.Dataset):
    """Seeded random token sequences (x, y = x shifted), as a user's map-style dataset. On a
    job's first run (none once Slurm has requeued it) an item takes USERPKG_ITEM_DELAY_S
    seconds once this process has read USERPKG_DELAY_AFTER items (default 0): a slow loader,
    or one that stalls near the end, so that a kill or a scheduler's signal finds the job
    mid-run however fast the host runs the steps before."""

    def __init__(self, n: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 256, (n, seq + 1), generator=g)
        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        self.delay = float(os.environ.get("USERPKG_ITEM_DELAY_S", "0")) if first_run else 0.0
        self.fast = int(os.environ.get("USERPKG_DELAY_AFTER", "0"))  # items read before the delay starts

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        if self.fast > 0:
            self.fast -= 1
        elif self.delay:
            time.sleep(self.delay)
        row = self.tokens[i]
        return row[:-1], row[1:]


def slow_tokens():
    return _Tokens(4096, 32, 1), _Tokens(64, 32, 2)


class _FailsOnRank(torch.nn.Module):
    """A regression model whose forward, on rank USERPKG_FAIL_RANK (default 1), raises
    (USERPKG_FAIL=raise) or kills its own process with SIGKILL (USERPKG_FAIL=kill)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(20, 1)

    def forward(self, x):
        if os.environ.get("RANK") == os.environ.get("USERPKG_FAIL_RANK", "1"):
            if os.environ.get("USERPKG_FAIL", "raise") == "kill":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("shapes (8, 20) and (21, 1) do not match\nsecond line of the message")
        return self.linear(x)


def fails_on_rank():
    return _FailsOnRank()


class _OutOfMemoryAbove(torch.nn.Module):
    """A regression MLP that raises CUDA's out-of-memory exception for a micro-batch larger
    than USERPKG_MAX_MICRO (default 4): what a GPU does when a micro-batch does not fit."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x):
        if x.shape[0] > int(os.environ.get("USERPKG_MAX_MICRO", "4")):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} GiB")
        return self.net(x)


def oom_above():
    return _OutOfMemoryAbove()


class _WarnsEveryStep(torch.nn.Module):
    """A regression MLP whose forward warns on every call, on every rank (as Liger's Triton
    kernels did under torch.compile)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(20, 1)

    def forward(self, x):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("always")  # as a library that warns each time does
            warnings.warn("kernel fell back to the slow path\nwith a second line", UserWarning, stacklevel=1)
        return self.linear(x)


def warns_every_step():
    return _WarnsEveryStep()
