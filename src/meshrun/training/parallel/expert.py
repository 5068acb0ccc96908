"""Expert parallelism: the experts of meshrun's mixture-of-experts GPT shared out over ep
consecutive ranks; the rest replicated (DDP-style) or sharded by FSDP2. Tokens travel to their
experts' rank and back by all-to-all (models/moe.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import MeshrunError
from ..models.hooks import ExpertModule


def is_expert(name: str) -> bool:
    """An expert's weights (shared out under --ep), not the router's."""
    return ".moe.w_" in name or ".moe.b_" in name


def shard_experts(model: nn.Module, ep_group: Any, ep: int) -> None:
    """Keep this rank's E/ep experts of every mixture-of-experts block."""
    moes = [m for m in model.modules() if isinstance(m, ExpertModule)]
    if not moes:
        raise MeshrunError(f"--ep={ep}: the model has no experts (hint: --experts E with meshrun's GPT)")
    for m in moes:
        m.shard_experts(ep_group)


def sync_expert_grads(model: nn.Module, edp_group: Any, world: int) -> None:
    """Sum over the ranks that hold each parameter, divide by the world: the gradient of the
    mean loss over all ranks' tokens (an expert's rank already summed the gradients of every
    token routed to it). FSDP2's parameters (--ep with an FSDP2 strategy) are averaged already."""
    for name, p in model.named_parameters():
        if hasattr(p, "device_mesh"):
            continue
        if p.grad is None:  # an expert no token reached here: its peers still reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=edp_group if is_expert(name) else None)
        p.grad.div_(world)


def expert_shards(mesh: Any) -> Callable[[str], Any]:
    """For snapshots: each rank holds E/ep experts of every expert tensor, the same part as its
    edp peers: (Replicate over edp, Shard(0) over ep) of the whole."""
    from torch.distributed.tensor import Replicate, Shard

    return lambda fqn: (mesh, [Replicate(), Shard(0)]) if is_expert(fqn) else None
