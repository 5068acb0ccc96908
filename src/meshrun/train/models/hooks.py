"""What a model (or one of its modules) may offer the trainer, declared: a user's model can
provide the same methods and get the same treatment as meshrun's GPT.

- ``KernelModel.meshrun_kernels(device, tp, pp)``: the names of the model's own kernels that
  run under this layout (the trainer's first line lists them). A model without it gets Liger
  Kernel's patches where they apply.
- ``ExpertModule.shard_experts(group)``: a mixture-of-experts module keeps only its share of
  the experts of ``group``'s ranks (``--ep``); ``stats_group`` is where its load-balancing
  statistics are averaged.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class KernelModel(Protocol):
    def meshrun_kernels(self, device: torch.device, tp: int = 1, pp: int = 1) -> list[str]: ...


@runtime_checkable
class ExpertModule(Protocol):
    stats_group: Any

    def shard_experts(self, group: Any) -> None: ...
