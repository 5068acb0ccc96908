"""The process groups a layout makes, apart from the Trainer's loop: context parallel's
(dp_shard, cp) mesh, tensor and pipeline parallel's (pp, dp_shard, tp) mesh, expert
parallel's (edp, ep) groups, and the DeepSpeed engine. Each returns what the Trainer keeps;
none trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ..errors import MeshrunError
from .config import TrainConfig
from .optim import build_optimizer
from .parallelize import apply_activation_checkpointing
from .runtime import Runtime


@dataclass
class Layout:
    """Who reads which data under a layout, and its groups."""
    strategy: str
    reason: str
    dp_rank: int  # this rank's place among the data-parallel ranks (which data it reads)
    dp_size: int
    mesh: Any = None  # (pp, dp_shard, tp) under tensor or pipeline parallelism
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    fsdp_mesh: Any = None  # under context parallelism: FSDP2 over all ranks


def same_initial_weights(model: nn.Module) -> None:
    """Rank 0's initial weights everywhere, before anything is sharded or split."""
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def checkpoint_blocks(blocks: nn.ModuleList | None) -> None:
    if blocks is None:
        raise MeshrunError("--activation-checkpointing: no block list found in the model "
                           "(hint: name it with --blocks, e.g. model.layers)")
    apply_activation_checkpointing(blocks)


def is_expert(name: str) -> bool:
    """An expert's weights (sharded under --ep), not the router's."""
    return ".moe.w_" in name or ".moe.b_" in name


def context_parallel(cfg: TrainConfig, rt: Runtime) -> Layout:
    """A (dp_shard, cp) mesh for the groups; FSDP2 over all ranks (data and context parallel
    alike average their gradients)."""
    from torch.distributed.device_mesh import init_device_mesh

    from .dims import make_dims

    if cfg.strategy in ("ddp", "single"):
        raise MeshrunError(f"--strategy={cfg.strategy!r} with --cp={cfg.cp}: context parallelism composes with "
                           "FSDP2 (hint: --strategy fsdp, or auto)")
    dims = make_dims(rt.world_size, cp=cfg.cp, source=f"--cp {cfg.cp} on {rt.world_size} processes")
    mesh = init_device_mesh(rt.device.type, (dims.dp_shard, cfg.cp), mesh_dim_names=("dp_shard", "cp"))
    return Layout("fsdp", f"context parallel {cfg.cp} (zig-zag shards) x FSDP2 over all {rt.world_size} ranks",
                  mesh["dp_shard"].get_local_rank(), dims.dp_shard, cp_size=cfg.cp,
                  cp_rank=mesh["cp"].get_local_rank(), cp_group=mesh["cp"].get_group(),
                  fsdp_mesh=init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("dp_cp",)))


def tensor_pipeline(cfg: TrainConfig, rt: Runtime) -> Layout:
    """A (pp, dp_shard, tp) mesh, TP innermost (the same node's NVLink neighbours), PP
    outermost. Under TP, FSDP2 runs over the data-parallel dimension even when it is 1, so
    every parameter is a DTensor of one mesh (what clipping and snapshots need); under PP
    alone with one data-parallel rank, the stages are plain modules."""
    from torch.distributed.device_mesh import init_device_mesh

    from .dims import make_dims

    what = " and ".join(f"--{k}={v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp)) if v > 1)
    if cfg.strategy in ("ddp", "single"):
        raise MeshrunError(f"--strategy={cfg.strategy!r} with {what}: tensor and pipeline parallelism compose "
                           "with FSDP2 over the data-parallel ranks (hint: --strategy fsdp, or auto)")
    if cfg.fsdp == "hybrid":
        raise MeshrunError(f"--fsdp='hybrid' with {what}: not supported yet (hint: --fsdp full or grad_op)")
    dims = make_dims(rt.world_size, tp=cfg.tp, pp=cfg.pp, source=f"{what} on {rt.world_size} processes")
    mesh = init_device_mesh(rt.device.type, (dims.pp, dims.dp_shard, dims.tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    sharded = dims.tp > 1 or dims.dp_shard > 1
    parts = [f"tensor parallel {dims.tp}"] if dims.tp > 1 else []
    parts += [f"pipeline {dims.pp} ({cfg.pp_schedule})"] if dims.pp > 1 else []
    parts += [f"FSDP2 over {dims.dp_shard} data-parallel rank(s)"] if sharded else []
    return Layout("fsdp" if sharded else "pipeline", " x ".join(parts), mesh["dp_shard"].get_local_rank(),
                  dims.dp_shard, mesh=mesh)


def expert_groups(model: nn.Module, cfg: TrainConfig, rt: Runtime) -> Any:
    """Experts sharded over ep groups of consecutive ranks (rank 0's initial weights first):
    the (edp, ep) mesh; edp holds the ranks with the same experts."""
    from torch.distributed.device_mesh import init_device_mesh

    moes = [m for m in model.modules() if hasattr(m, "shard_experts")]
    if not moes:
        raise MeshrunError(f"--ep={cfg.ep}: the model has no experts (hint: --experts E with meshrun's GPT)")
    if rt.world_size % cfg.ep:
        raise MeshrunError(f"--ep={cfg.ep}: does not divide the {rt.world_size} processes (hint: a divisor)")
    same_initial_weights(model)
    mesh = init_device_mesh(rt.device.type, (rt.world_size // cfg.ep, cfg.ep), mesh_dim_names=("edp", "ep"))
    for m in moes:
        m.shard_experts(mesh["ep"].get_group())
    return mesh


def deepspeed_engine(model: nn.Module, cfg: TrainConfig, rt: Runtime, dp_size: int, accum: int,
                     bf16: bool) -> tuple[Any, Any, str]:
    """DeepSpeed ZeRO as a strategy: the planner's ZeRO block, meshrun's AdamW (param groups
    as elsewhere), DeepSpeed's own accumulation and clipping. Returns the engine, the AdamW it
    wraps (the schedule drives its param groups, which DeepSpeed's optimizer shares) and the
    layout's description."""
    import deepspeed

    from ..plan.configs import zero_section

    hidden = getattr(getattr(model, "cfg", None), "d_model", 1024)
    ds = {
        "train_batch_size": cfg.micro * accum * dp_size,
        "train_micro_batch_size_per_gpu": cfg.micro,
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero_section(cfg.zero, hidden, cfg.offload != "none", cfg.offload == "all"),
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 10**9,
        # meshrun's AdamW also when the optimizer is offloaded (DeepSpeed's CPU Adam needs
        # a compiled extension; torch's runs everywhere, more slowly)
        "zero_force_ds_cpu_optimizer": False,
    }
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, fused=rt.cuda)  # DeepSpeed: as it was measured
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, dist_init_required=False)
    reason = f"DeepSpeed ZeRO-{cfg.zero}" + (f", {cfg.offload} offloaded" if cfg.offload != "none" else "")
    return engine, optimizer, reason
