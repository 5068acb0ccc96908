"""FSDP2 (``fully_shard``) over a layout's data-parallel mesh, in one of its flavours."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...errors import bad_value


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList | None, mesh: DeviceMesh, flavour: str,
               bf16: bool, bf16_reduce: bool = False, ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2: ``fully_shard`` each block, then the root (embeddings, final norm, head).

    full     params, grads and optimizer state sharded; params resharded after forward (ZeRO-3)
    grad_op  params stay unsharded between forward and backward (ZeRO-2 equivalent)
    hybrid   a 2-D mesh: replicate across groups (nodes), shard within (HSDP)
    no_shard a (world, 1) mesh: every rank holds everything (DDP equivalent, for comparison)

    ``ignored``: parameters left unsharded and unreduced (the caller reduces their gradients).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reduce = torch.bfloat16 if bf16_reduce else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    if ignored:  # parameters FSDP must leave alone (each rank's own experts under --ep)
        import inspect

        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise bad_value("--ep", "with --strategy fsdp", f"needs torch >= 2.7 (this is {torch.__version__})",
                            "--strategy ddp, or a newer torch")
        kwargs["ignored_params"] = ignored
    reshard = flavour != "grad_op"
    if blocks is not None:
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them.
            fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
