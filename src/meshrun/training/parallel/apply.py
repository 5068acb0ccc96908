"""Parallelisms as plain functions, applied to a model in one fixed order (torchtitan's):

    LoRA adapters -> tensor parallel -> context parallel -> activation checkpointing -> compile
    -> FSDP2 / DDP

Low-rank adapters (--lora) go in first, on the model as built (on the meta device where it is
there), so that every later step wraps, compiles and shards the adapted layers as they are;
the base weights are frozen and only the adapters reach the optimizer.

Tensor parallelism rewrites the blocks' Linear layers into DTensor shards first, on the raw
modules (checkpoint wrappers would change their paths); context parallelism then swaps each
block's attention. Checkpointing wraps each block so that compile sees (and FSDP2 shards) the
wrapped blocks; compile comes before the FSDP2 wrap so each block compiles as a unit and
FSDP2's hooks stay outside the graphs; DDP is compiled after wrapping so its buckets are
visible to the compiler (it splits the graph at bucket boundaries to overlap all-reduces).
Pipelines cut the model into stages after compile and shard each stage; expert parallelism
shares out the experts first; DeepSpeed takes the checkpointed model as it is.

``parallelize`` is the one place a layout is built; each step it takes is named in the
layout's description, which the run prints first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...config import TrainConfig
from ...errors import MeshrunError, bad_value, first_line
from ...kernels.inductor import compile_options
from ...modelinfo.blocks import find_blocks
from ...modelinfo.loss import loss_mode
from ...vocab import Engine, StrategyKind
from ..models.hf import is_transformers_model
from ..models.hooks import ExpertModule, KernelModel
from ..optim import build_optimizer, create_state
from ..runtime import Runtime, take_blas_workspaces
from ..weights import Pretrained, materialize, on_meta
from .auto import Choice
from .dims import Meshes, ParallelDims, make_dims
from .float8 import convert as convert_float8
from .float8 import is_float8
from .layouts import DataParallel, DeepSpeedZeRO, ExpertParallel, Layout, Pipelined, StepSettings


def same_initial_weights(model: nn.Module) -> None:
    """Rank 0's initial weights everywhere, before anything is sharded or split."""
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def checkpoint_blocks(blocks: nn.ModuleList | None, mode: str = "full") -> None:
    if blocks is None:
        raise MeshrunError("--activation-checkpointing: no block list found in the model "
                           "(hint: name it with --blocks, e.g. model.layers)")
    apply_activation_checkpointing(blocks, mode)


