"""AdamW (fused on CUDA) with decoupled weight decay on matrices only, and warmup + cosine."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn as nn

from .loaded import compiler_loaded

BETAS, EPS = (0.9, 0.95), 1e-8


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two groups: weights of 2-D+ tensors (matmuls, embeddings)
    decayed, biases and norm gains not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, fused: bool = True,
                    torchs: bool = False) -> torch.optim.AdamW:
    """AdamW over ``decay_groups``.
    ``torchs``: torch's own AdamW class, for DeepSpeed, whose ZeRO takes the optimizers it
    lists by their exact type (it refuses a subclass as "an untested ZeRO Optimizer").

    Fused (CUDA and CPU): one kernel for the whole update instead of several per tensor, and
    the only implementation that takes ``found_inf``, the device-side flag that skips a step
    whose gradients are not finite without the host waiting for the GPU (Trainer)."""
    groups = decay_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]
    # The fused kernel takes all tensors of a device and dtype in one call, and DTensor refuses
    # plain tensors beside its own there (expert parallel's experts beside FSDP2's shards).
    mixed = len({hasattr(p, "device_mesh") for p in params}) > 1
    fused = fused and not mixed
    cls = torch.optim.AdamW if torchs else _PerMeshAdamW if fused and not _fused_takes_meshes(params) else AdamW
    return cls(groups, lr=lr, betas=BETAS, eps=EPS, fused=fused)


def _fused_takes_meshes(params: list[nn.Parameter]) -> bool:
    """Whether the fused AdamW steps DTensors of different meshes in one call, as under tensor
    parallelism with FSDP2 (the TP layers' (dp, tp) mesh beside the norms' dp mesh): torch 2.7's
    DTensor refuses them ("Could not run pointwise computation across different mesh"), newer
    releases (2.13, 2.15) take them. Asked with a one-element replicated DTensor on each mesh (no communication)."""
    meshes = {p.device_mesh: p.device for p in params if hasattr(p, "device_mesh")}
    if len(meshes) < 2:
        return True
    from torch.distributed.tensor import DTensor, Replicate

    probes = [nn.Parameter(DTensor.from_local(torch.zeros(1, device=device), mesh, [Replicate()] * mesh.ndim,
                                              run_check=False)) for mesh, device in meshes.items()]
    for p in probes:
        p.grad = torch.zeros_like(p)
    try:
        torch.optim.AdamW(probes, lr=0.0, fused=True).step()
    except ValueError:
        return False
    return True


# torch's functions inside its torch._disable_dynamo wrappers (and AdamW.step's graph breaks)
_PLAIN = {name: inspect.unwrap(getattr(torch.optim.Optimizer, name))
          for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")}
_STEP = inspect.unwrap(torch.optim.AdamW.step)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, less its import of torch.compile's tracer while nothing can compile.

    torch keeps its optimizers out of compiled graphs with wrappers that import torch._dynamo
    when first called (``add_param_group``, ``zero_grad``, ``state_dict``, ``load_state_dict``;
    ``step`` on every call, for two graph breaks). That import costs as much CPU as importing
    torch itself, paid by every run that does not compile, before its first step: without
    torch._dynamo loaded nothing is being compiled, and the wrapped functions do the same
    unwrapped. Once it is loaded (``--compile``, FSDP2, tensor parallelism), these are torch's own
    methods again (docs/decisions.md#no-compiler-import)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if compiler_loaded():
            super().add_param_group(param_group)
        else:
            _PLAIN["add_param_group"](self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if compiler_loaded():
            super().zero_grad(set_to_none)
        else:
            _PLAIN["zero_grad"](self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if compiler_loaded():
            return super().state_dict()
        return _PLAIN["state_dict"](self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if compiler_loaded():
            super().load_state_dict(state_dict)
        else:
            _PLAIN["load_state_dict"](self, state_dict)

    def step(self, closure: Any = None) -> Any:
        if compiler_loaded():
            return super().step(closure)
        # what torch's wrapper does around the step, less its graph breaks
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _STEP(self, closure)


class _PerMeshAdamW(AdamW):
    """AdamW whose step runs the fused kernel once per device mesh of each group (the groups
    themselves stay as built: the state dict and snapshots are those of the plain AdamW), for
    a torch whose fused AdamW refuses DTensors of different meshes in one call (torch 2.7)."""

    def step(self, closure: Any = None) -> Any:
        groups = self.param_groups
        split: list[dict[str, Any]] = []
        for group in groups:
            by_mesh: dict[object, list[nn.Parameter]] = {}
            for p in group["params"]:
                by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
            split.extend({**group, "params": params} for params in by_mesh.values())
        self.param_groups = split
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


Schedule = tuple[tuple[int, int], ...]  # (from step, to step) pieces; the first is (0, --steps)


def lr_factor(step: int, warmup: int, schedule: Schedule | int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at the end of
    the first piece of ``schedule`` (an int: one piece, ``(0, total)``). Each later piece
    ``(start, end)``, made when a resume changed --steps, decays by a cosine from the factor
    the schedule had reached at ``start`` to ``min_ratio`` at ``end``: the learning rate goes on
    from where it was, never back up (docs/decisions.md#lr-schedule-resume)."""
    pieces = ((0, schedule),) if isinstance(schedule, int) else schedule
    total = pieces[0][1]
    if warmup and step < warmup:
        return (step + 1) / warmup
    factor = _cosine(1.0, min_ratio, step - warmup, total - warmup)
    for i, (start, end) in enumerate(pieces[1:], 1):
        if step < start:
            break
        factor = _cosine(lr_factor(start, warmup, pieces[:i], min_ratio), min_ratio, step - start, end - start)
    return factor


