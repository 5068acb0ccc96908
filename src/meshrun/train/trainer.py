"""The Trainer: seed 002's snapshot Trainer grown up (checkpoints arrive with issue 4).

    from meshrun.train import Trainer, TrainConfig
    Trainer(model, train_dataset, val_dataset, TrainConfig(strategy="fsdp", steps=1000)).fit()

Launch the script with `meshrun launch` or torchrun, or run it as one process. One optimizer
step reads ``global_batch`` samples: micro-batch x accumulation x data-parallel size.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

from ..errors import MeshrunError, bad_value
from .config import TrainConfig, validate
from . import checkpoint
from .checkpoint import Position
from .data import BatchStream, LoaderSpec, make_loader
from .gradnorm import clip_grad_norm, clip_grad_norm_sharded
from .metrics import MetricsSink, mfu, peak_flops
from .optim import build_optimizer, build_scheduler, create_state
from .layouts import (Layout, checkpoint_blocks, context_parallel, deepspeed_engine, expert_groups, is_expert,
                      same_initial_weights, tensor_pipeline)
from .parallelize import (FSDPPlan, apply_compile, apply_ddp, apply_fsdp, apply_loss_parallel, can_loss_parallel,
                          apply_tp, choose_fsdp_flavour, choose_strategy, ddp_bucket_mb, find_blocks, fsdp_mesh)
from .runtime import Runtime, init_runtime, take_blas_workspaces


def _takes_targets(module: nn.Module) -> bool:
    """Models whose forward(x, targets) returns the loss (GPT, HF models with labels)."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] in ("targets", "labels", "target", "y")


# A non-finite step is found at the next log line or snapshot, and at least this often: one
# host sync per 50 steps costs nothing measurable, and a run with rare log lines stops soon.
FINITE_CHECK_EVERY = 50


def _replicate_plain_tensors() -> contextlib.AbstractContextManager:
    """The plain ``found_inf`` flag beside DTensor parameters (FSDP2, TP) in the fused
    optimizer: torch 2.13 takes it as it is, earlier DTensor dispatch refused plain tensors
    mixed with its own (pytorch#126670, fused AdamW + GradScaler under FSDP2); replicated is
    what it is (every rank holds the same)."""
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()



