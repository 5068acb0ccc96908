"""meshrun's GPT loss on CUDA: the head's matmul and the cross-entropy in one autograd
function whose forward also writes the logits' gradient, over the logits, in one Triton kernel.

Why: in the compiled GPT 124M step Inductor's two cross-entropy kernels take a sizeable share
of the step: the forward reads the 13.2-GB bf16 logits and writes an fp32 copy,
the backward reads it again. The loss is the last operation of the forward, so its gradient
with respect to the logits, ``softmax(logits) - onehot(target)``, is known there: one kernel
per row reads the logits, computes the row's log-sum-exp and loss, and writes that gradient
over them (the logits cross memory once each way). The backward only scales the two small
products by the incoming per-row gradient. Measured: a faster compiled GPT 124M step for a
little more peak memory (docs/decisions.md#head-loss).

Numerics: as ``F.cross_entropy(F.linear(h, weight).float(), targets)``: statistics and
gradient in fp32, the gradient rounded once to the logits' dtype; rows whose target is
``ignore_index`` count neither in the loss nor in the mean and get a zero gradient.

The kernel runs as an opaque custom op (``torch.library.custom_op``), so torch.compile calls
it from inside its graphs without a break. Without Triton or without a GPU, the function is
the plain expression. Tests run the kernel on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``) and compile it for sm_90; the kernel is in ``head_loss_triton.py``,
imported only where Triton is.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

BLOCK = 4096  # vocabulary entries per loop step: 16 per thread at 8 warps
# The head's matmuls run on a vocabulary padded to a multiple of this. An odd row count makes
# the logits' leading dimension unaligned and cuBLAS falls back to unvectorised kernels: GPT-2's
# 50,257 took 55% of a compiled 124M step in three such kernels, and padding to 50,304 made the
# step 1.7x faster (885 -> 509 ms, 1 x H200, torch 2.11; docs/decisions.md#vocab-padding).
VOCAB_ALIGN = 64


def padded_vocab(vocab: int) -> int:
    """The width the head's matmuls run at: ``vocab`` rounded up to a multiple of VOCAB_ALIGN."""
    return -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN


def register() -> dict[str, bool]:
    """Register the op (once) where Triton imports, and say on which device types it runs:
    a GPU, or the CPU under Triton's interpreter (how the tests run it). Called when a model
    that uses it is built, so that a compiled first step finds it registered."""
    if not _USABLE:
        cuda, cpu = torch.cuda.is_available(), os.environ.get("TRITON_INTERPRET") == "1"
        try:
            if cuda or cpu:  # (importing Triton where it cannot run slows a CPU run's start:
                # docs/decisions.md#direct-ranks)
                _register_ops()  # imports Triton
        except ImportError:
            cuda = cpu = False
        _USABLE.update(cuda=cuda, cpu=cpu)
    return _USABLE


_USABLE: dict[str, bool] = {}


@functools.lru_cache(maxsize=1)
def _register_ops() -> None:
    """Build the kernel and register the op once, on first use (Triton imported only then)."""
    from torch.library import custom_op, register_fake

    from .head_loss_triton import triton_ce_grad_forward

    # The rows' losses, and their gradient (for an incoming 1) written over the logits, in one
    # kernel. No autograd of its own: _HeadCrossEntropy's backward takes it from there.
    # The first ``vocab`` columns of each row only: the rest (padding) are left as they are.
    @custom_op("meshrun::cross_entropy_grad_", mutates_args=("logits",))
    def grad_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
        n = logits.shape[0]
        rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            triton_ce_grad_forward[(n,)](logits, logits.stride(0), targets, rows, vocab, ignore_index, BLOCK=BLOCK,
                                         num_warps=8)
        return rows

    @register_fake("meshrun::cross_entropy_grad_")
    def _grad_forward_shapes(logits, targets, ignore_index, vocab):
        return logits.new_empty(logits.shape[0], dtype=torch.float32)


class _HeadCrossEntropy(torch.autograd.Function):
    # The forward computes the logits, and one kernel reads them for the loss and writes over
    # them its gradient; the backward scales that gradient's two products (N x d and V x d,
    # small) by the incoming per-row gradient instead of scaling the (N, V) gradient itself.
    # A vocabulary that is not a multiple of VOCAB_ALIGN computes on a weight padded with zero
    # rows to one: the padded logits are exactly 0, the kernel reads and writes only the first
    # V of each row (its stride is the padded width), so their gradient stays 0 and adds
    # nothing to the input's; the weight's gradient is the first V rows.
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        vocab = w.shape[0]
        if vocab % VOCAB_ALIGN:
            w = torch.cat([w, w.new_zeros(padded_vocab(vocab) - vocab, w.shape[1])])
        logits = h @ w.t()
        rows = torch.ops.meshrun.cross_entropy_grad_(logits, targets, ignore_index, vocab)
        ctx.save_for_backward(h, w, logits, targets)  # the logits' memory holds their gradient now
        ctx.ignore_index, ctx.vocab = ignore_index, vocab
        return rows

    @staticmethod
    def backward(ctx, g_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w, dlogits, targets = ctx.saved_tensors
        # (N, 1): the mean's 1/N, or any per-row weights; an ignored row's is 0 whatever came
        # (with every row ignored the mean's 1/0 would make 0 * inf = nan of its zero gradient)
        s = torch.where(targets != ctx.ignore_index, g_rows.float(), 0.0).unsqueeze(1)
        dh = ((dlogits @ w).float() * s).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = (dlogits.t() @ (h.float() * s).to(h.dtype))[:ctx.vocab] if ctx.needs_input_grad[1] else None
        return dh, dw, None, None


def head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` (h: (tokens, d), weight: (vocab, d))
    against ``targets``, equal to ``F.cross_entropy(F.linear(h, weight).float(), targets)``,
    with the logits' gradient computed in the forward, over the logits: the (tokens, vocab)
    logits cross memory once each way (one kernel) instead of the three or four passes of a
    loss whose forward and backward each read them. The logits' memory is the gradient's, as
    for Inductor's own loss. Under autocast the matmul runs in its dtype. Without Triton or a
    GPU it is the plain expression."""
    if not torch.compiler.is_compiling():
        if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or targets.shape != h.shape[:1]:
            raise ValueError(f"head_cross_entropy: h {tuple(h.shape)}, weight {tuple(weight.shape)} and targets "
                             f"{tuple(targets.shape)}: expected (tokens, d), (vocab, d) and (tokens,)")
        register()
    dev = h.device.type
    if not _USABLE.get(dev, False) or h.shape[0] == 0:
        return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=ignore_index)
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    with torch.autocast(dev, enabled=False):
        rows = _HeadCrossEntropy.apply(h.to(dt), weight.to(dt), targets.contiguous(), ignore_index)
    counted = (targets != ignore_index).sum()
    return rows.sum() / counted  # no counted token: 0 / 0 = nan, as torch gives
