"""meshrun's GPT: a GPT-2-style decoder, the built-in job's and the benchmarks' model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...modelinfo.spec import attention_flops
from ...vocab import GPT_PRESETS
from ..loaded import is_dtensor
from . import masks


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50304  # 50257 rounded up to a multiple of 64 for tensor-core-friendly shapes
    seq_len: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_experts: int = 0  # > 0: a mixture-of-experts MLP in every block (models/moe.py)
    top_k: int = 2
    aux_coef: float = 0.01  # weight of the load-balancing loss
    # Under autocast, keep the residual stream in the compute dtype (bf16) rather than fp32.
    low_precision_residual: bool = True
    # The loss from the last hidden states in token chunks, the logits never held whole
    # (models/losses.py): for long sequences, where the logits are most of the memory. Off by
    # default: compiled at 1024 tokens it is slower than F.cross_entropy over the whole
    # logits, which Inductor fuses well (docs/decisions.md#chunked-loss).
    fused_loss: bool = False
    # The head's matmul and the loss in one function whose forward writes the logits' gradient
    # over them (kernels/head_loss.py, one Triton kernel): on CUDA with Triton; elsewhere the
    # plain expression. docs/decisions.md#head-loss
    head_loss: bool = True
    # The MLP's GELU in cuBLASLt's matmul epilogues (kernels/fused_mlp.py, nvmath-python):
    # "auto", where it runs (CUDA with nvmath-python installed), else the plain MLP; True, the
    # ops everywhere (their plain-torch path where the epilogues cannot run: what the CPU tests
    # use); False, the plain MLP. docs/decisions.md#gelu-epilogues
    fused_mlp: bool | str = "auto"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.n_experts:
            from .moe import MoE

            self.moe = MoE(cfg.d_model, cfg.n_experts, cfg.top_k)
        else:
            self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
            self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.fused_mlp, self.mlp_cuda_only = _mlp_way(cfg)  # (whether to use it, only on CUDA)

    # (b, heads, t, head_dim) for SDPA, which picks flash/memory-efficient kernels on GPU.
    # Context parallelism replaces this on the instance (parallel/context.py).
    attend = staticmethod(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def forward(self, x: torch.Tensor, mask: masks.Mask = None) -> torch.Tensor:
        # n_heads is this rank's share under tensor parallelism, hence the inferred widths; the
        # length comes from qkv's output, which is the whole sequence also when sequence
        # parallelism hands this block a shard of it. ``mask``: which keys each query may see
        # (document masking; models/masks.py), else causal.
        qkv = self.qkv(self.ln1(x))
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).unbind(2)
        if mask is None:
            y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        else:
            y = masks.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        if hasattr(self, "moe"):
            return x + self.moe(self.ln2(x))
        # the op takes whole weights, not TP's shards or ZeRO-3's partitions
        if self.fused_mlp and (x.is_cuda or not self.mlp_cuda_only) and not _sharded(self.up.weight):
            from ...kernels.fused_mlp import gelu_mlp

            return x + gelu_mlp(self.ln2(x), self.up, self.down)
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


def _mlp_way(cfg: GPTConfig) -> tuple[bool, bool]:
    """GPTConfig.fused_mlp resolved: (use the fused MLP, only on CUDA)."""
    how = cfg.fused_mlp
    if cfg.n_experts or how is False:
        return False, False
    if how == "auto":  # nvmath-python imported here only where it is installed
        from ...kernels.fused_mlp import available

        return cfg.d_model % 8 == 0 and available(), True
    if how is True:
        return True, False
    raise ValueError(f"GPTConfig.fused_mlp {how!r}: expected True, False or 'auto'")


def _sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is not whole where its module's forward is not called: a tensor-parallel
    DTensor, or a DeepSpeed ZeRO-3 parameter (``ds_id``), which only its own module's hooks
    gather. The fused MLP and the head loss use the weights without calling their Linear.

    (Asked without importing DTensor, which would cost a run's first forward its import:
    ``loaded``, docs/decisions.md#no-compiler-import.)"""
    return is_dtensor(p) or hasattr(p, "ds_id")


