"""meshrun's Trainer in your own script. The same file runs three ways:

    python examples/trainer_script.py                      # one process
    meshrun launch examples/trainer_script.py              # all GPUs, or 2 CPU processes
    torchrun --nproc_per_node=4 examples/trainer_script.py

Replace the model and datasets with yours; TrainConfig takes the same keys as `meshrun train`.
"""

import torch
from torch.utils.data import TensorDataset

from meshrun import TrainConfig, Trainer


def main() -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 20, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    train, val = TensorDataset(x[:3584], y[:3584]), TensorDataset(x[3584:], y[3584:])
    config = TrainConfig(strategy="auto", steps=150, micro_batch=32, lr=3e-3, log_every=50)
    records = Trainer(model, train, val, config).fit()
    if records:  # rank 0 keeps the records
        print(f"final loss {records[-1]['loss']:.4f}, validation {records[-1]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
