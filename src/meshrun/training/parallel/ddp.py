"""DistributedDataParallel: the bucket size, bf16 reduction, and the first buckets' release."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import bad_value
from ..runtime import Runtime

# Eager or across hosts. 100 MB is faster than torch's 25 MB (docs/decisions.md#ddp-buckets)
DDP_BUCKET_MB = 100
DDP_COMPILED_BUCKET_MB = 1000


def ddp_bucket_mb(requested: int | None, compiled: bool, rt: Runtime) -> int:
    """DDP's gradient bucket size: the user's; else 1000 MB when the model is compiled and every
    rank is on one host; else 100 MB.

    Why: compiled, Dynamo cuts DDP's graph at every bucket boundary so that a bucket's
    all-reduce starts while the backward goes on; Inductor then cannot fuse across the cuts.
    On one host the all-reduce of what the larger buckets leave exposed costs less than the
    cuts, in every measurement at GPT 124M and 1.3B (docs/decisions.md#ddp-buckets). Across
    hosts the network is 10-100x slower than NVLink and the overlap is worth more than the
    fusion, and eager DDP has no graph to cut. Capped at
    1000 MB, the size measured: DDP allocates its buckets again at the second step, so a
    bucket is also a transient allocation."""
    if requested is not None:
        return requested
    if compiled and rt.local_world_size == rt.world_size:
        return DDP_COMPILED_BUCKET_MB
    return DDP_BUCKET_MB


def apply_ddp(model: nn.Module, rt: Runtime, bucket_mb: int, bf16_reduce: bool = False) -> DDP:
    """``bf16_reduce`` all-reduces gradients in bf16 (half the bytes; the sum of N bf16 values
    loses precision, so it is opt-in)."""
    if bf16_reduce and not rt.cuda:
        raise bad_value("--reduce-precision", "bf16", "DDP's bf16 reduction needs NCCL (GPUs)", "use fp32 on CPU")
    ddp = DDP(model, device_ids=[rt.local_rank] if rt.cuda else None, gradient_as_bucket_view=True,
              bucket_cap_mb=bucket_mb)
    if bf16_reduce:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    if rt.cuda:
        release_old_buckets(ddp)
    return ddp


def release_old_buckets(ddp: DDP) -> None:
    """DDP allocates its gradient buckets again once, at the second forward, in the order the
    gradients became ready, and frees the first ones: segments the size of one bucket
    (100 MB), which the caching allocator keeps but cannot hand to any larger activation.
    Once, right after that rebuild and before the forward's activations, the free segments go
    back to the driver, and the reserved peak is lower by them
    (docs/decisions.md#old-ddp-buckets)."""
    def after_rebuild(module: nn.Module, args: Any) -> None:
        if getattr(ddp, "_has_rebuilt_buckets", True):
            torch.cuda.empty_cache()
            ddp.released_old_buckets = True
            handle.remove()

    ddp.released_old_buckets = False
    handle = ddp.module.register_forward_pre_hook(after_rebuild)
