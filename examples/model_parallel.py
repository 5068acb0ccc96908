"""The PyTorch model-parallel tutorial's "very simple model parallelism": two layers, two devices, one process.

    python examples/model_parallel.py [EPOCHS]

The first Linear lives on cuda:0, the second on cuda:1, and activations move between them
in forward (and their gradients back in backward). One device works while the other waits:
simple, not efficient. The pipelined version of the same idea, with micro-batches keeping
both busy, is `meshrun train --pp 2` (torch.distributed.pipelining). Without two GPUs the
two "devices" are both the CPU, so the example still runs.
"""
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ModelParallelNN(nn.Module):
    def __init__(self, device1: torch.device, device2: torch.device) -> None:
        super().__init__()
        self.device1, self.device2 = device1, device2
        self.linear1 = nn.Linear(20, 20).to(device1)  # first layer on device1
        self.linear2 = nn.Linear(20, 1).to(device2)  # second layer on device2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear1(x.to(self.device1)))
        return self.linear2(x.to(self.device2))  # the activation crosses devices here


def main() -> None:
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    two_gpus = torch.cuda.device_count() >= 2
    device1 = torch.device("cuda:0") if two_gpus else torch.device("cpu")
    device2 = torch.device("cuda:1") if two_gpus else torch.device("cpu")
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = x.sum(dim=1, keepdim=True)  # a target the model can learn
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, pin_memory=two_gpus)
    model = ModelParallelNN(device1, device2)
    criterion = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first = last = None
    for _ in range(epochs):
        for inputs, targets in loader:
            outputs = model(inputs)
            loss = criterion(outputs, targets.to(outputs.device))  # the loss where the output is
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            first = loss.item() if first is None else first
            last = loss.item()
    sys.stdout.write(f"MODELPARALLEL devices={device1},{device2} first={first:.4f} last={last:.4f}\n")


if __name__ == "__main__":
    main()
