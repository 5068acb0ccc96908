"""Context parallelism: each rank of a ``cp`` group holds a shard of every sequence.

Sharding is zig-zag for causal balance: the sequence is cut into 2·cp chunks and rank r keeps
chunks r and 2·cp-1-r, so every rank has as many early (cheap) as late (expensive) query
positions. Attention all-gathers the keys and values of the group (autograd-aware: the
backward sums their gradients over the group), puts them back in sequence order, and masks by
true position. This is the all-gather form of ring attention: one collective per layer
instead of cp-1 ring steps, and a full K/V per rank (activation memory of the queries and
everything else stays 1/cp). Gradients are averaged over data- and context-parallel ranks
together (FSDP2 over both), which is the gradient of the mean over all tokens."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...errors import MeshrunError
from ..models import masks
from ..models.hf import check_whole_prefix, is_transformers_model
from ..models.hooks import FusedBlock, PositionedModel


def zigzag_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    if seq_len % (2 * cp):
        raise MeshrunError(f"--seq-len={seq_len}: context parallelism over {cp} ranks cuts sequences into "
                           f"{2 * cp} equal chunks (hint: a multiple of {2 * cp})")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence dimension (dim 2) over a group; backward all-reduces
    the gradient and keeps this rank's slice (all-reduce runs on gloo and NCCL alike; a
    reduce-scatter would move half the bytes on NCCL)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.n, dim=2)[ctx.rank].contiguous(), None


class ContextAttention:
    """The ``attend`` of a block under context parallelism.

    Each of this rank's two chunks (positions [a, a + c)) attends to the keys [0, a + c): a
    causal mask aligned to the lower right of that (c, a + c) block. torch's
    ``causal_lower_right`` lets SDPA run it with its fused kernels; a dense boolean mask over
    the whole sequence forces the masked kernel, which reads a (seq/cp) x seq mask per layer
    and runs several times slower per GPU than FSDP alone (docs/decisions.md#cp-causal-mask)."""

    def __init__(self, group: Any, cp: int, rank: int, seq_len: int, device: torch.device) -> None:
        self.group, self.cp = group, cp
        self.local = zigzag_index(seq_len, cp, rank).to(device)  # this rank's positions
        order = torch.cat([zigzag_index(seq_len, cp, r) for r in range(cp)])
        self.unshuffle = torch.argsort(order).to(device)  # gathered order -> sequence order
        from torch.nn.attention.bias import causal_lower_right

        c = seq_len // (2 * cp)
        self.chunk = c
        ends = ((rank + 1) * c, (2 * cp - rank) * c)  # where each of the two chunks ends
        # built here, not per call: torch.compile cannot trace their construction (a graph break)
        self.masks = [(end, causal_lower_right(c, end)) for end in ends]
        self.documents: list[masks.Mask] | None = None  # this step's, with --document-mask

    def set_documents(self, positions: torch.Tensor | None) -> None:
        """The document masks of the next forward (``--document-mask``): ``positions`` are the
        whole sequences' position ids, which every rank of the group has; each chunk's mask
        is its queries' true positions against the keys before them (None: causal only)."""
        if positions is None:
            self.documents = None
            return
        docs = masks.document_ids(positions)
        self.documents = [masks.build(docs, end - self.chunk, self.chunk, end) for end, _ in self.masks]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                 dropout: float = 0.0) -> torch.Tensor:
        k_all = _GatherSeq.apply(k, self.group)[:, :, self.unshuffle]
        v_all = _GatherSeq.apply(v, self.group)[:, :, self.unshuffle]
        if k_all.shape[1] != q.shape[1]:  # grouped-query attention: gathered with its fewer heads, then repeated
            k_all = k_all.repeat_interleave(q.shape[1] // k_all.shape[1], dim=1)
            v_all = v_all.repeat_interleave(q.shape[1] // v_all.shape[1], dim=1)
        c = self.chunk
        if self.documents is not None:
            out = [masks.attend(q[:, :, i * c:(i + 1) * c], k_all[:, :, :end], v_all[:, :, :end], doc_mask,
                                scale=scale, dropout=dropout)
                   for i, ((end, _), doc_mask) in enumerate(zip(self.masks, self.documents))]
            return torch.cat(out, dim=2)
        out = [F.scaled_dot_product_attention(q[:, :, i * c:(i + 1) * c], k_all[:, :, :end], v_all[:, :, :end],
                                              attn_mask=mask, dropout_p=dropout, scale=scale)
               for i, (end, mask) in enumerate(self.masks)]
        return torch.cat(out, dim=2)

    def transformers_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature: (batch, heads, seq, dim) in, (batch,
        seq, heads, dim) out. The mask is ignored: it is causal by true position here."""
        return self(query, key, value, scale=scaling, dropout=dropout).transpose(1, 2).contiguous(), None


NAME = "meshrun_cp"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _check_transformers_model(model: nn.Module, seq_len: int) -> None:
    import inspect

    check_whole_prefix(model, seq_len, "--cp")
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params or not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise MeshrunError(f"--cp: {type(model).__name__}.forward takes no position_ids and loss arguments "
                           "(hint: FSDP2 without --cp)")


def _use_in_transformers(model: nn.Module, attention: ContextAttention, seq_len: int) -> None:
    from transformers import AttentionInterface

    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise MeshrunError("--cp with a Hugging Face model needs transformers' attention-mask interface "
                           "(hint: pip install 'transformers>=4.53')") from None
    _check_transformers_model(model, seq_len)
    AttentionInterface.register(NAME, attention.transformers_attention)
    AttentionMaskInterface.register(NAME, _no_mask)  # the mask is the attention's own: none built per layer
    model.config._attn_implementation = NAME  # type: ignore[attr-defined]


def apply_cp(model: nn.Module, blocks: nn.ModuleList, group: Any, cp: int, rank: int, seq_len: int,
             device: torch.device) -> ContextAttention:
    """Give every block the context-parallel attention (meshrun's GPT: this rank's positions
    too; a Hugging Face model takes them as ``position_ids`` from the layout); returns it:
    its ``local`` is the index of this rank's tokens in a full sequence (to shard the
    batches), its ``set_documents`` takes each step's document positions."""
    gpt = isinstance(model, PositionedModel) and all(isinstance(b, FusedBlock) for b in blocks)
    if not gpt and not is_transformers_model(model):
        raise MeshrunError(f"--cp: context parallelism needs meshrun's GPT or a Hugging Face model, not "
                           f"{type(model).__name__} (hint: --tp or FSDP2 for this model)")
    attention = ContextAttention(group, cp, rank, seq_len, device)
    if gpt:
        for block in blocks:
            block.attend = attention
        model.positions = attention.local
    else:
        _use_in_transformers(model, attention, seq_len)
    return attention
