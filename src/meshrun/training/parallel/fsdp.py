"""FSDP2 (``fully_shard``) over a layout's data-parallel mesh, in one of its flavours."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...errors import MeshrunError, bad_value


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
    hook = None
    if not _averages(mesh):
        kwargs["mesh"], hook = _summing_mesh(model, mesh, flavour)
    reshard = flavour != "grad_op"
    sharded: list[Any] = []
    if blocks is not None:
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them.
            sharded.append(fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kwargs))
    sharded.append(fully_shard(model, reshard_after_forward=False, **kwargs))
    if hook is not None:
        for module in sharded:
            module.set_all_reduce_hook(hook)


def _averages(mesh: DeviceMesh) -> bool:
    """Whether a reduce-scatter with ``ReduceOp.AVG``, which FSDP2 reduces gradients with,
    averages over ``mesh`` (True), or sums (False): torch 2.7's gloo sums (and its all-reduce
    refuses AVG, which FSDP2's hybrid sharding averages the replicas with). Asked of the
    backend over the mesh's largest dimension, with 3 ones per rank: any other result (a
    division by the element count) is an error, not something to correct for."""
    import torch.distributed as dist

    group = max((mesh.get_group(d) for d in range(mesh.ndim)), key=dist.get_world_size)
    n = dist.get_world_size(group)
    if n == 1 or dist.get_backend(group) != "gloo":
        return True
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, torch.ones(3 * n), op=dist.ReduceOp.AVG, group=group)
    if bool((out == 1).all()):
        return True
    if bool((out == n).all()):
        return False
    raise MeshrunError(f"gloo's reduce-scatter with ReduceOp.AVG over {n} ranks gave {out.tolist()} for ones, "
                       f"neither their average nor their sum (torch {torch.__version__}): FSDP2 cannot average "
                       "gradients with it (hint: --strategy ddp, or another torch)")


def _summing_mesh(model: nn.Module, mesh: DeviceMesh, flavour: str) -> tuple[DeviceMesh, Any]:
    """Where the backend sums for ``ReduceOp.AVG`` (torch 2.7's gloo): the mesh to shard over and
    an FSDP2 all-reduce hook that makes each reduced gradient shard the average. One dimension:
    the shard mesh, the hook divides the sum. Two (hybrid, no_shard): FSDP2 shards over the
    second dimension alone and the hook sums the replicas over the first, then divides, as
    FSDP2's own all-reduce would."""
    import torch.distributed as dist

    n = mesh.size()
    if mesh.ndim == 1:
        return mesh, lambda grad: grad.div_(n)
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        raise bad_value("--strategy", f"fsdp-{flavour.replace('_', '-')}",
                        "with --tp on gloo needs a torch whose gloo averages gradients "
                        f"(torch {torch.__version__}'s sums them)", "--strategy fsdp-full, or a newer torch")
    replicas = mesh.get_group(0)
    names = mesh.mesh_dim_names
    shard = DeviceMesh.from_group(mesh.get_group(1), mesh.device_type,
                                  mesh_dim_names=None if names is None else (names[1],))

    def average(grad: torch.Tensor) -> None:
        dist.all_reduce(grad, group=replicas)
        grad.div_(n)

    return shard, average
