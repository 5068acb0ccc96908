"""Pipeline parallelism with torch.distributed.pipelining, for meshrun's GPT and the Llama
family of Hugging Face causal LMs.

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
from ...vocab import LLAMA_LIKE
from ..models.hf import check_whole_prefix, is_transformers_model, model_type


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``path`` under ``root``, with empty containers on the way,
    so that its parameters keep the unsplit model's names."""
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(name, module)


class Stage(nn.Module):
    """Some consecutive blocks of a model, under their unsplit names (``BLOCKS.<index>``),
    with the modules before the blocks on the first stage, those after them on the last, and
    the parameter-free ``SHARED`` ones on every stage."""

    FIRST: tuple[str, ...] = ()
    BLOCKS = ""
    LAST: tuple[str, ...] = ()
    SHARED: tuple[str, ...] = ()
    EMBEDDING = ""  # the input embedding's weight (tied to the head's in some models)
    HEAD = ""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = first, last
        for path in (self.FIRST if first else ()) + self.SHARED:
            _place(self, path, model.get_submodule(path))
        blocks = model.get_submodule(self.BLOCKS)
        _place(self, self.BLOCKS, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        for path in self.LAST if last else ():
            _place(self, path, model.get_submodule(path))

    @classmethod
    def fits(cls, model: nn.Module) -> bool:
        try:
            for path in cls.FIRST + (cls.BLOCKS,) + cls.LAST + cls.SHARED:
                model.get_submodule(path)
        except AttributeError:
            return False
        return True

    def stage_blocks(self) -> list[nn.Module]:
        return list(self.get_submodule(self.BLOCKS).values())  # type: ignore[operator]


class GPTStage(Stage):
    FIRST, BLOCKS, LAST = ("tok", "pos"), "blocks", ("ln_f", "head")
    EMBEDDING, HEAD = "tok.weight", "head.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.stage_blocks():
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


class LlamaStage(Stage):
    """The Llama family's causal LM (``LLAMA_LIKE``): rotary positions computed on every
    stage from the shared ``rotary_emb``; no mask, so SDPA runs causal over the whole prefix."""

    FIRST, BLOCKS, LAST = ("model.embed_tokens",), "model.layers", ("model.norm", "lm_head")
    SHARED = ("model.rotary_emb",)
    EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model
        h = inner.embed_tokens(x) if self.is_first else x
        positions = torch.arange(h.shape[1], device=h.device)[None]
        rotary = inner.rotary_emb(h, positions)
        for layer in self.stage_blocks():
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            h = self.lm_head(inner.norm(h))
        return h


def stage_kind(model: nn.Module, seq_len: int, flag: str) -> type[Stage]:
    """The stage class that cuts this model, or a one-line refusal."""
    if GPTStage.fits(model) and not is_transformers_model(model):
        return GPTStage
    if is_transformers_model(model):
        kind = model_type(model)
        if kind not in LLAMA_LIKE or not LlamaStage.fits(model):
            raise MeshrunError(f"{flag}: pipeline stages are built for meshrun's GPT and the "
                               f"{'/'.join(sorted(LLAMA_LIKE))} families, not {kind} "
                               "(hint: --tp or an FSDP2 strategy for this model)")
        if model.config._attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):  # type: ignore[attr-defined]
            raise MeshrunError(f"{flag}: pipeline stages run the model's layers without a mask, which its "
                               f"{model.config._attn_implementation!r} attention does not read as causal "  # type: ignore[attr-defined]
                               "(hint: attn_implementation 'sdpa' in config.json)")
        check_whole_prefix(model, seq_len, flag)
        return LlamaStage
    raise MeshrunError(f"{flag}: pipeline stages are built for meshrun's GPT and Hugging Face models of the "
                       f"{'/'.join(sorted(LLAMA_LIKE))} families, not {type(model).__name__} "
                       "(hint: --tp or an FSDP2 strategy for this model)")


