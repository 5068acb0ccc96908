"""Pipeline parallelism for meshrun's GPT with torch.distributed.pipelining.

The block list is cut into stages (``--pp`` ranks, two stages per rank for the interleaved
schedule); a stage keeps its blocks under their original indices (``blocks.7``), the first
stage the embeddings, the last the final norm and head, so a pipeline snapshot's names are
the unsplit model's and DCP loads it under any layout. The tied embedding / head weight
lives on the first and the last stage: their gradients are summed between the two after
every backward, as Megatron does, so both copies take the same steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...errors import MeshrunError

class GPTStage(nn.Module):
    def __init__(self, gpt: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.tok = gpt.tok if first else None
        self.pos = gpt.pos if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


class StageUnion(nn.Module):
    """This rank's stages as one module for the optimizer, the gradient norm and snapshots:
    its parameter names are the unsplit model's."""

    def __init__(self, stages: list[GPTStage]) -> None:
        super().__init__()
        for name in ("tok", "pos", "ln_f", "head"):
            mod = next((getattr(s, name) for s in stages if getattr(s, name) is not None), None)
            if mod is not None:
                setattr(self, name, mod)
        self.blocks = nn.ModuleDict({k: v for s in stages for k, v in s.blocks.items()})


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    if n_layers < n_stages:
        raise MeshrunError(f"--pp: the model has {n_layers} blocks, fewer than the {n_stages} pipeline stages "
                           "(hint: a smaller --pp, or the 1f1b schedule: interleaved uses two stages per rank)")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class Pipeline:
    """Stages, schedule and the groups a pipeline rank needs."""

    def __init__(self, gpt: nn.Module, mesh: Any, schedule: str, n_microbatches: int, accum: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        if not all(hasattr(gpt, a) for a in ("tok", "pos", "blocks", "ln_f", "head")):
            raise MeshrunError("--pp: pipeline stages are built for meshrun's GPT only so far "
                               "(hint: use --tp or FSDP for other models)")
        tied = gpt.tok.weight is gpt.head.weight
        pp_mesh = mesh["pp"]
        pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
        per_rank = 2 if schedule == "interleaved" else 1
        n_stages = pp * per_rank
        ids = [rank + k * pp for k in range(per_rank)]  # loop placement: stage s on rank s % pp
        cuts = split_layers(len(gpt.blocks), n_stages)
        self.stages = [GPTStage(gpt, cuts[s], s == 0, s == n_stages - 1) for s in ids]
        self.first = 0 in ids
        self.last = n_stages - 1 in ids
        self.union = StageUnion(self.stages)
        self.group = pp_mesh.get_group()
        self.n_micro = n_microbatches
        self.accum = accum
        self._pipe_stages = [PipelineStage(st, s, n_stages, device, group=self.group) for st, s in zip(self.stages, ids)]
        self._make = (lambda: ScheduleInterleaved1F1B(self._pipe_stages, n_microbatches, loss_fn=self._loss,
                                                      scale_grads=False)) if schedule == "interleaved" else (
            lambda: {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](
                self._pipe_stages[0], n_microbatches, loss_fn=self._loss, scale_grads=False))
        self.schedule = self._make()
        self.tied_group = self._tied_group(mesh) if tied else None

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each micro-batch's mean, scaled so that the gradients summed over the pipeline's
        # micro-batches and the step's accumulation equal those of the whole batch's mean.
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
        return ce / (self.n_micro * self.accum)

    @staticmethod
    def _tied_group(mesh: Any) -> Any:
        """The group of this pipeline's first and last stage ranks. Every rank creates every
        pipeline's group, in the same order, as new_group requires."""
        names = list(mesh.mesh_dim_names)
        grid = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, mesh.size(names.index("pp")))
        mine = None
        for ranks in grid.tolist():
            g = dist.new_group([ranks[0], ranks[-1]])
            if dist.get_rank() in (ranks[0], ranks[-1]):
                mine = g
        return mine

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-step of the trainer: the schedule splits it into n_microbatches."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach() for loss in losses]).sum()  # = the micro-step's mean / accum

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.eval(*args, **kwargs)
        if not losses:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() * self.accum

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding/head gradient over the first and the last stage."""
        if self.tied_group is None or not (self.first or self.last):
            return
        w = self.union.tok.weight if self.first else self.union.head.weight
        if w.grad is None:
            return
        g = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
        dist.all_reduce(g, group=self.tied_group)
