"""The attention's q, k, v projection as three matmuls with dense outputs (``GPTConfig.split_qkv``).

Why: with one fused (d -> 3d) projection, q, k and v are strided views of one (tokens, 3d)
tensor. cuDNN's attention backward allocates dq, dk and dv like its inputs (``empty_like``),
which for such non-dense views means contiguous (batch, heads, tokens, head_dim) tensors; the
projection's backward then needs them back in one (tokens, 3d) tensor, and Inductor writes it
with a stack-and-transpose kernel that moves 1.2 GB per layer at the 124M shapes, and sums the
bias gradient in another pass: 5.4 ms of a 219-ms step on one H200 (2.4%; sixteenth session,
call BP's profile).

Here q, k and v each come from their own third of the same weight and bias (the parameters, so
the state dict, are unchanged), so each is a dense (tokens, d) tensor; cuDNN's gradients then
come out in the (batch, tokens, heads, head_dim) order the projection reads, with no copy. The
input gradient ``dq @ Wq + dk @ Wk + dv @ Wv`` is one matmul and two that accumulate into its
output in place (cuBLAS's beta = 1, in the custom op ``meshrun::qkv_input_grad``, opaque to
Inductor, which would otherwise write three products and add them in a fourth pass).

The same functions run on every device; the model uses them where the attention is cuDNN's
or flash's (CUDA) unless told otherwise, and the tests check them on the CPU against the fused
projection.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _register_ops() -> None:
    from torch.library import custom_op, register_fake

    @custom_op("meshrun::qkv_input_grad", mutates_args=())
    def input_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dq @ w[:d] + dk @ w[d:2d] + dv @ w[2d:]`` (w is the fused (3d, d) weight): the second
        and third products accumulate into the first's output (no separate sum)."""
        d = dq.shape[1]
        dx = torch.mm(dq, w[:d])
        dx.addmm_(dk, w[d:2 * d])
        dx.addmm_(dv, w[2 * d:])
        return dx

    @register_fake("meshrun::qkv_input_grad")
    def _input_grad_shape(dq, dk, dv, w):
        return dq.new_empty(dq.shape[0], w.shape[1])


_register_ops()


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = w.shape[0] // 3
        ctx.save_for_backward(x, w)
        return tuple(F.linear(x, w[i * d:(i + 1) * d], b[i * d:(i + 1) * d]) for i in range(3))

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = ctx.saved_tensors
        grads = (dq, dk, dv)
        dx = torch.ops.meshrun.qkv_input_grad(dq, dk, dv, w)
        dw = torch.cat([g.t() @ x for g in grads])
        db = torch.cat([g.sum(0) for g in grads])
        return dx, dw, db


def split_qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias)`` split in three along its last dimension (q, k, v, each
    (..., d)), computed as three dense outputs. Under autocast the operands are cast to its dtype
    here (autocast does not reach into the function), as it would cast them for ``F.linear``; the
    fp32 parameters get fp32 gradients through the casts."""
    if weight.shape[0] % 3 or bias.shape[0] != weight.shape[0]:
        raise ValueError(f"split_qkv: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} "
                         "are not a fused (3d, d) projection")
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):
        outs = _SplitQKV.apply(x.to(dt).reshape(-1, x.shape[-1]), weight.to(dt), bias.to(dt))
    return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)