class GPT(nn.Module):
    """Learned positions, pre-LayerNorm blocks, GELU MLP 4x, tied input/output embeddings.

    ``forward(idx, targets)`` returns the mean cross-entropy (computed in fp32) so that the
    trainer never holds a second copy of the logits; without targets it returns logits.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.head_loss:  # registered before any compiled step traces the loss
            from ...kernels.head_loss import register

            register()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.positions: torch.Tensor | None = None  # set under context parallelism
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):  # GPT-2's scaled residual init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The loss against ``targets`` (ignoring -100), else the logits. ``positions``: each
        token's position in its document (document masking): attention stays within documents."""
        t = idx.shape[1]
        mask = None
        documents = positions is not None
        if self.positions is not None:
            # under context parallelism this rank holds a shard: its true positions, or with
            # documents their positions in them (the context-parallel attention holds the mask)
            positions = self.positions if positions is None else positions
        elif positions is not None:
            mask = masks.build(masks.document_ids(positions))
        else:
            positions = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        dev = x.device.type
        if self.cfg.low_precision_residual and torch.is_autocast_enabled(dev):
            # The residual stream in the compute dtype, as FSDP2's bf16 parameters keep it:
            # otherwise type promotion keeps it fp32 (the embeddings are fp32 under autocast)
            # and every norm and residual add moves twice the bytes. Norms still compute in
            # fp32 (autocast upcasts layer_norm); the loss is taken in fp32 below.
            x = x.to(torch.get_autocast_dtype(dev))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        h = self.ln_f(x)
        # the chunked loss first: asked for, it is for logits too large to hold whole
        if targets is not None and self.cfg.fused_loss and not _sharded(self.head.weight):
            from .losses import linear_cross_entropy

            loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.head.weight, targets.reshape(-1))
            return self._with_aux(loss)
        if targets is not None and self.cfg.head_loss and not documents and not _sharded(self.head.weight):
            from ...kernels.head_loss import head_cross_entropy

            return self._with_aux(head_cross_entropy(h.reshape(-1, h.shape[-1]), self.head.weight,
                                                     targets.reshape(-1)))
        logits = self.head(h)
        # Under loss parallelism (parallel/tp.py) the logits are a DTensor sharded over
        # the vocabulary: the loss is reduced across tensor-parallel ranks inside torch's
        # loss_parallel(), and logits asked for are gathered.
        sharded = hasattr(logits, "full_tensor")
        if targets is None:
            return logits.full_tensor() if sharded else logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        if sharded:
            # full_tensor hands back a view of the DTensor's local tensor; a copy of the scalar
            # instead, so the model returns no view: FSDP2 hooks its backward on the output,
            # and an in-place op on a returned view would lose that hook
            loss = loss.full_tensor().clone()
        return self._with_aux(loss)

    def meshrun_kernels(self, device: torch.device, tp: int = 1, pp: int = 1) -> list[str]:
        """meshrun's own kernels this model runs on ``device`` (the trainer's strategy line says so):
        none of them on tensor-parallel shards, and no loss of its own under pipelining (the
        schedule takes the loss)."""
        if device.type != "cuda" or tp > 1:
            return []
        out = []
        if self.cfg.head_loss and not self.cfg.fused_loss and pp == 1:
            from ...kernels.head_loss import register

            if register().get("cuda"):
                out.append("loss with its gradient in the forward (Triton)")
        if any(getattr(b, "fused_mlp", False) for b in self.blocks):
            out.append("MLP's GELU in cuBLASLt epilogues")
        return out

    def _with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        if self.cfg.n_experts:
            loss = loss + self.cfg.aux_coef * sum(b.moe.aux for b in self.blocks)
        return loss

    def flops_per_token(self) -> float:
        """6N + 12·L·d·T: the forward+backward FLOPs per token (N = all parameters, tied
        counted once), PaLM's MFU convention, which the benchmarks use. With experts, N counts
        the top-k experts a token visits, not all of them (as the planner does)."""
        n = sum(p.numel() for p in self.parameters())
        for block in self.blocks:
            moe = getattr(block, "moe", None)
            if moe is not None:  # held: all experts, or this rank's under --ep
                held = sum(p.numel() for p in (moe.w_up, moe.b_up, moe.w_down, moe.b_down))
                n -= held - held // len(moe.w_up) * moe.top_k
        return 6 * n + attention_flops(self.cfg.n_layers, self.cfg.d_model, self.cfg.seq_len)


def gpt(preset: str = "gpt-small", seq_len: int = 256, vocab: int = 50304, n_experts: int = 0,
        fused_loss: bool = False, fused_mlp: bool | str = GPTConfig.fused_mlp,
        head_loss: bool = GPTConfig.head_loss) -> GPT:
    """A GPT of one of vocab.GPT_PRESETS' sizes."""
    p = GPT_PRESETS[preset]
    return GPT(GPTConfig(vocab=vocab, seq_len=seq_len, d_model=p.d_model, n_layers=p.n_layers, n_heads=p.n_heads,
                         n_experts=n_experts, fused_loss=fused_loss, fused_mlp=fused_mlp, head_loss=head_loss))
