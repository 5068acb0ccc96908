"""Tensor parallelism (Megatron-style, with DTensor) for meshrun's GPT and Llama-style blocks,
with sequence parallelism between the tensor-parallel layers, and loss parallelism for
meshrun's GPT (the vocabulary sharded over the tensor-parallel ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...errors import bad_value
from ..models.hooks import FusedBlock


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
    if isinstance(block, FusedBlock):
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
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    families = {tp_family(b) for b in blocks}
    sp = sequence_parallel and len(families) == 1 and None not in families
    for block in blocks:
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
            # The gathered sequence copied: to_local() hands back a view of the DTensor's local
            # tensor, and FSDP2 (its hook runs after this one) hooks the block's backward on the
            # block's output, which an in-place op on a view would lose. One copy of the
            # hidden states, beside the all-gather of the same bytes.
            blocks[-1].register_forward_hook(lambda m, a, out: _map_first(out, lambda t: _relayout(
                t, tp_mesh, Shard(1), Replicate()).clone()))
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
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {"tok": RowwiseParallel(input_layouts=Replicate(),
                                                               output_layouts=Replicate())})
    model.head.weight = model.tok.weight  # re-tie: the head shares the now vocab-sharded rows
    plan: dict = {"head": PrepareModuleInput(input_layouts=(Shard(1) if sequence_parallel else Replicate(),),
                                             desired_input_layouts=(Replicate(),))}
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