def _cosine(high: float, low: float, done: int, length: int) -> float:
    progress = min(1.0, done / max(1, length))
    return low + (high - low) * 0.5 * (1 + math.cos(math.pi * progress))


def extend_schedule(schedule: Schedule, step: int, steps: int, warmup: int) -> Schedule:
    """The schedule of a run resumed at ``step`` with ``--steps steps``: unchanged when it
    already ends there; else a new piece from ``step`` (within the warmup, the first piece's
    length changes instead: the warmup does not depend on it)."""
    if schedule[-1][1] == steps:
        return schedule
    if step <= warmup and len(schedule) == 1:
        return ((0, steps),)
    return (*schedule, (step, steps))


def build_scheduler(opt: torch.optim.Optimizer, warmup: int, schedule: Schedule | int, min_ratio: float,
                    step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler, placed at ``step`` (a resume's): the learning rate set from the schedule
    directly, not by replaying ``step()``s, which torch warns about before an optimizer step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, schedule, min_ratio))
    if step:
        sched.last_epoch = step
        lrs = []
        for group, base in zip(opt.param_groups, sched.base_lrs):
            lr = base * lr_factor(step, warmup, schedule, min_ratio)
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
            lrs.append(lr)
        sched._last_lr = lrs  # what get_last_lr() returns
    return sched


def create_state(opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's per-parameter state now instead of at the first ``step()``.

    Made lazily, AdamW's moments are long-lived tensors allocated at the end of the first
    step, into blocks the activations freed; the second step's activations then move into
    the loss's freed blocks. With cuBLAS's backward workspace (runtime.take_blas_workspaces)
    that cascade cost GPT 124M FSDP2 without checkpointing one more logits-sized segment
    (docs/decisions.md#optimizer-state). One step with zero gradients and a zero learning
    rate creates the state and changes no parameter (AdamW's decay multiplies by 1 - 0); the
    step counts go back to zero, so the first real step is still step 1."""
    if opt.state:
        return
    lrs = [g["lr"] for g in opt.param_groups]
    zeroed = []
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                zeroed.append(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for st in opt.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"].zero_()
        elif "step" in st:
            st["step"] = 0
    for p in zeroed:
        p.grad = None