class StageUnion(nn.Module):
    """This rank's stages as one module for the optimizer, the gradient norm, snapshots and
    filling a model built on the meta device: its parameter names are the unsplit model's."""

    def __init__(self, stages: list[Stage]) -> None:
        super().__init__()
        kind = type(stages[0])
        placed = set()
        for stage in stages:
            for path in (kind.FIRST if stage.is_first else ()) + kind.SHARED + (kind.LAST if stage.is_last else ()):
                if path not in placed:
                    _place(self, path, stage.get_submodule(path))
                    placed.add(path)
        _place(self, kind.BLOCKS, nn.ModuleDict({k: v for s in stages
                                                 for k, v in s.get_submodule(kind.BLOCKS).items()}))


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


class _EveryWork:
    """The Works of one batch of sends and receives, as one handle: ``wait`` waits for each."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _batch_p2p_every_work(p2p_ops: list[Any], desc: str | None = None) -> _EveryWork | None:
    return _EveryWork(dist.batch_isend_irecv(p2p_ops)) if p2p_ops else None


def _wait_every_p2p_work(group: Any) -> None:
    """torch 2.7's pipeline schedules keep only the last Work of each batch of sends and receives
    (their ``_batch_p2p`` returns ``batch_isend_irecv(ops).pop()``) and never wait for the others.
    NCCL coalesces a batch into that one Work; gloo gives one per operation, and with the sends'
    Works dropped the stage they were for waits forever (1F1B and the interleaved schedule hung
    on the CPU). Newer torch returns every Work and waits for each (an empty batch gives an empty
    list, not None): where the schedules still keep one, on gloo, their helper is replaced with
    one whose handle waits for every Work."""
    from torch.distributed.pipelining import schedules

    helper = getattr(schedules, "_batch_p2p", None)
    if helper is None or helper is _batch_p2p_every_work or dist.get_backend(group) != "gloo":
        return
    if helper([]) is None:
        schedules._batch_p2p = _batch_p2p_every_work


class Pipeline:
    """Stages, schedule and the groups a pipeline rank needs."""

    def __init__(self, model: nn.Module, mesh: Any, schedule: str, n_microbatches: int, accum: int,
                 device: torch.device, seq_len: int, ignore_last: bool = False) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        kind = stage_kind(model, seq_len, f"--pp={mesh['pp'].size()}")
        tied = model.get_parameter(kind.EMBEDDING) is model.get_parameter(kind.HEAD)
        self.kind, self.ignore_last = kind, ignore_last
        pp_mesh = mesh["pp"]
        pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
        per_rank = 2 if schedule == "interleaved" else 1
        n_stages = pp * per_rank
        ids = [rank + k * pp for k in range(per_rank)]  # loop placement: stage s on rank s % pp
        cuts = split_layers(len(model.get_submodule(kind.BLOCKS)), n_stages)  # type: ignore[arg-type]
        self.stages = [kind(model, cuts[s], s == 0, s == n_stages - 1) for s in ids]
        self.ids, self.n_stages = ids, n_stages
        self.first = 0 in ids
        self.last = n_stages - 1 in ids
        self.union = StageUnion(self.stages)
        self.group = pp_mesh.get_group()
        _wait_every_p2p_work(self.group)
        self.n_micro = n_microbatches
        self.accum = accum
        self._pipe_stages = [PipelineStage(st, s, n_stages, device, group=self.group)
                             for st, s in zip(self.stages, ids)]
        self._make = (lambda: ScheduleInterleaved1F1B(self._pipe_stages, n_microbatches, loss_fn=self._loss,
                                                      scale_grads=False)) if schedule == "interleaved" else (
            lambda: {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](
                self._pipe_stages[0], n_microbatches, loss_fn=self._loss, scale_grads=False))
        self.schedule = self._make()
        self.tied_group, self.tied_src = self._tied_group(mesh) if tied else (None, -1)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each micro-batch's mean, scaled so that the gradients summed over the pipeline's
        # micro-batches and the step's accumulation equal those of the whole batch's mean.
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
        return ce / (self.n_micro * self.accum)

    @staticmethod
    def _tied_group(mesh: Any) -> tuple[Any, int]:
        """The group of this pipeline's first and last stage ranks, and its first stage's
        rank. Every rank creates every pipeline's group, in the same order, as new_group
        requires."""
        names = list(mesh.mesh_dim_names)
        grid = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, mesh.size(names.index("pp")))
        mine, src = None, -1
        for ranks in grid.tolist():
            g = dist.new_group([ranks[0], ranks[-1]])
            if dist.get_rank() in (ranks[0], ranks[-1]):
                mine, src = g, ranks[0]
        return mine, src

    def _targets(self, y: torch.Tensor) -> torch.Tensor:
        """A model that shifts its own labels has no target for a sequence's last token: that
        one is ignored, so the loss stays the model's own."""
        if not self.ignore_last:
            return y
        y = y.clone()
        y[:, -1] = -100
        return y

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-step of the trainer: the schedule splits it into n_microbatches."""
        y = self._targets(y)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach() for loss in losses]).sum()  # = the micro-step's mean / accum

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        y = self._targets(y)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        if hasattr(self.schedule, "eval"):
            self.schedule.eval(*args, **kwargs)
        else:
            losses = self._forward_only(x, y)
        if not losses:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() * self.accum

    # What a stage's output may be, as sent ahead of it to the next stage's rank.
    _DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def _forward_only(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The schedule's ``eval`` where it has none (torch 2.7: its schedules run forward and
        backward, or forward alone without a loss): the same micro-batches, each through every
        stage in order, the activations sent from one stage's rank to the next's (each with its
        shape and dtype first); the last stage's losses per micro-batch, as ``eval`` gives them."""
        pp, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        mine = dict(zip(self.ids, self.stages))
        losses = []
        for xs, ys in zip(torch.tensor_split(x, self.n_micro), torch.tensor_split(y, self.n_micro)):
            h = xs
            for s in range(self.n_stages):
                if s % pp != me:
                    continue
                if s > 0:
                    h = self._recv(dist.get_global_rank(self.group, (s - 1) % pp), x.device)
                h = mine[s](h)
                if s < self.n_stages - 1:
                    self._send(h, dist.get_global_rank(self.group, (s + 1) % pp))
            if self.last:
                losses.append(self._loss(h, ys))
        return losses

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        head = [t.dim(), *t.shape, self._DTYPES.index(t.dtype)]
        dist.send(torch.tensor(head + [0] * (8 - len(head)), device=t.device), dst)
        dist.send(t, dst)

    def _recv(self, src: int, device: torch.device) -> torch.Tensor:
        head = torch.zeros(8, dtype=torch.long, device=device)
        dist.recv(head, src)
        ndim, *rest = head.tolist()
        t = torch.empty(rest[:ndim], dtype=self._DTYPES[rest[ndim]], device=device)
        dist.recv(t, src)
        return t

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding/head gradient over the first and the last stage."""
        if self.tied_group is None or not (self.first or self.last):
            return
        w = self.tied_weight()
        if w.grad is None:
            return
        g = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
        dist.all_reduce(g, group=self.tied_group)

    def tied_weight(self) -> torch.Tensor:
        """This rank's copy of the tied embedding / head weight (first or last stage)."""
        return self.union.get_parameter(self.kind.EMBEDDING if self.first else self.kind.HEAD)

    @torch.no_grad()
    def share_tied_weight(self) -> None:
        """The first stage's tied weight to the last stage: a model filled after its split
        (on the meta device) drew or read the last stage's copy on its own."""
        if self.tied_group is None or not (self.first or self.last):
            return
        w = self.tied_weight()
        local = w.to_local() if hasattr(w, "to_local") else w
        dist.broadcast(local, src=self.tied_src, group=self.tied_group)