# What selective checkpointing keeps: the outputs of the matmuls and of attention, the
# operations whose recomputation would cost most of a block's forward again. Everything between
# them (norms, activations, rotary embeddings, residual adds: memory-bound) is recomputed.
def _kept_ops() -> set[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_context() -> Any:
    """torch.utils.checkpoint's selective checkpointing: the ops of ``_kept_ops`` saved, the
    rest recomputed in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _kept_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in training: a dropout layer of p > 0, or a
    positive float attribute named for dropout (a Hugging Face attention's ``attention_dropout``
    or ``dropout``, the probability it passes to SDPA)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(v, float) and v > 0 for k, v in vars(m).items() if "dropout" in k):
            return True
    return False


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str = "full") -> None:
    """Each block's activations recomputed in backward instead of stored: all of them from the
    block's input (``full``), or all but its matmuls' and attention's outputs (``selective``).
    A block with dropout keeps the random generator's state for its recomputation, which then
    drops what the forward dropped (without, the gradient would be another mask's); a block
    without skips saving it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=has_dropout(block), **kwargs)


def apply_compile(model: nn.Module, blocks: nn.ModuleList | None, per_block: bool, tune: bool = False) -> None:
    """``Module.compile()`` compiles in place, so parameter names (and checkpoints) do not
    change. Per block under FSDP (identical blocks share one compiled graph), with the Inductor
    settings of ``compile_options`` for these graphs only."""
    options = compile_options(tune)
    if per_block and blocks is not None:
        for block in blocks:
            block.compile(options=options)
    else:
        model.compile(options=options)


def parallelize(model: nn.Module, cfg: TrainConfig, rt: Runtime, choice: Choice, accum: int, bf16: bool,
                weights: Pretrained | None = None) -> Layout:
    """Lay ``model`` out as ``choice`` says, on this rank's device; returns the layout, its
    optimizer built over the laid-out parameters. A model whose parameters are on the meta
    device is laid out first and filled after (``weights``: from those files, else a random
    initialisation; training/weights.py), so that no rank holds more of it than its layout needs."""
    kind = choice.kind
    deferred = on_meta(model)
    adapters = None
    if cfg.lora is not None:  # first: every step after sees the adapted layers (still on meta where it was)
        from .. import lora

        spec = lora.spec_of(cfg)
        model = lora.add_adapters(model, spec, cfg.source("lora_targets"))
        if not deferred:  # (a model filled after its layout gets them with its weights: Build._materialize)
            lora.init_adapters(model, cfg.seed)
        adapters = f"LoRA rank {spec.rank} on {len(lora.adapter_modules(model))} layers"
    found = find_blocks(model, cfg.blocks)
    blocks = found[1] if found else None
    zero3 = kind.engine is Engine.DEEPSPEED and kind.zero == 3  # its partitioned weights take the plain paths
    kernels = model.meshrun_kernels(rt.device, cfg.tp, cfg.pp) if isinstance(model, KernelModel) and not zero3 else []
    if choice.liger and not kernels:  # auto.decide plans ZeRO-3 without Liger, as it runs
        from ...kernels.liger import apply_liger

        kernels = apply_liger(model)
    elif choice.liger_loss and not kernels:  # compiled blocks, Liger's loss after them
        from ...kernels.liger import apply_liger

        kernels = apply_liger(model, loss_only=True)
    elif choice.hf_kernels and not kernels:  # (a model Liger does not know: kernels/hf.py)
        from ...kernels.hf import apply_hf_kernels

        kernels = apply_hf_kernels(model)
    float8, after_update = None, None
    if is_float8(cfg.precision):  # before any wrapper or compiling sees the linear layers
        float8, after_update = convert_float8(model, cfg.precision, fsdp=kind.fsdp is not None)
    settings = StepSettings(accum=accum, max_norm=cfg.grad_clip or float("inf"), device=rt.device,
                            loss_mode=loss_mode(model), attention=cfg.attention, after_update=after_update)
    if not deferred:
        model = model.to(rt.device)
    elif weights is None and cfg.init == "pretrained":
        raise MeshrunError("--init pretrained: no weight files were given for the model")
    if rt.world_size > 1:  # MoE load balancing over the global batch: any layout trains like one process
        for m in model.modules():
            if isinstance(m, ExpertModule):
                m.stats_group = dist.group.WORLD
    dims = layout_dims(cfg, kind, rt) if kind.engine != "deepspeed" else None
    build = Build(model, blocks, cfg, rt, choice, kind, bf16, settings, weights if deferred else None, deferred, dims)
    if adapters is not None:
        build.done.append(adapters)
    if kind.engine is Engine.DEEPSPEED:
        layout = build.deepspeed()
    elif cfg.ep > 1:
        layout = build.expert_parallel()
    elif cfg.pp > 1:
        layout = build.pipelined()
    else:
        layout = build.data_parallel()
    if kind.engine != "deepspeed":
        # long-lived allocations made before the first step, not between its large blocks
        create_state(layout.optimizer)
        take_blas_workspaces(rt.device)
    layout.description = ", ".join([layout.description, *kernels, *([float8] if float8 else [])])
    return layout


def layout_dims(cfg: TrainConfig, kind: StrategyKind, rt: Runtime) -> ParallelDims:
    """Every degree of this job's layout, built once (each sub-mesh comes from it): experts over
    ``--ep`` ranks; pipeline stages and tensor shards; or data parallelism, replicated across
    shard groups for FSDP2's hybrid and no-shard flavours, with tensor and context shards."""
    world = rt.world_size
    if cfg.ep > 1:
        return make_dims(world, ep=cfg.ep, source=f"--ep {cfg.ep} on {world} processes")
    if cfg.pp > 1:
        return make_dims(world, tp=cfg.tp, pp=cfg.pp,
                         source=" and ".join(f"--{k}={v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp)) if v > 1)
                         + f" on {world} processes")
    replicate = 1
    if kind.hybrid:
        shard = cfg.fsdp_shard_size or rt.local_world_size
        if world % shard:
            raise bad_value("--fsdp-shard-size", shard, f"does not divide the world size {world}",
                            "hybrid sharding needs equal shard groups")
        replicate = world // shard
    elif kind.uses_fsdp and kind.shard == "none":  # FSDP2 on a (world, 1) mesh: every rank a replica
        replicate = world
    return make_dims(world, dp_replicate=replicate, tp=cfg.tp, cp=cfg.cp,
                     source=f"--tp {cfg.tp} --cp {cfg.cp} on {world} processes")


class Build:
    """The steps of ``parallelize`` for each kind of layout, in the module's order."""

    def __init__(self, model: nn.Module, blocks: nn.ModuleList | None, cfg: TrainConfig, rt: Runtime,
                 choice: Choice, kind: StrategyKind, bf16: bool, settings: StepSettings,
                 weights: Pretrained | None, deferred: bool, dims: ParallelDims | None) -> None:
        self.model, self.blocks, self.cfg, self.rt = model, blocks, cfg, rt
        self._dims = dims
        self.weights, self.deferred = weights, deferred
        self.choice, self.kind, self.bf16, self.settings = choice, kind, bf16, settings
        self.compiled, self.tune = choice.compile, cfg.compile_tune
        self.bf16_reduce = cfg.reduce_precision == "bf16"
        self.done: list[str] = []

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:  # (a DeepSpeed engine lays itself out)
            raise MeshrunError(f"{self.kind.name}: DeepSpeed lays out its own engine, over no meshrun mesh")
        return self._dims

    def _materialize(self, module: nn.Module | None = None, optional: set[str] | None = None) -> None:
        """A model built on the meta device gets its storage and values here: after its
        sharding, where the layout shards it (``module``: the part of it this rank holds;
        ``optional``: parameters the weight files may lack, filled otherwise)."""
        if not self.deferred:
            return
        part = self.model if module is None else module
        materialize(part, self.rt.device, self.cfg.seed, self.weights, log=self.rt.is_main,
                    optional=optional or set(), whole=self.model)
        if self.cfg.lora is not None:  # after the weights or init_deterministic, which draws lora_B too
            from .. import lora

            lora.init_adapters(part, self.cfg.seed)
        self.deferred = False
        self.done.append("pretrained weights read" if self.weights else "initialised")

    def _same_weights(self) -> None:
        """Rank 0's initial weights on every rank before sharding; a model filled after its
        sharding gets the same weights everywhere by construction."""
        if not self.deferred:
            same_initial_weights(self.model)

    def _optimizer(self, module: nn.Module) -> Any:
        if self.kind.engine is Engine.TORCH and self.kind.offload_optimizer:
            from ..offload import build_offloaded

            self.done.append("AdamW's moments in host memory")
            return build_offloaded(module, self.cfg.lr, self.cfg.weight_decay)
        return build_optimizer(module, self.cfg.lr, self.cfg.weight_decay)

    def _quantize(self) -> None:
        """A LoRA run's frozen weights once filled, on layouts that hold them whole and compute
        under autocast (one process, DDP): --quantize nf4's adapted layers in NF4; else, in
        bf16, every frozen linear layer's weight in bf16 (quantize.py)."""
        if self.cfg.lora is None:
            return
        from ..quantize import describe, frozen_linears_to_bf16, quantize_base

        if self.cfg.quantize != "none":
            self.done.append(describe(*quantize_base(self.model)))
        elif self.bf16:
            self.done.append(f"frozen weights of {frozen_linears_to_bf16(self.model)} linear layers held in bf16")

    def _refuse_quantized(self, layout: str) -> None:
        """A layout that shards or partitions the weights, which does not know NF4 tensors
        (the strategies named so are refused before launch; here: one ``auto`` picked)."""
        if self.cfg.quantize != "none":
            raise bad_value(self.cfg.source("quantize"), self.cfg.quantize, f"does not combine with {layout} "
                            f"(--strategy {self.kind.name}): its sharding does not know NF4 weights",
                            "--strategy ddp (each rank holds the 4-bit base whole)")

    def _checkpointing(self) -> None:
        mode = self.choice.activation_checkpointing
        if mode != "none":
            checkpoint_blocks(self.blocks, mode)
            self.done.append(f"{mode} activation checkpointing")

    def _blocks_only(self) -> bool:
        """A Hugging Face model is compiled block by block on every layout, its own forward
        eager: under torch.compile (torch < 2.14) transformers builds the causal mask as a dense
        tensor instead of passing ``is_causal``, which rules out flash attention: a long-sequence
        float8 model compiled whole trained slower than bf16 eager (docs/decisions.md#compile)."""
        return is_transformers_model(self.model)

    def _compile(self, per_block: bool) -> None:
        if self.compiled:
            apply_compile(self.model, self.blocks, per_block=per_block, tune=self.tune)
            self.done.append(("compiled per block" if per_block and self.blocks is not None else "compiled")
                             + (", tuned" if self.tune else ""))

    def _tensor_parallel(self, meshes: Meshes, sequence_parallel: bool) -> bool:
        """Returns whether the loss is vocabulary-parallel."""
        from .tp import apply_loss_parallel, apply_tp, can_loss_parallel

        cfg = self.cfg
        if self.blocks is None:
            raise MeshrunError("--tp/--pp: no block list found in the model (hint: name it with --blocks)")
        loss_parallel = cfg.pp == 1 and can_loss_parallel(self.model)  # the tied rows sharded over TP
        what = f"tensor parallel {cfg.tp}"
        if apply_tp(self.blocks, meshes["tp"], sequence_parallel=sequence_parallel, gather_output=not loss_parallel):
            what += " (sequence parallel)"
            if cfg.seq % cfg.tp:  # (checked after the layout and the heads: those errors come first)
                raise bad_value(cfg.source("seq_len"), cfg.seq, f"does not split over --tp {cfg.tp} for sequence "
                                "parallelism", f"a multiple of {cfg.tp}, or --sequence-parallel off")
        if loss_parallel:
            apply_loss_parallel(self.model, meshes["tp"], sequence_parallel)
            what += " (loss parallel)"
        self.done.append(what)
        return loss_parallel

    def _attention(self, context_parallel: bool) -> None:
        """--document-mask on a GPU runs in FlexAttention's block masks (models/masks.py): for
        meshrun's GPT and under context parallelism by meshrun's own attention, for a Hugging
        Face model by transformers' flex_attention, which reads the documents from the
        restarting position ids. On the CPU the masks are dense. A Hugging Face model left on
        eager attention (no SDPA path: Gemma-2's soft-capping) runs in FlexAttention on a GPU
        with or without document masks (``masks.flex_for_eager``)."""
        from ...modelinfo.hf import flex_for_eager
        from ..models.masks import use_flex_in_transformers, uses_flex

        if not uses_flex(self.rt.device):
            return
        if not self.cfg.document_mask:
            if is_transformers_model(self.model) and not context_parallel and flex_for_eager(self.model):
                use_flex_in_transformers(self.model)
                self.done.append("FlexAttention (instead of eager attention)")
            return
        if is_transformers_model(self.model) and not context_parallel:
            try:
                use_flex_in_transformers(self.model)
            except (ValueError, ImportError) as exc:  # a family without it: transformers' dense mask
                self.done.append(f"document masks dense ({first_line(str(exc), 120)})")
                return
        self.done.append("document masks in FlexAttention")

    def data_parallel(self) -> Layout:
        """single, DDP or FSDP2 (with TP and CP inside)."""
        cfg, rt, kind, model = self.cfg, self.rt, self.kind, self.model
        flavour = kind.fsdp
        if flavour is None and (cfg.tp > 1 or cfg.cp > 1):
            raise MeshrunError(f"--strategy={kind.name}: tensor and context parallelism run with FSDP2")
        meshes, dp_rank, dp_size, loss_parallel, context = None, rt.rank, rt.world_size, False, None
        if flavour is not None:
            self._refuse_quantized("FSDP2")
            dims = self.dims
            meshes = dims.build(rt.device.type)
            dp_rank, dp_size = meshes.data_rank(), dims.dp
            self._same_weights()
            if cfg.tp > 1:
                loss_parallel = self._tensor_parallel(meshes, cfg.sequence_parallel)
            if cfg.cp > 1:
                from .context import apply_cp

                context = apply_cp(model, self.blocks, meshes["cp"].get_group(), cfg.cp,
                                    meshes["cp"].get_local_rank(), cfg.seq, rt.device)
                self.done.append(f"context parallel {cfg.cp} (zig-zag shards)")
        self._attention(context is not None)
        self._checkpointing()
        ddp = None
        if flavour is not None:
            from .fsdp import apply_fsdp

            self._compile(per_block=True)
            apply_fsdp(model, self.blocks, meshes.fsdp(), flavour, self.bf16, self.bf16_reduce)  # type: ignore[union-attr]
            ranks = dims.dp * cfg.cp
            self.done.append(f"FSDP2 {flavour} over {ranks} rank{'s' if ranks > 1 else ''}")
            self._materialize()
            wrapped: nn.Module = model
        elif kind.uses_ddp:
            from .ddp import apply_ddp, ddp_bucket_mb

            self._materialize()
            self._quantize()
            ddp = apply_ddp(model, rt, ddp_bucket_mb(cfg.ddp_bucket_mb, self.compiled, rt), self.bf16_reduce,
                            compiled=self.compiled)
            self.done.append(f"DDP, buckets of {ddp.bucket_bytes_cap // 2**20} MB")
            wrapped = ddp
            self._compile(per_block=self._blocks_only())  # after the wrap: the compiler sees DDP's buckets
        else:
            self._materialize()
            self._quantize()
            self._compile(per_block=self._blocks_only())
            wrapped = model
        fsdp_ranks = meshes.fsdp().size() if meshes is not None else 1
        return DataParallel(wrapped, self._optimizer(wrapped), ddp=ddp, fsdp=flavour, fsdp_ranks=fsdp_ranks,
                            context=context, cp=cfg.cp,
                            loss_parallel=loss_parallel, description=self._describe(), dp_rank=dp_rank,
                            dp_size=dp_size, autocast=self.bf16 and flavour is None, token_share=cfg.tp,
                            loss_ranks=rt.world_size, settings=self.settings)

    def pipelined(self) -> Layout:
        """Pipeline stages, tensor parallel inside, FSDP2 per stage over the data-parallel rest."""
        from .pipeline import Pipeline

        cfg, rt, model = self.cfg, self.rt, self.model
        if self.blocks is None:
            raise MeshrunError("--tp/--pp: no block list found in the model (hint: name it with --blocks)")
        dims = self.dims
        meshes = dims.build(rt.device.type, keep=("pp", "dp_shard", "tp"))
        self._same_weights()
        if cfg.tp > 1:  # sequence parallelism needs the whole block list in one piece: not here
            self._tensor_parallel(meshes, sequence_parallel=False)
        self._checkpointing()
        self._compile(per_block=True)
        pipe = Pipeline(model, meshes.world, cfg.pp_schedule, cfg.pp_microbatches or cfg.pp,
                        self.settings.accum, rt.device, cfg.seq,
                        ignore_last=self.settings.loss_mode.startswith("labels"))
        self.done.append(f"pipeline {cfg.pp} ({cfg.pp_schedule})")
        # Under TP every parameter must be a DTensor of one mesh (clipping, snapshots): FSDP2
        # over the data-parallel ranks even when there is one; under PP alone with one
        # data-parallel rank the stages stay plain modules.
        sharded = dims.tp > 1 or dims.dp_shard > 1
        if sharded:
            from .fsdp import apply_fsdp

            flavour = self.kind.fsdp or "full"
            for stage in pipe.stages:
                apply_fsdp(stage, nn.ModuleList(stage.stage_blocks()), meshes["dp_shard"], flavour, self.bf16,
                           self.bf16_reduce)
            self.done.append(f"FSDP2 {flavour} over {dims.dp_shard} data-parallel rank(s)")
        if self.deferred:  # this rank's stages only; the tied head's copy from the first stage
            head_elsewhere = pipe.tied_group is not None and pipe.last and not pipe.first
            self._materialize(pipe.union, optional={pipe.kind.HEAD} if head_elsewhere else set())
            pipe.share_tied_weight()
        return Pipelined(pipe.union, self._optimizer(pipe.union), pipe=pipe, sharded=sharded,
                         description=self._describe(), dp_rank=meshes["dp_shard"].get_local_rank(),
                         dp_size=dims.dp_shard, autocast=self.bf16 and not sharded, token_share=cfg.tp * cfg.pp,
                         loss_ranks=rt.world_size // cfg.pp, settings=self.settings)

    def expert_parallel(self) -> Layout:
        """Experts shared out over ep groups of consecutive ranks (rank 0's initial weights
        first); the rest replicated, or FSDP2-sharded over all ranks."""
        from .expert import is_expert, shard_experts

        cfg, rt, model, flavour = self.cfg, self.rt, self.model, self.kind.fsdp
        if self.deferred:
            raise MeshrunError(f"--ep={cfg.ep}: expert parallelism is built for meshrun's GPT with --experts "
                               "(hint: an FSDP2 strategy for this model)")
        dims = self.dims
        meshes = dims.build(rt.device.type)
        same_initial_weights(model)
        shard_experts(model, meshes["ep"].get_group(), cfg.ep)
        self.done.append(f"expert parallel {cfg.ep}")
        self._checkpointing()
        self._compile(per_block=True)
        if flavour is not None:  # every parameter but the experts (each rank's own)
            from .fsdp import apply_fsdp

            apply_fsdp(model, self.blocks, meshes.fsdp(), flavour, self.bf16, self.bf16_reduce,
                       ignored={p for n, p in model.named_parameters() if is_expert(n)})
            self.done.append(f"FSDP2 {flavour} over all {rt.world_size} ranks for the rest")
        else:
            self.done.append(f"data parallel over all {rt.world_size} ranks for the rest")
        # fused AdamW takes the tensors of a device and dtype in one call, and DTensor refuses
        # plain tensors beside its own there (the experts beside FSDP2's shards): build_optimizer
        # falls back to the unfused one then
        return ExpertParallel(model, self._optimizer(model), meshes=meshes, fsdp=flavour, world=rt.world_size,
                              description=self._describe(), dp_rank=rt.rank, dp_size=rt.world_size,
                              autocast=self.bf16, loss_ranks=rt.world_size, settings=self.settings)

    def deepspeed(self) -> Layout:
        from .deepspeed import deepspeed_engine

        cfg, rt, kind = self.cfg, self.rt, self.kind
        self._refuse_quantized("DeepSpeed")
        self._checkpointing()
        self._materialize()  # DeepSpeed partitions a whole model
        engine, optimizer = deepspeed_engine(self.model, kind, self.choice.micro_batch, self.settings.accum,
                                             rt.world_size, self.bf16, cfg.grad_clip, cfg.lr, cfg.weight_decay, rt.cuda)
        self.done.append(f"DeepSpeed ZeRO-{kind.zero}" + (f", {kind.offload} offloaded" if kind.offload != "none"
                                                          else ""))
        return DeepSpeedZeRO(engine, optimizer, description=self._describe(), dp_rank=rt.rank,
                             dp_size=rt.world_size, loss_ranks=rt.world_size, settings=self.settings)

    def _describe(self) -> str:
        return f"{self.kind.name}: " + " -> ".join(self.done) if self.done else self.kind.name
