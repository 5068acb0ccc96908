"""User code for `meshrun train --model ... --data ...` tests."""
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
