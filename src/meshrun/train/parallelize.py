"""Parallelisms as plain functions, applied in one fixed order (torchtitan's):

    tensor parallel -> activation checkpointing -> compile -> data-parallel wrap (DDP or FSDP2)

Tensor parallelism rewrites the blocks' Linear layers into DTensor shards first, on the raw
modules (checkpoint wrappers would change their paths);
Checkpointing wraps each block first so that compile sees (and FSDP shards) the wrapped
blocks; compile comes before the FSDP wrap so each block compiles as a unit and FSDP's
hooks stay outside the graph; DDP is compiled after wrapping so its bucketing is visible
to the compiler (DDPOptimizer splits the graph at bucket boundaries to overlap all-reduces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import bad_value
from .runtime import Runtime

# Where common model families keep their list of repeated blocks.
BLOCK_PATHS = ("blocks", "layers", "h", "transformer.h", "transformer.blocks", "model.layers",
               "model.decoder.layers", "gpt_neox.layers", "decoder.layers", "encoder.layers")


def _attr_path(model: nn.Module, path: str) -> object:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_blocks(model: nn.Module, override: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's repeated blocks (the units to shard and to checkpoint), or None."""
    if override:
        blocks = _attr_path(model, override)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise bad_value("--blocks", override, "does not name a non-empty ModuleList of the model",
                            "give the attribute path of the block list, e.g. model.layers")
        return override, blocks  # type: ignore[return-value]
    for path in BLOCK_PATHS:
        blocks = _attr_path(model, path)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return path, blocks
    lists = [(sum(p.numel() for p in m.parameters()), name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1]
    if lists:
        _, name, m = max(lists, key=lambda t: t[0])
        return name, m
    return None


class SplitQKV(nn.Module):
    """A fused q/k/v projection split into three Linears with the same weights, so each can
    be sharded by heads (a column shard of the fused (3h, h) weight would hand rank 0 all of
    q and half of k). The forward returns the same concatenation as the fused layer."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        h = fused.out_features // 3
        self.q, self.k, self.v = (nn.Linear(fused.in_features, h, bias=fused.bias is not None,
                                            device=fused.weight.device, dtype=fused.weight.dtype) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(fused.weight[i * h:(i + 1) * h])
                if fused.bias is not None:
                    lin.bias.copy_(fused.bias[i * h:(i + 1) * h])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


# Module paths inside one block -> sharding, per model family: column-wise into the block,
# row-wise out of it, so each block costs one all-reduce in attention and one in the MLP.
TP_PLANS = {
    "meshrun-gpt": {"qkv.q": "col", "qkv.k": "col", "qkv.v": "col", "proj": "row", "up": "col", "down": "row"},
    "llama": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
              "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}


def tp_family(block: nn.Module) -> str | None:
    if all(hasattr(block, n) for n in ("qkv", "proj", "up", "down", "n_heads")):
        return "meshrun-gpt"
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if attn is not None and mlp is not None and hasattr(attn, "q_proj") and hasattr(mlp, "gate_proj"):
        return "llama"
    return None


def apply_tp(blocks: nn.ModuleList, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
             gather_output: bool = True) -> bool:
    """Megatron-style tensor parallelism with DTensor: q/k/v and MLP-in column-wise (each rank
    its heads / its slice of the hidden layer), attention-out and MLP-out row-wise. Embeddings
    and the final norm and head stay replicated.

    ``sequence_parallel`` (meshrun's GPT): between the attention and MLP the residual stream
    stays sharded along the sequence, so LayerNorms run on 1/tp of the tokens and keep 1/tp of
    the activations; each all-reduce becomes a reduce-scatter after the row-wise layer and an
    all-gather before the column-wise ones (the same bytes). The block list takes the whole
    sequence and returns it whole: the first block keeps its shard of the sequence (a slice, no
    traffic), the last gathers it (unless ``gather_output`` is off: apply_loss_parallel's final
    norm takes the shards). The same for Llama-style HF blocks (their two RMSNorms). Returns
    whether sequence parallelism was applied (not for a mix of block kinds)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    families = {tp_family(b) for b in blocks}
    sp = sequence_parallel and len(families) == 1 and None not in families
    for i, block in enumerate(blocks):
        family = tp_family(block)
        if family is None:
            raise bad_value("--tp", tp, f"no tensor-parallel plan for block {type(block).__name__}",
                            "meshrun's GPT and Llama-style blocks (q/k/v/o_proj, gate/up/down_proj) have one")
        if family == "meshrun-gpt":
            if block.n_heads % tp:
                raise bad_value("--tp", tp, f"the model's {block.n_heads} attention heads do not split over {tp} ranks",
                                f"a --tp that divides {block.n_heads}")
            if isinstance(block.qkv, nn.Linear):
                block.qkv = SplitQKV(block.qkv)
            block.n_heads //= tp  # the heads this rank computes
        plan = {path: ColwiseParallel() if kind == "col" else RowwiseParallel()
                for path, kind in TP_PLANS[family].items()}
        if sp and family == "llama":
            _llama_sequence_parallel(block, tp_mesh, plan)
        elif sp:
            seq = Shard(1)
            plan.update({
                "ln1": SequenceParallel(), "ln2": SequenceParallel(),
                # one all-gather of the normed tokens for q, k and v together
                "qkv": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "proj": RowwiseParallel(output_layouts=seq), "down": RowwiseParallel(output_layouts=seq),
                "up": ColwiseParallel(input_layouts=seq),
            })
        parallelize_module(block, tp_mesh, plan)
    if sp:  # hooks, not PrepareModuleInput: HF passes the hidden states positionally or by name
        _on_hidden_states(blocks[0], lambda t: _relayout(t, tp_mesh, Replicate(), Shard(1)))
        if gather_output:
            blocks[-1].register_forward_hook(lambda m, a, out: _map_first(out, lambda t: _relayout(
                t, tp_mesh, Shard(1), Replicate())))
    return sp


def _relayout(t: torch.Tensor, mesh: DeviceMesh, src: Any, dst: Any) -> torch.Tensor:
    """A plain tensor laid out as ``src`` over the TP ranks, returned as ``dst`` (slice,
    all-gather), differentiably (the backward is the opposite collective)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()


def _map_first(out: Any, fn: Any) -> Any:
    """Apply ``fn`` to a module's output, or to the first element of a tuple output."""
    if isinstance(out, tuple):
        return (fn(out[0]), *out[1:])
    return fn(out)


def _on_hidden_states(module: nn.Module, fn: Any) -> None:
    """Re-lay a module's hidden-states input, given first positionally or as ``hidden_states=``."""
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        return args, kwargs
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _llama_sequence_parallel(block: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Sequence parallelism for an HF Llama-style decoder layer: its two RMSNorms run on the
    sequence shard; attention and MLP all-gather their input (the rotary embeddings and the
    causal mask are for the whole sequence, so attention sees all of it) and reduce-scatter
    their output back onto the shard, where the residual adds happen."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    plan.update({"input_layernorm": SequenceParallel(use_local_output=True),
                 "post_attention_layernorm": SequenceParallel(use_local_output=True),
                 "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                 "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    gather = lambda t: _relayout(t, tp_mesh, Shard(1), Replicate())  # noqa: E731
    _on_hidden_states(block.self_attn, gather)
    _on_hidden_states(block.mlp, gather)


def can_loss_parallel(model: nn.Module) -> bool:
    """meshrun's GPT: a token embedding tied to a bias-free head, a final norm."""
    tok, head = getattr(model, "tok", None), getattr(model, "head", None)
    return (isinstance(tok, nn.Embedding) and isinstance(head, nn.Linear) and head.bias is None
            and head.weight is tok.weight and isinstance(getattr(model, "ln_f", None), nn.LayerNorm))


def apply_loss_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Loss parallelism for meshrun's GPT: the tied embedding/head weight sharded over the
    vocabulary (each TP rank holds vocab/tp rows), so the head writes vocab/tp logits per
    token and the cross-entropy is reduced across ranks (torch's ``loss_parallel``) instead
    of every rank holding all the logits, which at vocab 50304 are the largest activation.
    The embedding lookup becomes a masked lookup plus an all-reduce. Forward and backward
    must run inside ``loss_parallel()`` (the trainer does). With sequence parallelism the
    final norm runs on the sequence shard and the head gathers it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    parallelize_module(model, tp_mesh, {"tok": RowwiseParallel(input_layouts=Replicate(),
                                                               output_layouts=Replicate())})
    model.head.weight = model.tok.weight  # re-tie: the head shares the now vocab-sharded rows
    plan: dict = {"head": PrepareModuleInput(input_layouts=(Shard(1) if sequence_parallel else Replicate(),),
                                             desired_input_layouts=(Replicate(),))}
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)


def apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def compile_options(tune: bool) -> dict[str, bool]:
    """``torch.compile(options=...)`` for ``--compile-tune``: Inductor's coordinate-descent
    search of its Triton kernels' block sizes; empty without it.

    Measured (H200, torch 2.11, docs/benchmarks.md): at GPT 124M +1.0-1.9% on one GPU (calls E,
    AK, AX) and +1.0% on four (AU, AY); at 1.3B +0.7% on one (AM) and +0.3% on four (AW); for
    ~4 minutes more compiling (a minute from Inductor's cache): not a default, a short run loses
    more than it gains. Max-autotune matmuls were tried with it (calls AK, AQ, AS) and
    are left out: cuBLAS beat every Triton template at these shapes, the only other winners
    being split-K weight gradients worth ~0.1% of the step, and they cost ~100 s more compiling
    and a 12 GiB transient at the first step (ATen's candidates are benchmarked in the training
    process, the tied head's with a logits-sized output)."""
    return {"coordinate_descent_tuning": True} if tune else {}


def apply_compile(model: nn.Module, blocks: nn.ModuleList | None, per_block: bool, tune: bool = False) -> None:
    """``Module.compile()`` compiles in place, so parameter names (and checkpoints) do not
    change. Per block under FSDP (identical blocks share one compiled graph). ``tune``: the
    Inductor settings of ``compile_options``, for these graphs only."""
    options = compile_options(tune)
    kwargs = {"options": options} if options else {}
    if per_block and blocks is not None:
        for block in blocks:
            block.compile(**kwargs)
    else:
        model.compile(**kwargs)


DDP_BUCKET_MB = 100  # eager: 6% over torch's 25 MB (docs/benchmarks.md, call C)
DDP_COMPILED_BUCKET_MB = 1000


def ddp_bucket_mb(requested: int | None, compiled: bool, rt: Runtime) -> int:
    """DDP's gradient bucket size: the user's; else 1000 MB when the model is compiled and every
    rank is on one host; else 100 MB.

    Why: compiled, Dynamo cuts DDP's graph at every bucket boundary so that a bucket's
    all-reduce starts while the backward goes on; Inductor then cannot fuse across the cuts.
    On one host the all-reduce of what the larger buckets leave exposed costs less than the
    cuts: +0.7% to +1.4% in five measurements (GPT 124M and 1.3B, 4 x H200, calls E, G, AD, AF,
    AL in docs/benchmarks.md). Across hosts the network is 10-100x slower than NVLink and the
    overlap is worth more than the fusion, and eager DDP has no graph to cut. Capped at
    1000 MB, the size measured: DDP allocates its buckets again at the second step, so a
    bucket is also a transient allocation."""
    if requested is not None:
        return requested
    if compiled and rt.local_world_size == rt.world_size:
        return DDP_COMPILED_BUCKET_MB
    return DDP_BUCKET_MB


def apply_ddp(model: nn.Module, rt: Runtime, bucket_mb: int, bf16_reduce: bool = False) -> DDP:
    """``bf16_reduce`` all-reduces gradients in bf16 (half the bytes; the sum of N bf16 values
    loses precision, so it is opt-in)."""
    if bf16_reduce and not rt.cuda:
        raise bad_value("--reduce-precision", "bf16", "DDP's bf16 reduction needs NCCL (GPUs)", "use fp32 on CPU")
    ddp = DDP(model, device_ids=[rt.local_rank] if rt.cuda else None, gradient_as_bucket_view=True,
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
    back to the driver. Measured (issue 5, GPT 1.3B DDP, micro-batch 16, 2 x H200): 0.6 GiB
    less reserved at the peak (60.7 vs 61.3 GiB)."""
    def after_rebuild(module: nn.Module, args: Any) -> None:
        if getattr(ddp, "_has_rebuilt_buckets", True):
            torch.cuda.empty_cache()
            ddp.released_old_buckets = True
            handle.remove()

    ddp.released_old_buckets = False
    handle = ddp.module.register_forward_pre_hook(after_rebuild)


def choose_fsdp_flavour(requested: str, rt: Runtime, n_params: int) -> tuple[str, str]:
    """``auto``: keep parameters gathered from forward to backward (grad_op, ZeRO-2) when a
    whole bf16 copy of them takes under a tenth of the GPU: it saves one all-gather per block
    per step (measured +5% at 1.3B on H200), at the cost of that copy; else full shard."""
    if requested != "auto":
        return requested, "requested"
    if rt.cuda:
        total = torch.cuda.get_device_properties(rt.device).total_memory
        if 2 * n_params < 0.1 * total:
            return "grad_op", "a bf16 copy of the parameters fits in a tenth of the GPU"
        return "full", "parameters too large to keep gathered"
    return "full", "CPU"


@dataclass(frozen=True)
class FSDPPlan:
    flavour: str  # full | grad_op | hybrid | no_shard
    shard_size: int  # ranks per shard group (hybrid); world for full/grad_op; 1 for no_shard


def fsdp_mesh(rt: Runtime, plan: FSDPPlan) -> DeviceMesh:
    if plan.flavour in ("full", "grad_op"):
        return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("shard",))
    if rt.world_size % plan.shard_size:
        raise bad_value("--fsdp-shard-size", plan.shard_size, f"does not divide the world size {rt.world_size}",
                        "hybrid sharding needs equal shard groups")
    return init_device_mesh(rt.device.type, (rt.world_size // plan.shard_size, plan.shard_size),
                            mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList | None, mesh: DeviceMesh, plan: FSDPPlan,
               bf16: bool, bf16_reduce: bool = False, ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2: ``fully_shard`` each block, then the root (embeddings, final norm, head).

    full     params, grads and optimizer state sharded; params resharded after forward (ZeRO-3)
    grad_op  params stay unsharded between forward and backward (ZeRO-2 equivalent)
    hybrid   a 2-D mesh: replicate across groups (nodes), shard within (HSDP)
    no_shard a (world, 1) mesh: every rank holds everything (DDP equivalent, for comparison)

    ``ignored``: parameters left unsharded and unreduced (the caller reduces their gradients).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reduce = torch.bfloat16 if bf16_reduce else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    if ignored:  # parameters FSDP must leave alone (each rank's own experts under --ep)
        import inspect

        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise bad_value("--ep", "with --strategy fsdp", f"needs torch >= 2.7 (this is {torch.__version__})",
                            "--strategy ddp, or a newer torch")
        kwargs["ignored_params"] = ignored
    reshard = plan.flavour != "grad_op"
    if blocks is not None:
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them.
            fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)


# Above this size FSDP2 beat DDP in our runs even when a replica fits (GPT 1.3B on 4 x H200,
# bf16, compiled, micro-batch 16: FSDP2 59.3K tokens/s/GPU and 37 GiB vs DDP 58.0K and
# 51 GiB; docs/benchmarks.md): bf16 all-gathers plus a reduce-scatter move no more bytes
# than DDP's fp32 all-reduce, and the sharded optimizer step is 4x smaller per GPU.
FSDP_FROM_PARAMS = 1_000_000_000


def choose_strategy(requested: str, rt: Runtime, n_params: int) -> tuple[str, str]:
    """(strategy, reason). ``auto``: one process -> single; on GPUs, FSDP (full shard) from a
    billion parameters or when a DDP replica with AdamW state (16 bytes per parameter) would
    take more than half the GPU, else DDP."""
    if requested == "single" and rt.world_size > 1:
        raise bad_value("--strategy", "single", f"runs one process, but the world has {rt.world_size}",
                        "use --nproc 1, or --strategy ddp/fsdp")
    if requested != "auto":
        return requested, "requested"
    if rt.world_size == 1:
        return "single", "one process"
    if not rt.cuda:
        return "ddp", "CPU: memory is not the constraint"
    total = torch.cuda.get_device_properties(rt.device).total_memory
    need = 16 * n_params
    if need >= 0.5 * total:
        return "fsdp", f"a replica with AdamW state needs {need / 2**30:.1f} GiB: too much to replicate"
    if n_params >= FSDP_FROM_PARAMS:
        return "fsdp", f"{n_params / 1e9:.1f}B parameters: FSDP2 was faster than DDP at this size"
    return "ddp", f"a replica with AdamW state needs {need / 2**30:.1f} GiB of {total / 2**30:.0f} GiB"
