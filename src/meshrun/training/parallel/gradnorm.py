"""Gradient clipping when parameters live on different device meshes.

Under tensor parallelism the sharded layers' parameters are DTensors of the 2-D (dp, tp)
mesh while norms and embeddings are DTensors of the data-parallel mesh only (or plain
tensors); torch's clip_grad_norm_ stacks all per-tensor norms and refuses mixed meshes.
Here the norm is taken per mesh (each a partial norm reduced over its mesh by
``full_tensor``), the groups combined as the root of their sums of squares, and every
gradient scaled by the same coefficient.

That is one all-reduce per mesh: over the 2-D mesh DTensor sums over both dimensions at once,
on the flattened (dp_shard, tp) mesh the layout makes for it (parallel/dims.py). The two
meshes keep one each: the data-parallel-only gradients' squares are summed over their shard
ranks alone, the tensor-parallel ones' over the TP ranks too. One sum over (dp_shard, tp)
could serve both only with the former divided by tp, counting on every TP rank to hold the
same copy of them, which their 1-D mesh does not record."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _mesh_key(t: torch.Tensor) -> object:
    mesh = getattr(t, "device_mesh", None)
    return None if mesh is None else (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist()))


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, across: object = None,
                   uncounted: tuple[torch.nn.Parameter, ...] = ()) -> torch.Tensor:
    """Total 2-norm of the gradients (a plain tensor); scaled to ``max_norm`` when above it
    (``max_norm`` inf: measure only). ``across``: a process group holding the other parts
    of the model (pipeline stages), whose squared norms are summed in; ``uncounted``: copies
    of a parameter counted elsewhere (the tied head on the last stage), scaled but not counted."""
    import torch.distributed as dist

    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    skip = {id(p) for p in uncounted}
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if id(p) not in skip:
            groups.setdefault(_mesh_key(p.grad), []).append(p.grad)
    if len(groups) <= 1 and across is None and not skip:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # one mesh (or none): torch's own path
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    squares = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, 2.0)
        n = n.full_tensor() if hasattr(n, "full_tensor") else n
        squares.append(n.float() ** 2)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if across is not None:
        dist.all_reduce(total, group=across)
    return _scale(grads, total.sqrt(), max_norm)


def _scale(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient so the total norm is at most ``max_norm`` (inf: leave them).
    The coefficient stays on the device (1 when below the threshold), as in torch's own
    clipping: no step waits for the GPU to learn it."""
    if max_norm != float("inf") and grads:
        from torch.distributed.tensor.experimental import implicit_replication

        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        with implicit_replication():  # the plain coefficient beside DTensor gradients
            for g in grads:
                g.mul_(coef.to(g.device))
    return total


def clip_grad_norm_sharded(params: Iterable[tuple[str, torch.nn.Parameter]], is_sharded, group: object,
                           max_norm: float) -> torch.Tensor:
    """The norm when some parameters are split over ``group`` (each rank holds different
    ones: experts under expert parallelism) and the rest are replicated: squares of the split
    part summed over the group, the replicated part counted once."""
    import torch.distributed as dist

    named = [(n, p) for n, p in params if p.grad is not None]
    split = [p.grad for n, p in named if is_sharded(n)]
    same = [p.grad for n, p in named if not is_sharded(n)]
    zero = torch.zeros((), device=named[0][1].device if named else "cpu")
    s2 = torch.nn.utils.get_total_norm(split, 2.0).float() ** 2 if split else zero
    dist.all_reduce(s2, group=group)
    r2 = torch.nn.utils.get_total_norm(same, 2.0).float() ** 2 if same else zero
    if hasattr(r2, "full_tensor"):  # FSDP2's shards of the replicated part (--ep with --strategy fsdp)
        r2 = r2.full_tensor()
    return _scale(split + same, (s2 + r2).sqrt(), max_norm)