class Trainer:
    def __init__(self, model: nn.Module, train_data: Dataset, val_data: Dataset | None = None,
                 config: TrainConfig | None = None, runtime: Runtime | None = None) -> None:
        self.cfg = validate(config or TrainConfig())
        if runtime is None:
            from .runtime import teardown_at_exit

            runtime = init_runtime()
            teardown_at_exit()  # this Trainer made the process group: it also ends it cleanly
        self.rt = runtime
        cfg, rt = self.cfg, self.rt
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and rt.cuda and torch.cuda.is_bf16_supported())
        if cfg.precision == "bf16" and not rt.cuda:
            raise MeshrunError("--precision='bf16': this run is on CPU, where meshrun trains in fp32 "
                               "(hint: use --precision auto or fp32)")
        self.flops_per_token = model.flops_per_token() if hasattr(model, "flops_per_token") else None
        self.n_params = sum(p.numel() for p in model.parameters())
        self.strategy, self.strategy_reason = choose_strategy(cfg.strategy, rt, self.n_params)
        self.ac = cfg.activation_checkpointing != "none"
        self.fsdp_flavour: str | None = None  # the planner's, for --strategy auto
        self.mesh = None  # the (pp, dp_shard, tp) mesh under tensor or pipeline parallelism
        self.pipe = None  # the Pipeline under --pp
        self.dp_rank, self.dp_size = rt.rank, rt.world_size  # who reads which data
        self.cp_size, self.cp_rank, self.cp_index, self.cp_group, self.fsdp_mesh = 1, 0, None, None, None
        self.edp_group = None  # ranks holding the same experts, under --ep
        if cfg.cp > 1:
            self._adopt(context_parallel(cfg, rt))
        elif cfg.tp > 1 or cfg.pp > 1:
            self._adopt(tensor_pipeline(cfg, rt))
        elif cfg.ep > 1:
            self.strategy = "ep"
            self.ep_fsdp = cfg.strategy == "fsdp"  # the rest sharded by FSDP2 instead of replicated
            rest = "FSDP2" if self.ep_fsdp else "data parallel"
            self.strategy_reason = f"expert parallel {cfg.ep}, {rest} over all {rt.world_size} ranks for the rest"
        elif cfg.strategy == "auto" and rt.cuda:
            self._plan_auto(model)
            cfg = self.cfg  # the planner may have chosen the micro-batch
        if rt.world_size > 1:
            for m in model.modules():  # MoE load balancing over the global batch: any layout trains like one process
                if hasattr(m, "shard_experts"):
                    m.stats_group = dist.group.WORLD
        self.model_takes_targets = _takes_targets(model)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
            torch.use_deterministic_algorithms(True)
        self.accum = cfg.accumulation(self.dp_size)
        self.engine = None  # the DeepSpeed engine under --strategy deepspeed
        # (ZeRO-3's partitioned weights take the plain paths, as TP's shards do)
        zero3 = cfg.strategy == "deepspeed" and cfg.zero == 3
        self.kernels = (model.meshrun_kernels(rt.device, cfg.tp, cfg.pp)
                        if hasattr(model, "meshrun_kernels") and not zero3 else [])
        self.model, self.ddp = self._parallelize(model.to(rt.device))
        self._bad_step = torch.zeros((), dtype=torch.long, device=rt.device)
        if self.engine is None:
            self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay)
            # long-lived allocations made before the first step, not between its large blocks
            create_state(self.optimizer)
            take_blas_workspaces(rt.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
        self.train_data = train_data
        self.loader_spec = LoaderSpec(cfg.micro, self.dp_rank, self.dp_size, cfg.seed, pin_memory=rt.cuda)
        self.train_loader = make_loader(train_data, self.loader_spec)
        self.val_loader = make_loader(val_data, LoaderSpec(cfg.micro, self.dp_rank, self.dp_size, cfg.seed,
                                                           rt.cuda, shuffle=False)) if val_data is not None else None
        if not isinstance(train_data, IterableDataset) and len(self.train_loader) == 0:
            raise MeshrunError(f"the training data has {len(train_data)} samples: too few for one micro-batch of "
                               f"{cfg.micro} on each of {self.dp_size} data-parallel ranks (hint: lower --micro-batch)")

    # ---- setup --------------------------------------------------------------------------
    def _adopt(self, layout: Layout) -> None:
        """The groups and data-parallel coordinates of a context, tensor or pipeline layout."""
        self.strategy, self.strategy_reason = layout.strategy, layout.reason
        self.dp_rank, self.dp_size, self.mesh = layout.dp_rank, layout.dp_size, layout.mesh
        self.cp_size, self.cp_rank, self.cp_group, self.fsdp_mesh = (layout.cp_size, layout.cp_rank, layout.cp_group,
                                                                     layout.fsdp_mesh)

    def _plan_auto(self, model: nn.Module) -> None:
        """--strategy auto on GPUs: the planner's first fitting strategy (and activation
        checkpointing when it is needed to fit, unless the user set it); with --global-batch
        and no --micro-batch, also the largest micro-batch that fits (autoplan.decide)."""
        from .autoplan import for_trainer

        rt = self.rt
        d = for_trainer(model, self.cfg, rt.world_size, rt.local_world_size,
                        torch.cuda.get_device_properties(rt.device).total_memory, self.bf16)
        self.strategy, self.strategy_reason = d.strategy, d.reason
        if d.micro is not None:
            self.cfg = self.cfg.replace(micro_batch=d.micro, sources={**self.cfg.sources, "micro_batch": "planner"})
        if d.fsdp and self.cfg.fsdp == "auto":
            self.fsdp_flavour = d.fsdp
        self.ac = self.ac or d.activation_checkpointing

    def _parallelize(self, model: nn.Module) -> tuple[nn.Module, Any]:
        cfg, rt = self.cfg, self.rt
        found = find_blocks(model, cfg.blocks)
        blocks = found[1] if found else None
        if self.mesh is not None:
            if blocks is None:
                raise MeshrunError("--tp/--pp: no block list found in the model (hint: name it with --blocks)")
            same_initial_weights(model)
            if cfg.tp > 1:
                # sequence parallel needs the whole block list in one piece, not cut into stages
                sp = cfg.sequence_parallel and cfg.pp == 1
                # loss parallel: the tied vocabulary rows sharded over TP (not cut into stages either)
                self.loss_parallel = cfg.pp == 1 and can_loss_parallel(model)
                if apply_tp(blocks, self.mesh["tp"], sequence_parallel=sp, gather_output=not self.loss_parallel):
                    self.strategy_reason += " (sequence parallel)"
                    if cfg.seq_len % cfg.tp:  # (checked after the layout and the heads: those errors come first)
                        raise bad_value(cfg.source("seq_len"), cfg.seq_len, f"does not split over --tp {cfg.tp} "
                                        "for sequence parallelism", f"a multiple of {cfg.tp}, or --sequence-parallel off")
                if self.loss_parallel:
                    apply_loss_parallel(model, self.mesh["tp"], sp)
                    self.strategy_reason += " (loss parallel)"
        if cfg.pp > 1:
            return self._pipeline(model, blocks), None
        if self.cp_group is not None:
            from .context import apply_cp

            same_initial_weights(model)
            self.cp_index = apply_cp(model, blocks, self.cp_group, self.cp_size, self.cp_rank, cfg.seq_len, rt.device)
        if self.strategy == "deepspeed":
            return self._deepspeed(model, blocks), None
        if self.strategy == "ep":
            return self._expert_parallel(model, blocks), None
        if self.ac:
            checkpoint_blocks(blocks)
        if self.strategy == "fsdp":
            if self.mesh is None and self.cp_group is None:  # (under TP/CP it happened above)
                same_initial_weights(model)
            if cfg.compile:
                apply_compile(model, blocks, per_block=True, tune=cfg.compile_tune)
            self._shard(model, blocks)
            return model, None
        if self.strategy == "ddp":
            ddp = apply_ddp(model, rt, ddp_bucket_mb(cfg.ddp_bucket_mb, cfg.compile, rt), cfg.reduce_precision == "bf16")
            if cfg.compile:
                apply_compile(ddp, None, per_block=False, tune=cfg.compile_tune)
            return ddp, ddp
        if cfg.compile:
            apply_compile(model, None, per_block=False, tune=cfg.compile_tune)
        return model, None

    def _pipeline(self, model: nn.Module, blocks: nn.ModuleList) -> nn.Module:
        """Cut the (tensor-parallel) model into this rank's stages; checkpoint, compile and
        shard each stage's blocks, then each stage; build the schedule."""
        from .pipeline import Pipeline

        cfg, rt = self.cfg, self.rt
        if self.ac:
            checkpoint_blocks(blocks)
        if cfg.compile:
            apply_compile(model, blocks, per_block=True, tune=cfg.compile_tune)
        self.pipe = Pipeline(model, self.mesh, cfg.pp_schedule, cfg.pp_microbatches or cfg.pp, self.accum, rt.device)
        if self.strategy == "fsdp":
            flavour = cfg.fsdp if cfg.fsdp != "auto" else "full"
            plan = FSDPPlan(flavour, self.dp_size)
            for stage in self.pipe.stages:
                apply_fsdp(stage, nn.ModuleList(stage.blocks.values()), self.mesh["dp_shard"], plan, self.bf16,
                           cfg.reduce_precision == "bf16")
        return self.pipe.union

    def _deepspeed(self, model: nn.Module, blocks: nn.ModuleList | None) -> nn.Module:
        if self.ac:
            checkpoint_blocks(blocks)
        self.engine, self.optimizer, self.strategy_reason = deepspeed_engine(model, self.cfg, self.rt, self.dp_size,
                                                                              self.accum, self.bf16)
        return self.engine

    def _expert_parallel(self, model: nn.Module, blocks: nn.ModuleList | None) -> nn.Module:
        """Experts sharded over ep groups of consecutive ranks; every rank reads its own data.
        No DDP wrapper: dense gradients are averaged over all ranks, expert gradients over the
        ranks holding the same experts (``_sync_expert_grads``)."""
        mesh = expert_groups(model, self.cfg, self.rt)
        self.edp_group, self.ep_group, self.ep_mesh = mesh["edp"].get_group(), mesh["ep"].get_group(), mesh
        if self.ac:
            checkpoint_blocks(blocks)
        if self.cfg.compile:
            apply_compile(model, blocks, per_block=True, tune=self.cfg.compile_tune)
        if self.ep_fsdp:  # every parameter but the experts (each rank's own) sharded over all ranks
            self._shard(model, blocks, ignored={p for n, p in model.named_parameters() if is_expert(n)})
        return model

    def _shard(self, model: nn.Module, blocks: nn.ModuleList | None, ignored: set | None = None) -> None:
        """FSDP2 in the planner's or the configured flavour, over the data-parallel mesh of
        the layout (TP/PP's dp_shard, CP's all ranks) or one of its own."""
        cfg, rt = self.cfg, self.rt
        if self.fsdp_flavour:
            flavour = self.fsdp_flavour
        else:
            flavour, why = choose_fsdp_flavour(cfg.fsdp, rt, self.n_params)
            self.strategy_reason += f"; fsdp {flavour}: {why}"
        self.fsdp_flavour = flavour
        plan = FSDPPlan(flavour, cfg.fsdp_shard_size or rt.local_world_size)
        mesh = (self.mesh["dp_shard"] if self.mesh is not None else self.fsdp_mesh if self.fsdp_mesh is not None
                else fsdp_mesh(rt, plan))
        apply_fsdp(model, blocks, mesh, plan, self.bf16, cfg.reduce_precision == "bf16", ignored=ignored)

    ep_mesh: Any = None  # the (edp, ep) mesh under --ep
    ep_fsdp = False  # --ep with --strategy fsdp

    def _local_shards(self) -> Any:
        """For snapshots: under --ep each rank holds E/ep experts of every expert tensor, the
        same part as its edp peers: (Replicate over edp, Shard(0) over ep) of the whole."""
        if self.ep_mesh is None:
            return None
        from torch.distributed.tensor import Replicate, Shard

        mesh = self.ep_mesh
        return lambda fqn: (mesh, [Replicate(), Shard(0)]) if is_expert(fqn) else None

    def _sync_expert_grads(self) -> None:
        """Sum over the ranks that hold each parameter, divide by the world: the gradient of
        the mean loss over all ranks' tokens (an expert's rank already summed the gradients
        of every token routed to it)."""
        world = self.rt.world_size
        for name, p in self.model.named_parameters():
            if hasattr(p, "device_mesh"):  # FSDP2's (--ep with --strategy fsdp): averaged already
                continue
            if p.grad is None:  # an expert no token reached here: its peers still reduce
                p.grad = torch.zeros_like(p)
            expert = is_expert(name)
            dist.all_reduce(p.grad, group=self.edp_group if expert else None)
            p.grad.div_(world)

    def _grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce / reduce-scatter on micro-steps before the last."""
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        if self.strategy == "fsdp" or self.ep_fsdp:
            for module in (self.pipe.stages if self.pipe is not None else [self.model]):
                module.set_requires_gradient_sync(sync)  # type: ignore[operator]
                if self.fsdp_flavour == "grad_op" and self.pipe is None:
                    # grad_op holds every block gathered from forward to backward anyway, so
                    # holding them on to the next micro-step's forward costs no extra peak
                    # memory and saves an all-gather per block per accumulated micro-step.
                    module.set_reshard_after_backward(sync)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        # DDP and single keep fp32 master weights and run matmuls in bf16 under autocast;
        # FSDP2 casts parameters itself (MixedPrecisionPolicy), so no autocast there.
        if self.bf16 and self.strategy not in ("fsdp", "deepspeed"):  # (single, ddp, pipeline)
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _attention(self) -> contextlib.AbstractContextManager:
        from .attention import attention_kernels

        return attention_kernels(self.cfg.attention, self.rt.device)

    loss_parallel = False  # the loss reduced over vocabulary shards (TP of meshrun's GPT)

    def _loss_context(self) -> Any:
        """Forward and backward of a loss-parallel model run inside torch's loss_parallel()."""
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    # ---- the step -----------------------------------------------------------------------
    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.model_takes_targets:
            return self.model(x, y)
        out = self.model(x)
        if not y.is_floating_point():
            return F.cross_entropy(out.float().view(-1, out.shape[-1]), y.reshape(-1))
        return F.mse_loss(out.float(), y.float())

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        x, y = x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True)
        if self.cp_index is not None:  # this rank's shard of every sequence
            x, y = x[:, self.cp_index], y[:, self.cp_index]
        return x, y

    step = 0  # optimizer steps done

    def train_step(self, data: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One optimizer step over ``accum`` micro-batches. Returns this rank's mean loss (a
        device tensor: no CPU sync here), the gradient norm and the tokens processed."""
        loss_sum = torch.zeros((), device=self.rt.device)
        tokens = 0
        for micro in range(self.accum):
            x, y = self._to_device(next(data))
            tokens += x.numel() if not x.is_floating_point() else x.shape[0]
            if self.engine is not None:  # DeepSpeed accumulates, clips and steps at the boundary
                with self._attention():
                    loss = self._loss(x, y)
                    self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.detach() / self.accum
                continue
            with self._grad_sync(micro == self.accum - 1), self._autocast(), self._loss_context(), self._attention():
                if self.pipe is not None:
                    loss_sum += self.pipe.step(x, y)  # forward and backward, micro-batch by micro-batch
                    continue
                loss = self._loss(x, y) / self.accum
                loss.backward()
            loss_sum += loss.detach()
        if self.engine is not None:
            return self._deepspeed_done(loss_sum, tokens)
        if self.strategy == "ep":
            self._sync_expert_grads()
            return self._finish_step(clip_grad_norm_sharded(
                self.model.named_parameters(), is_expert, self.ep_group, self.cfg.grad_clip or float("inf")),
                loss_sum, tokens)
        uncounted: tuple = ()
        if self.pipe is not None:
            self.pipe.sync_tied_grads()
            if self.pipe.tied_group is not None and self.pipe.last and not self.pipe.first:
                uncounted = (self.pipe.union.head.weight,)  # the first stage counts the tied weight
        # The global gradient norm (reduced across FSDP2's shards and pipeline stages too);
        # with clipping off, an infinite threshold computes it without scaling anything.
        norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip or float("inf"),
                              across=self.pipe.group if self.pipe is not None else None, uncounted=uncounted)
        return self._finish_step(norm, loss_sum, tokens)

    def _finish_step(self, norm: torch.Tensor, loss_sum: torch.Tensor,
                     tokens: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        if self.optimizer.defaults.get("fused"):
            # No host sync in the step: fused AdamW skips the update on the device where the
            # global norm is not finite, and the step is remembered for _check_finite (at the
            # next log line or snapshot, or FINITE_CHECK_EVERY steps). The host runs ahead, so the next micro-batch loads
            # and its kernels queue while the GPU still computes this step.
            bad = ~torch.isfinite(norm)
            self.optimizer.found_inf = bad.float()
            self._bad_step = torch.where(bad & (self._bad_step == 0), self.step + 1, self._bad_step)
            with _replicate_plain_tensors():
                self.optimizer.step()
        else:
            if not torch.isfinite(norm).item():
                raise MeshrunError(
                    f"non-finite loss or gradients (gradient norm {norm.item()}) at step {self.step + 1}; stopped "
                    "before the optimizer step, so no snapshot holds poisoned weights "
                    "(hint: lower --lr, check the data)")
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, (norm if self.cfg.grad_clip > 0 else None), tokens

    _bad_step: torch.Tensor  # the first step whose gradients were not finite (0: none yet)

    def _check_finite(self) -> None:
        """Stop if a step since the start had non-finite gradients: one host sync, at log
        lines, before snapshots and every FINITE_CHECK_EVERY steps. Its update and any such later ones were skipped, so
        neither the weights nor a snapshot hold them."""
        bad = int(self._bad_step.item())
        if bad:
            raise MeshrunError(
                f"non-finite loss or gradients at step {bad}; its update was skipped and training stopped at step "
                f"{self.step}, so no snapshot holds poisoned weights (hint: lower --lr, check the data)")

    def _deepspeed_done(self, loss_sum: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """DeepSpeed stepped already; its global norm is the pre-clip one. A non-finite one
        stops the run (DeepSpeed's step has been taken: the last committed snapshot is the
        clean state to go back to)."""
        norm = self.engine.get_global_grad_norm()
        norm_t = torch.tensor(float(norm) if norm is not None else 0.0)
        if not torch.isfinite(norm_t) or not torch.isfinite(loss_sum).item():
            raise MeshrunError(f"non-finite loss or gradients (gradient norm {float(norm_t)}) at step {self.step + 1} "
                               "(hint: lower --lr, check the data; resume from the last snapshot)")
        self.scheduler.step()
        self.step += 1
        return loss_sum, (norm_t if self.cfg.grad_clip > 0 else None), tokens

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.val_loader is None:
            return None
        self.model.eval()
        total = torch.zeros(2, device=self.rt.device)
        for i, batch in enumerate(self.val_loader):
            if i >= self.cfg.eval_batches:
                break
            x, y = self._to_device(batch)
            with self._autocast(), self._attention():
                if self.pipe is not None:
                    loss = self.pipe.evaluate(x, y)  # on the last stage; None on the others
                    if loss is not None:
                        total += torch.stack([loss.float(), torch.ones((), device=self.rt.device)])
                    continue
                with self._loss_context():
                    total += torch.stack([self._loss(x, y).float(), torch.ones((), device=self.rt.device)])
        self.model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item() if total[1] > 0 else None

    # ---- the loop -----------------------------------------------------------------------
    def describe(self) -> str:
        cfg, rt = self.cfg, self.rt
        return (f"meshrun train: strategy {self.strategy} ({self.strategy_reason}), {rt.world_size} process(es), "
                f"{self.n_params / 1e6:.2f}M parameters, global batch {cfg.micro} x {self.accum} x "
                f"{self.dp_size} = {cfg.micro * self.accum * self.dp_size}, "
                f"{'bf16' if self.bf16 else 'fp32'}{', compiled' if cfg.compile else ''}{', tuned' if cfg.compile_tune else ''}"
                + (f", DDP buckets of {self.ddp.bucket_bytes_cap // 2**20} MB" if self.ddp is not None else "")
                + "".join(f", {k}" for k in self.kernels))

    def _guarded_step(self, data: Iterator, first: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """A step; out of memory on the run's first step becomes advice, not a traceback."""
        try:
            return self.train_step(data)
        except torch.cuda.OutOfMemoryError:
            if not first:
                raise
            raise MeshrunError(
                f"out of memory at the first step with strategy {self.strategy}, micro-batch {self.cfg.micro} "
                f"(hint: try --strategy fsdp, a smaller --micro-batch, or --activation-checkpointing full)"
            ) from None

    def _record(self, step: int, loss_sum: torch.Tensor, steps: int, tokens: int, elapsed: float,
                norm: torch.Tensor | None) -> dict[str, Any]:
        """One log line's metrics over the last ``steps`` steps. The loss is the mean over the
        whole global batch from every rank: one all-reduce per log line, not per step."""
        rt = self.rt
        dist.all_reduce(loss_sum)
        # TP and PP ranks share their tokens (CP ranks count only their own shard already)
        per_gpu = tokens / elapsed / (rt.world_size // (self.dp_size * self.cp_size))
        return {
            "step": step,
            # every rank but the non-last pipeline stages holds the loss: .item() waits for the GPU
            "loss": loss_sum.item() / (rt.world_size // self.cfg.pp * steps),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
            "step_time_s": elapsed / steps,
            "tokens_per_s": per_gpu * rt.world_size,
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu(per_gpu, self.flops_per_token, peak_flops(rt.device)),
            "peak_mem_bytes": torch.cuda.max_memory_allocated(rt.device) if rt.cuda else None,
        }

    # ---- snapshots --------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str | None:
        return os.path.join(self.cfg.out, "checkpoints") if self.cfg.out else None

    def resume_path(self) -> str | None:
        """The snapshot to start from: --resume PATH, or the newest committed one under
        --out (``auto``), or none."""
        cfg, root = self.cfg, self.checkpoint_root
        if cfg.resume == "none":
            return None
        if cfg.resume != "auto":
            if os.path.isfile(os.path.join(cfg.resume, checkpoint.MARKER)):
                return cfg.resume
            found = checkpoint.latest(cfg.resume) if os.path.isdir(cfg.resume) else None
            if found is None:
                raise MeshrunError(f"--resume={cfg.resume!r}: not a committed snapshot nor a directory of them "
                                   "(hint: give OUT/checkpoints/step-N, or --resume none)")
            return found
        return checkpoint.latest(root) if root else None

    def restore(self) -> BatchStream:
        """Load the snapshot to resume from, if any, and return the data stream positioned
        where it stopped."""
        rt, path = self.rt, self.resume_path()
        if self.checkpoint_root and rt.is_main:
            checkpoint.clear_partial(self.checkpoint_root)  # a save killed halfway
        dist.barrier()
        position = Position()
        if path:
            position, saved_world = checkpoint.load(path, self.model, self.optimizer, self._local_shards())
            self.step = position.step
            for _ in range(position.step):  # the schedule is a pure function of the step
                self.scheduler.step()
            if rt.is_main:
                print(f"meshrun train: resumed from {path} at step {position.step} (epoch {position.epoch}, "
                      f"{position.samples} samples into it; saved on {saved_world} rank(s))", flush=True)
        if position.samples and not hasattr(self.train_loader.sampler, "set_start"):  # iterable data
            self.train_loader = make_loader(self.train_data, self.loader_spec, skip=position.samples // self.dp_size)
            position = Position(position.step, position.epoch, 0)
        return BatchStream(self.train_loader, self.cfg.micro, self.dp_size, position.epoch, position.samples)

    _pending: checkpoint.PendingSave | None = None
    _async_group: Any = None

    def save(self, data: BatchStream, final: bool = False) -> None:
        """Snapshot now. Asynchronous saves commit the previous snapshot first (one in
        flight at a time, so two never interleave), and the last one before returning."""
        root = self.checkpoint_root
        if root is None:
            return
        if self._pending is not None:
            previous = self._pending
            apart = time.perf_counter() - previous.started  # training time between the two saves
            checkpoint.commit(previous)
            self._pending = None
            advice = checkpoint.slow_writer_advice(previous.wait_s, previous.written - previous.started, apart,
                                                   self.cfg.save_every)
            if advice and self.rt.is_main:
                print(advice, flush=True)
        group = None
        if self.cfg.async_save and not final:
            if self._async_group is None:  # the background writer coordinates over gloo
                self._async_group = dist.new_group(backend="gloo")
            group = self._async_group
        pending = checkpoint.begin_save(root, Position(self.step, data.epoch, data.samples), self.model,
                                        self.optimizer, self.cfg.to_json(), self.cfg.keep_last, group,
                                        self._local_shards())
        if group is None:
            checkpoint.commit(pending)
        else:
            self._pending = pending

    def fit(self) -> list[dict[str, Any]]:
        """Train to ``cfg.steps`` optimizer steps, resuming from a snapshot when there is one;
        with --out, snapshot every ``save_every`` steps and at the end. Returns rank 0's log
        records (other ranks: [])."""
        cfg, rt = self.cfg, self.rt
        data = self.restore()
        sink = MetricsSink(cfg.out, cfg.steps, enabled=rt.is_main)
        if rt.is_main:
            print(self.describe(), flush=True)
        loss_sum = torch.zeros((), device=rt.device)
        tokens, steps, start = 0, 0, time.perf_counter()
        try:
            first_step = self.step + 1
            for step in range(first_step, cfg.steps + 1):
                loss, norm, n = self._guarded_step(data, step == first_step)
                loss_sum += loss
                tokens, steps = tokens + n, steps + 1
                last = step == cfg.steps
                snapshot = (cfg.save_every and step % cfg.save_every == 0) or last
                log = step % cfg.log_every == 0 or last
                if not (log or snapshot or step % FINITE_CHECK_EVERY == 0):
                    continue
                self._check_finite()
                if snapshot:
                    self.save(data, final=last)
                if not log:
                    continue
                record = self._record(step, loss_sum, steps, tokens, time.perf_counter() - start, norm)
                if last or (cfg.eval_every and step % cfg.eval_every == 0):
                    record["val_loss"] = self.evaluate()
                sink.log(record)
                loss_sum.zero_()
                tokens, steps, start = 0, 0, time.perf_counter()
        finally:
            sink.close()
            checkpoint.wait_pruned()
        return sink.records
