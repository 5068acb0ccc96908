"""pytorch/examples' DDP tutorial model: Linear(20 -> 1), trained on ToyRegression."""

from __future__ import annotations

import torch
import torch.nn as nn


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(20, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
