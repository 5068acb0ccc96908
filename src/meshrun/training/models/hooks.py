"""What a model (or one of its modules) may offer the trainer, declared: a user's model can
provide the same methods and attributes and get the same treatment as meshrun's GPT. The
trainer asks ``isinstance(x, Protocol)`` of these, never ``hasattr`` of a name.

- ``KernelModel.meshrun_kernels(device, tp, pp)``: the names of the model's own kernels that
  run under this layout (the trainer's strategy line lists them). A model without it gets Liger
  Kernel's patches where they apply.
- ``ExpertModule.shard_experts(group)``: a mixture-of-experts module keeps only its share of
  the experts of ``group``'s ranks (``--ep``); ``stats_group`` is where its load-balancing
  statistics are averaged.
- ``FlopsModel.flops_per_token()``: the model's training FLOPs per token, for MFU.
- ``ConfiguredModel.cfg``: meshrun's GPT's config (``vocab``, ``d_model``), read where a model
  has no Hugging Face config.
- ``FusedBlock``: a transformer block whose attention is one ``qkv`` projection and ``proj``,
  and whose MLP is ``up`` and ``down`` (meshrun's GPT): tensor parallelism's plan for it, and
  ``attend``, which context parallelism replaces; ``fused_mlp``, which float8 turns off.
- ``PositionedModel.positions``: the token positions a context-parallel rank holds.
- ``CheckpointingEngine``: a model that saves and loads its own snapshots (a DeepSpeed
  engine), inside meshrun's commit protocol.
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


@runtime_checkable
class FlopsModel(Protocol):
    def flops_per_token(self) -> float: ...


@runtime_checkable
class ConfiguredModel(Protocol):
    cfg: Any


@runtime_checkable
class FusedBlock(Protocol):
    qkv: torch.nn.Module
    proj: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    n_heads: int
    fused_mlp: bool
    attend: Any  # (q, k, v) -> the attention's output; replaceable per block


@runtime_checkable
class PositionedModel(Protocol):
    positions: torch.Tensor | None


@runtime_checkable
class CheckpointingEngine(Protocol):
    def save_checkpoint(self, save_dir: str, *args: Any, **kwargs: Any) -> Any: ...

    def load_checkpoint(self, load_dir: str, *args: Any, **kwargs: Any) -> Any: ...
