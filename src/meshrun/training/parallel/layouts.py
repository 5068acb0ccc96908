"""The training step as each parallel layout runs it, behind one small interface.

The loop (trainer.py) knows nothing of strategies: for every micro-batch it calls
``micro_step`` (forward and backward, gradients synchronised only on the last micro-batch of
the step), then ``step`` once (gradients combined where the layout needs it, the global norm,
clipping, the optimizer's update), ``eval_loss`` to validate, and hands ``model``,
``optimizer`` and ``local_shards`` to the snapshots. The layouts:

- ``DataParallel``: one process, DDP, or FSDP2 in any flavour, with tensor and context
  parallelism inside;
- ``Pipelined``: pipeline stages (with tensor parallelism, FSDP2 per stage);
- ``ExpertParallel``: experts shared out over ranks, the rest replicated or FSDP2-sharded;
- ``DeepSpeedZeRO``: a DeepSpeed engine, which accumulates, clips and steps itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import MeshrunError
from ...modelinfo.loss import model_loss
from ..loaded import plain_beside_dtensors
from ..models.attention import attention_kernels
from .gradnorm import clip_grad_norm, clip_grad_norm_sharded

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # inputs, targets, document positions


@dataclass(frozen=True)
class StepSettings:
    """What every layout's step needs, whatever the layout: micro-steps per optimizer step,
    the gradient-norm clip, the device, how the model returns its loss (``loss_mode``), the
    attention kernel SDPA tries first, and what to call with the model after each update
    (float8's all-gathered weights: their scales)."""

    accum: int
    max_norm: float
    device: torch.device
    loss_mode: str
    attention: str = "auto"
    after_update: Callable[[nn.Module], None] | None = None


def target_weights(targets: list[torch.Tensor], world: int, device: torch.device) -> torch.Tensor:
    """Each micro-batch's weight in a step whose loss is the mean over every target the step's
    micro-batches hold on every rank: its count of targets (``targets``: each micro-batch's,
    whole sequences, before a context-parallel shard) x accumulation x world over the world's
    total. A micro-batch's loss is the mean over its own targets, and the layouts average
    micro-batches and ranks equally; where the targets are few and uneven (chat data: only the
    replies train) that would weigh a reply token of a short micro-batch above one of a long
    one, and make the result depend on the micro-batch and the number of ranks. Ranks that see
    the same micro-batch (tensor and context parallel ones) count it alike, so summing over the
    whole world counts each target (world / dp) times, as ``world`` in the numerator does."""
    counts = torch.stack([t.ne(-100).sum() for t in targets]).to(device=device, dtype=torch.float32)
    total = counts.sum()
    if world > 1:
        dist.all_reduce(total)
    return counts * (len(targets) * world) / total.clamp(min=1.0)


def weighted(loss: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``loss`` x ``weight``; a micro-batch without a target (weight 0) adds nothing, where its
    mean over no targets is nan (its gradients are zero: no target sends any back)."""
    if weight is None:
        return loss
    return torch.where(weight > 0, loss, torch.zeros_like(loss)) * weight


class Layout:
    """What the loop calls. ``dp_rank``/``dp_size`` say which data this rank reads;
    ``token_share`` how many ranks work on the same tokens (tensor and pipeline parallel
    groups: throughput per GPU divides by it); ``loss_ranks`` how many ranks hold the loss."""

    def __init__(self, model: nn.Module, optimizer: Any, *, settings: StepSettings, description: str,
                 dp_rank: int, dp_size: int, autocast: bool = False, token_share: int = 1,
                 loss_ranks: int = 1) -> None:
        self.model, self.optimizer = model, optimizer
        self.description = description
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum, self.max_norm, self.device = settings.accum, settings.max_norm, settings.device
        self.loss_mode, self.autocast, self.attention = settings.loss_mode, autocast, settings.attention
        self.token_share, self.loss_ranks = token_share, loss_ranks
        self.after_update = settings.after_update
        # the first non-finite step (0: none)
        self._bad_step = torch.zeros((), dtype=torch.long, device=settings.device)

    # ---- what the loop calls ------------------------------------------------------------
    def batch(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> Batch:
        """This rank's part of a micro-batch (all of it but under context parallelism)."""
        return x, y, positions

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool,
                   positions: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch; its loss / accumulation, detached.
        ``weight``: the micro-batch's share of the step's targets (``target_weights``)."""
        with self.grad_sync(last), self.compute():
            loss = weighted(self.loss(x, y, positions), weight) / self.accum
            loss.backward()
        return loss.detach()

    # The micro-batch can change after the layout is built (training/batchfit.py): False where a
    # schedule or an engine was cut for it (pipelines, DeepSpeed)
    resizable_batch = True

    def set_accum(self, accum: int) -> None:
        """Micro-steps per optimizer step, after the batch fit made the micro-batch smaller."""
        self.accum = accum

    def try_micro_step(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Forward and backward of one micro-batch, to see that it fits; no update follows
        (``drop_gradients``)."""
        self.micro_step(x, y, last=True, positions=positions)

    def drop_gradients(self) -> None:
        """Forget the gradients of a micro-step that is not followed by an update, and anything
        a failed one left gathered (FSDP2's unsharded blocks)."""
        self.optimizer.zero_grad(set_to_none=True)
        for module in self.model.modules():
            if hasattr(module, "reshard") and hasattr(module, "unshard"):  # an FSDP2 module
                module.reshard()

    def step(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Finish optimizer step number ``step``: the global gradient norm (clipped to
        ``max_norm``; inf: measured only), then the update. Returns the norm."""
        norm = clip_grad_norm(self.model.parameters(), self.max_norm)
        self.update(norm, step)
        return norm

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor,
                  positions: torch.Tensor | None = None) -> torch.Tensor | None:
        with self.compute():
            return self.loss(x, y, positions)

    def local_shards(self) -> Callable[[str], Any] | None:
        """For snapshots: (mesh, placements) of plain parameters that hold only this rank's
        part of a larger tensor."""
        return None

    def ties(self) -> dict[str, str]:
        """For resuming: {this rank's name of a tied parameter: the whole model's first name
        of it}, where the two differ."""
        return {}

    def check_finite(self, step: int) -> None:
        """Stop if a step since the start had non-finite gradients: one host sync, which the
        loop makes at log lines, before snapshots and every so many steps. That update and any
        later such ones were skipped, so neither the weights nor a snapshot hold them."""
        bad = int(self._bad_step.item())
        if bad:
            raise MeshrunError(
                f"non-finite loss or gradients at step {bad}; its update was skipped and training stopped at step "
                f"{step}, so no snapshot holds poisoned weights (hint: lower --lr, check the data)")

    # ---- pieces for the layouts ---------------------------------------------------------
    def loss(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return model_loss(self.model, self.loss_mode, x, y, positions=positions)

    def grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def compute(self) -> contextlib.ExitStack:
        """Forward and backward run under bf16 autocast where the layout keeps fp32 weights
        (single, DDP, plain pipeline stages; FSDP2 casts its parameters itself), with the
        chosen attention kernel first (recomputation must pick the forward's)."""
        stack = contextlib.ExitStack()
        if self.autocast:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=torch.bfloat16))
        stack.enter_context(attention_kernels(self.attention, self.device))
        return stack

    def update(self, norm: torch.Tensor, step: int) -> None:
        """The optimizer's update, skipped where the global norm is not finite. With the fused
        AdamW that takes no host sync: the optimizer skips the update on the device
        (``found_inf``) and the step is remembered for ``check_finite``, so the host runs ahead
        and the next micro-batch loads while the GPU still computes this step."""
        if self.optimizer.defaults.get("fused"):
            bad = ~torch.isfinite(norm)
            self.optimizer.found_inf = bad.float()
            self._bad_step = torch.where(bad & (self._bad_step == 0), step, self._bad_step)
            # the plain found_inf flag beside DTensor parameters (FSDP2, TP): torch 2.13
            # takes it as it is, earlier DTensor dispatch refused plain tensors mixed with its
            # own (github.com/pytorch/pytorch/issues/126670); replicated is what it is
            with plain_beside_dtensors():
                self.optimizer.step()
        else:
            if not torch.isfinite(norm).item():
                raise MeshrunError(
                    f"non-finite loss or gradients (gradient norm {norm.item()}) at step {step}; stopped "
                    "before the optimizer step, so no snapshot holds poisoned weights "
                    "(hint: lower --lr, check the data)")
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_update is not None:
            self.after_update(self.model)


def _fsdp_sync(modules: list[nn.Module], flavour: str | None, sync: bool) -> None:
    """FSDP2: no reduce-scatter before the step's last micro-batch. grad_op holds every block
    gathered from forward to backward anyway, so holding them on to the next micro-step's
    forward costs no extra peak memory and saves an all-gather per block per micro-step."""
    for module in modules:
        module.set_requires_gradient_sync(sync)  # type: ignore[operator]
        if flavour == "grad_op":
            module.set_reshard_after_backward(sync)  # type: ignore[operator]


class DataParallel(Layout):
    """One process, DDP or FSDP2, with tensor parallelism (``loss_parallel``: the loss reduced
    over vocabulary shards) and context parallelism (``context``: the attention that holds
    this rank's positions of every sequence, ``cp_index``) inside."""

    def __init__(self, model: nn.Module, optimizer: Any, *, ddp: Any = None, fsdp: str | None = None,
                 fsdp_ranks: int = 1, context: Any = None, cp: int = 1, loss_parallel: bool = False,
                 **kw: Any) -> None:
        super().__init__(model, optimizer, **kw)
        self.ddp, self.fsdp, self.context, self.cp, self.loss_parallel = ddp, fsdp, context, cp, loss_parallel
        self.fsdp_ranks = fsdp_ranks  # the ranks FSDP2 shards over
        self.cp_index: torch.Tensor | None = None if context is None else context.local

    def batch(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> Batch:
        """This rank's shard of the inputs and targets under context parallelism; document
        positions stay whole (``loss`` builds the masks from them and shards them)."""
        if self.cp_index is None:
            return x, y, positions
        if self.loss_mode.startswith("labels"):
            # a model that shifts its labels has no target for a sequence's last token; its
            # shard comes with the targets already shifted, that one ignored, so the loss stays its own
            y = y.clone()
            y[:, -1] = -100
        return x[:, self.cp_index], y[:, self.cp_index], positions

    def loss(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.cp_index is None:
            return super().loss(x, y, positions)
        # whole sequences' document positions: the attention's masks from them, the model this rank's share
        self.context.set_documents(positions)
        shard = None if positions is None else positions[:, self.cp_index]
        targets = None
        if shard is not None:
            # A document's last token has no target, so the shards hold unequal numbers of
            # them: the whole sequences' count, for each rank's loss to be its share of their mean
            targets = (y != -100).sum()
            dist.all_reduce(targets, group=self.context.group)
        if not self.loss_mode.startswith("labels"):
            loss = super().loss(x, y, shard)
            if targets is None:
                return loss
            here = (y != -100).sum()  # none on a shard of a prompt alone (chat data): its mean is nan, its share 0
            return torch.where(here > 0, loss, torch.zeros_like(loss)) * (here * self.cp / targets)
        # A Hugging Face model's shard: its true positions (in their documents), its targets
        # unshifted, and the divisor a 1/cp share of the sequences' targets, so the mean over
        # the group is the whole sequences' mean
        seq = x.shape[1] * self.cp
        extra = {"labels": y, "shift_labels": y,
                 "position_ids": self.cp_index[None].expand(x.shape[0], -1) if shard is None else shard,
                 "num_items_in_batch": x.shape[0] * (seq - 1) / self.cp if targets is None else targets / self.cp}
        return model_loss(self.model, self.loss_mode, x, y, extra)

    def try_micro_step(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        # DDP: without its all-reduce, so a rank that runs out of memory in backward leaves no
        # collective half-done (the buckets are the gradients' own storage: the peak is the same)
        self.micro_step(x, y, last=self.ddp is None, positions=positions)

    def grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        if self.fsdp is not None and self.fsdp_ranks > 1:
            _fsdp_sync([self.model], self.fsdp, sync)
        # FSDP2 over one rank (one GPU, or TP with one data-parallel rank) reduces at every
        # micro-step: a copy, no communication to save, and the reduced gradients accumulate in
        # the shards (4 bytes per parameter). Held back, FSDP2 would accumulate whole fp32
        # gradients of its own beside the shards, cached on its reduce-scatter stream from the
        # step before: 4 bytes per parameter more at the peak (32 GB for an 8B model).
        return contextlib.nullcontext()

    def compute(self) -> contextlib.ExitStack:
        stack = super().compute()
        if self.loss_parallel:  # forward and backward of a loss-parallel model run inside it
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack


class Pipelined(Layout):
    """Pipeline stages (``parallel/pipeline.py``): each micro-batch cut into the schedule's
    pieces; the tied embedding/head gradient summed between the first and last stage; the
    norm summed over the stages."""

    resizable_batch = False  # the schedule cuts each micro-batch into its pieces

    def __init__(self, model: nn.Module, optimizer: Any, *, pipe: Any, sharded: bool, **kw: Any) -> None:
        super().__init__(model, optimizer, **kw)
        self.pipe, self.sharded = pipe, sharded

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool,
                   positions: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        if weight is not None:  # (chat data, the only data with weights, is refused under --pp before launch)
            raise MeshrunError("a pipeline's micro-batches cannot be weighted by their targets "
                               "(hint: train chat data without --pp)")
        if self.sharded:
            _fsdp_sync(self.pipe.stages, None, last)
        with self.compute():
            return self.pipe.step(x, y)  # forward and backward, piece by piece: the loss / accum

    def step(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        pipe = self.pipe
        pipe.sync_tied_grads()
        # the first stage counts the tied weight; the last scales its copy without counting it
        uncounted = (pipe.tied_weight(),) if pipe.tied_group is not None and pipe.last and not pipe.first else ()
        norm = clip_grad_norm(self.model.parameters(), self.max_norm, across=pipe.group, uncounted=uncounted)
        self.update(norm, step)
        return norm

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor,
                  positions: torch.Tensor | None = None) -> torch.Tensor | None:
        with self.compute():
            return self.pipe.evaluate(x, y)  # on the last stage; None on the others

    def ties(self) -> dict[str, str]:
        pipe = self.pipe
        if pipe.tied_group is None or not pipe.last or pipe.first:
            return {}
        return {pipe.kind.HEAD: pipe.kind.EMBEDDING}


class ExpertParallel(Layout):
    """Experts shared out over ep ranks (``parallel/expert.py``). No DDP wrapper: dense
    gradients are averaged over all ranks, expert gradients over the ranks holding the same
    experts; the norm counts the shared-out part once per group."""

    def __init__(self, model: nn.Module, optimizer: Any, *, meshes: Any, fsdp: str | None, world: int,
                 **kw: Any) -> None:
        super().__init__(model, optimizer, **kw)
        self.meshes, self.fsdp, self.world = meshes, fsdp, world

    def grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        if self.fsdp is not None:
            _fsdp_sync([self.model], self.fsdp, sync)
        return contextlib.nullcontext()

    def step(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        from .expert import is_expert, sync_expert_grads

        sync_expert_grads(self.model, self.meshes["edp"].get_group(), self.world)
        norm = clip_grad_norm_sharded(self.model.named_parameters(), is_expert, self.meshes["ep"].get_group(),
                                      self.max_norm)
        self.update(norm, step)
        return norm

    def local_shards(self) -> Callable[[str], Any] | None:
        from .expert import expert_shards

        return expert_shards(self.meshes.world)


class DeepSpeedZeRO(Layout):
    """A DeepSpeed engine: it accumulates (its own boundary), clips and steps at every
    micro-batch's ``engine.step()``. Its global norm is the pre-clip one; a non-finite norm or
    loss stops the run at once (DeepSpeed has taken the step: the last committed snapshot is
    the clean state to go back to)."""

    resizable_batch = False  # the engine was built for its micro-batch

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool,
                   positions: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        with self.compute():
            loss = weighted(self.loss(x, y, positions), weight)
            self.model.backward(loss)
        self.model.step()
        return loss.detach() / self.accum

    def step(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        norm = self.model.get_global_grad_norm()
        norm_t = torch.tensor(float(norm) if norm is not None else 0.0)
        if not torch.isfinite(norm_t) or not torch.isfinite(loss).item():
            raise MeshrunError(f"non-finite loss or gradients (gradient norm {float(norm_t)}) at step {step} "
                               "(hint: lower --lr, check the data; resume from the last snapshot)")
        return norm_t
