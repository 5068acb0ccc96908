"""Plain parameters that hold only this rank's part of a larger tensor (the experts under
expert parallelism), wrapped as DTensors of the whole for torch.distributed.checkpoint, so
that every rank's part is saved and can be resharded on load."""

from __future__ import annotations

from typing import Any

import torch


def shards_as_dtensors(sd: dict[str, Any], local_shards: Any) -> dict[str, Any]:
    """The model and optimizer entries of per-rank parts, wrapped (no copy) as DTensors of
    their global tensor, so DCP saves every rank's part and can reshard them on load."""
    if local_shards is None:
        return sd
    from torch.distributed.tensor import DTensor

    def wrap(fqn: str, t: Any, param_shape: Any) -> Any:
        spec = local_shards(fqn)
        if spec is None or not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.shape != param_shape:
            return t  # not a part, or a scalar optimizer entry (Adam's step)
        mesh, placements = spec
        d = DTensor.from_local(t, mesh, placements, run_check=False)
        d._meshrun_part = True  # type: ignore[attr-defined]  # ours to unwrap after a load
        return d

    shapes = {k: getattr(v, "shape", None) for k, v in sd["model"].items()}
    model_sd = {k: wrap(k, v, shapes[k]) for k, v in sd["model"].items()}
    optim = dict(sd["optim"])
    optim["state"] = {k: {n: wrap(k, v, shapes.get(k)) for n, v in st.items()} for k, st in optim["state"].items()}
    return {**sd, "model": model_sd, "optim": optim}


def shards_as_local(sd: dict[str, Any]) -> dict[str, Any]:
    """Undo ``shards_as_dtensors`` after a load: the parts, now holding the snapshot's values."""
    def unwrap(v: Any) -> Any:
        return v.to_local() if getattr(v, "_meshrun_part", False) else v

    optim = dict(sd["optim"])
    optim["state"] = {k: {n: unwrap(v) for n, v in st.items()} for k, st in optim["state"].items()}
    return {**sd, "model": {k: unwrap(v) for k, v in sd["model"].items()}, "optim": optim}


def float8_unwrapped(sd: dict[str, Any]) -> dict[str, Any]:
    """The model and optimizer entries with torchao's float8 weight wrappers replaced by the
    tensors inside them (no copy: the same storage). FSDP2's float8 all-gather keeps each
    converted weight as such a wrapper (``WeightWithDynamicFloat8CastTensor``), and so is
    optimizer state made like it (``zeros_like``, as torch.distributed.checkpoint's
    get_state_dict does before a load); torch.distributed.checkpoint's file writer cannot write
    them (docs/decisions.md#float8). The tensors inside are the plain values, saved and loaded
    as a bf16 model's: a snapshot moves between float8 and bf16 runs."""
    from torch.distributed.tensor import DTensor

    def inner(v: Any) -> Any:
        local = v._local_tensor if isinstance(v, DTensor) else v
        data = getattr(local, "_tensor", None)
        if not isinstance(data, torch.Tensor) or type(local) in (torch.Tensor, torch.nn.Parameter):
            return v
        if isinstance(v, DTensor):
            return DTensor.from_local(data, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                      stride=v.stride())
        return data

    optim = dict(sd["optim"])
    optim["state"] = {k: {n: inner(v) for n, v in st.items()} for k, st in optim.get("state", {}).items()}
    return {**sd, "model": {k: inner(v) for k, v in sd["model"].items()}, "optim": optim}
