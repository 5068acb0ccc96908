"""DistributedDataParallel: the bucket size, bf16 reduction, the first buckets' release, and
DDP without an import of torch.compile's tracer where nothing compiles."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import bad_value
from ..loaded import compiler_loaded
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


# What torch._dynamo.utils.get_optimize_ddp_mode() answers while torch._dynamo's config is as
# imported (optimize_ddp=True, torch 2.7-2.15); tests/test_rank_imports.py asks torch.
DEFAULT_OPTIMIZE_DDP_MODE = "ddp_optimizer"


class _UnloadedDynamoUtils:
    """``torch._dynamo.utils`` as DDP's constructor reads it before torch._dynamo is loaded:
    its optimisation mode is the default (nothing can have changed the config without importing
    it); any other name imports the real module."""

    @staticmethod
    def get_optimize_ddp_mode() -> str:
        return DEFAULT_OPTIMIZE_DDP_MODE

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)


class _UnloadedDynamo:
    utils = _UnloadedDynamoUtils()

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo"), name)


class _TorchBeforeDynamo:
    """``torch`` for DDP's constructor alone: every name torch's own but ``_dynamo``."""

    def __getattr__(self, name: str) -> Any:
        return _UnloadedDynamo() if name == "_dynamo" else getattr(torch, name)


def _constructor_without_compiler() -> Callable[..., None] | None:
    """DDP's ``__init__`` run with the globals of its module but ``torch``, which is
    `_TorchBeforeDynamo`: the one function, for this one call, sees the stand-in; torch's
    namespace and every function the constructor calls are untouched. None where ``__init__``
    is not a plain function reading the module's ``torch``."""
    init = DDP.__init__
    code = getattr(init, "__code__", None)
    if code is None or init.__globals__.get("torch") is not torch or "torch" not in code.co_names:
        return None
    scope = dict(init.__globals__)
    scope["torch"] = _TorchBeforeDynamo()
    view = types.FunctionType(code, scope, init.__name__, init.__defaults__, init.__closure__)
    view.__kwdefaults__ = init.__kwdefaults__
    return view


_INIT = _constructor_without_compiler()
# DDP's forward runs inside this context manager, kept out of compiled graphs by a
# torch._disable_dynamo wrapper that imports torch._dynamo on the first forward
_INSIDE = getattr(DDP, "_inside_ddp_forward", None)
_PLAIN_INSIDE = contextlib.contextmanager(inspect.unwrap(_INSIDE)) if _INSIDE is not None else None


class EagerDDP(DDP):
    """torch's DDP, less its import of torch.compile's tracer (torch._dynamo): for a run that
    compiles nothing. The constructor reads one setting of torch._dynamo's config, and the
    forward enters a context manager wrapped to stay out of compiled graphs; both import
    torch._dynamo, 1.9 s of CPU in each rank, as much as importing torch (CPU box, 2 cores,
    torch 2.13). Before torch._dynamo is loaded its config is the default and nothing runs
    compiled: the setting has its default value, and the wrapped and the plain context manager
    do the same. Once torch._dynamo is loaded the forward is torch's own again
    (docs/decisions.md#no-compiler-import)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        (_INIT or DDP.__init__)(self, *args, **kwargs)

    @contextlib.contextmanager
    def _inside_ddp_forward(self) -> Iterator[None]:
        if compiler_loaded() or _PLAIN_INSIDE is None:
            with super()._inside_ddp_forward():
                yield
        else:
            with _PLAIN_INSIDE(self):
                yield


def ddp_class(compiled: bool) -> type[DDP]:
    """EagerDDP for a run that compiles nothing (while torch._dynamo is not loaded and this torch's
    constructor can be run that way), else torch's own."""
    return DDP if compiled or compiler_loaded() or _INIT is None else EagerDDP


def apply_ddp(model: nn.Module, rt: Runtime, bucket_mb: int, bf16_reduce: bool = False,
              compiled: bool = False) -> DDP:
    """``bf16_reduce`` all-reduces gradients in bf16 (half the bytes; the sum of N bf16 values
    loses precision, so it is opt-in). ``compiled``: the wrapped model is compiled next."""
    if bf16_reduce and not rt.cuda:
        raise bad_value("--reduce-precision", "bf16", "DDP's bf16 reduction needs NCCL (GPUs)", "use fp32 on CPU")
    ddp = ddp_class(compiled)(model, device_ids=[rt.local_rank] if rt.cuda else None, gradient_as_bucket_view=True,
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
