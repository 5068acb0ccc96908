"""Staging for asynchronous snapshots: the state's tensors copied into CPU buffers that are
allocated at the first save (pinned on CUDA hosts) and reused by every later one.

Why not DCP's own staging: ``dcp.async_save`` (torch <= 2.8's default, and 2.9+'s without
a stager) allocates fresh pageable memory for every save, which costs seconds per rank for
a GPT 1.3B snapshot; torch 2.9+'s ``DefaultStager`` with pinned memory fails on FSDP2 state
dicts in its deep copy (docs/decisions.md#staging). The buffers here are
built and filled by the helpers DCP's own stagers use (``_create_cpu_state_dict``,
``_copy_state_dict``, present from torch 2.4 on): DTensors keep their mesh and placements,
with CPU local tensors, so DCP plans the write exactly as for the live state.

Reuse is safe because a rank has one snapshot in flight at most: the trainer commits the
previous one (joining its writer) before staging the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..loaded import local_tensor


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def signature(state: Any) -> list[tuple]:
    """Where every tensor sits and what it holds: buffers are reused only for the same one."""
    return [(path, type(v).__name__, tuple(local_tensor(v).shape), local_tensor(v).dtype)
            for path, v in _leaves(state) if isinstance(v, torch.Tensor)]


def _on_cpu(obj: Any) -> Any:
    """Any tensor the helpers left on its device (they return 0-dim DTensors as they are)
    copied to the CPU: the background writer must not read memory training changes."""
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_on_cpu(v) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, torch.Tensor) and local_tensor(obj).device.type != "cpu":
        return obj.to("cpu")
    return obj


class Stager:
    """One per process: ``stage(state)`` returns a copy of ``state`` whose tensors live in
    this stager's CPU buffers, complete when it returns."""

    def __init__(self) -> None:
        self._buffers: Any = None
        self._signature: list[tuple] | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        cuda = any(local_tensor(v).is_cuda for _, v in _leaves(state) if isinstance(v, torch.Tensor))
        sig = signature(state)
        if self._buffers is None or sig != self._signature:  # first save, or the state changed shape
            self._buffers = None  # free the old buffers before allocating new ones
            self._buffers = _create_cpu_state_dict(state, pin_memory=cuda)
            self._signature = sig
        staged = _copy_state_dict(state, self._buffers, non_blocking=cuda, type_check=False)
        if cuda:
            torch.cuda.synchronize()  # the copies are complete before training changes a weight
        return _on_cpu(staged)
