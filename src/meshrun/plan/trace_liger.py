"""Liger Kernel's fused kernels in the meta trace (trace.py): what a Hugging Face model keeps for
backward when meshrun patches it with Liger (``Choice.liger``).

Liger patches the model itself (``_apply_liger_kernel_to_instance``) on a twin built on the meta
device from the model's config, so the model being planned is left as it is; what Liger swaps in
the architecture's module (``LlamaForCausalLM.forward``, ``apply_rotary_pos_emb``, its norm and
MLP classes) is put back afterwards, also on an error. Liger's Triton functions cannot run on
meta: each is stood in for by an autograd function that keeps the tensors Liger's keeps, of the
same sizes and dtypes (Liger 0.8.5, ``liger_kernel/ops``):

* RMSNorm: its input, the weight and an fp32 inverse RMS per row (``casting_mode`` "none": at
  the input's dtype); the output at the input's dtype (no autocast inside a Triton kernel);
* SwiGLU and GeGLU: both inputs, not the activation between them;
* rotary embeddings: cos and sin; q and k come back as new tensors;
* fused linear cross-entropy: the loss's gradients computed in the forward and kept until
  backward: one for the input (its size and dtype) and one for the head's weight (its size and
  dtype: fp32 parameters give an fp32 gradient), plus, while it runs, one chunk of logits at the
  matmul's dtype (Liger's chunking: ``next_power_of_2(ceil(tokens / ceil(V / H)))`` rows) and,
  under autocast with fp32 parameters, two bf16 copies of the weight (autocast caches its copy
  of the weight, not of the transposed view the logits' matmul takes). The GPU's forward peak
  beyond the first block matches this on the models measured (bench/saved_activations.py, way
  liger; docs/decisions.md#traced-memory);
* cross-entropy on the model's own logits (where the fused loss does not apply: Granite): the
  logits, whose storage takes their gradient in place;
* a Mixture-of-Experts model keeps its own experts (kernels/liger.py ``liger_options``).

A Liger function not listed makes the trace fail; the caller then traces the model unpatched,
which keeps more (the planner is over, never under).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .trace_hooks import autocast_on

FP32 = torch.float32


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float = 0.0,
                casting_mode: Any = "llama", in_place: bool = True, row_mode: Any = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        rstd_dtype = x.dtype if casting_mode in ("none", -1) else FP32
        rstd = x.new_empty(rows.shape[0], dtype=rstd_dtype)
        ctx.save_for_backward(rows, *(() if w is None else (w,)), rstd)
        ctx.has_w = w is not None
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        grad_w = torch.empty_like(saved[1]) if ctx.has_w else None
        return (g.new_empty(g.shape), grad_w, None, None, None, None, None)


class _GatedMul(torch.autograd.Function):
    """SwiGLU's and GeGLU's ``act(a) * b``: a and b kept."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, *rest: Any) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.n_rest = len(rest)
        return a.new_empty(a.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        return (torch.empty_like(a), torch.empty_like(b), *([None] * ctx.n_rest))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.n_rest = len(rest)
        # Liger's kernel works in (batch, seq, heads, dim) and returns it transposed back
        return (q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2),
                k.new_empty(k.shape[0], k.shape[2], k.shape[1], k.shape[3]).transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:
        return (dq.new_empty(dq.shape), dk.new_empty(dk.shape), None, None, *([None] * ctx.n_rest))


class _CrossEntropy(torch.autograd.Function):
    """Liger's cross-entropy on logits the model made (where its fused loss does not apply:
    Granite scales its logits): the gradient is written into the logits in place and kept for
    backward, so the logits' storage stays alive and nothing of their size is added."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, *args: Any) -> tuple[torch.Tensor, None, None, None]:
        ctx.save_for_backward(logits.detach())
        ctx.n_args = len(args)
        return logits.new_empty((), dtype=FP32), None, None, None

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return (grad, *([None] * ctx.n_args))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, ce_weight: Any = None, ignore_index: int = -100,
                lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                softcap: Any = None, return_z_loss: bool = False, accum_dtype: Any = None,
                *rest: Any) -> tuple[Any, ...]:
        tokens, hidden = x.shape
        vocab = weight.shape[0]
        ctx.n_args = 12 + len(rest)
        if reduction == "none":  # Liger recomputes the logits in backward from what it keeps
            ctx.save_for_backward(x, weight, target, *(() if bias is None else (bias,)))
            ctx.deferred = True
            return x.new_empty(tokens, dtype=FP32), None, None, None
        ctx.deferred = False
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight, dtype=accum_dtype or weight.dtype) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        chunk = min(tokens, 2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(vocab / hidden))))))
        copies = []
        if autocast_on() and weight.dtype == FP32:
            # autocast's bf16 copy of the weight (cached: a leaf) for the input's gradient, and
            # one of its transpose (a view: never cached, made again per chunk) for the logits
            copies = [weight.new_empty(weight.shape, dtype=torch.bfloat16),
                      weight.new_empty(weight.shape, dtype=torch.bfloat16)]
        dtype = torch.bfloat16 if autocast_on() else x.dtype
        logits = x.new_empty(chunk, vocab, dtype=dtype)  # the chunk's logits, overwritten by their gradient
        rows = x.new_empty(tokens, dtype=FP32)  # the loss per row
        del logits, rows, copies
        ctx.save_for_backward(grad_input, *(() if grad_weight is None else (grad_weight,)),
                              *(() if grad_bias is None else (grad_bias,)))
        ctx.has = (grad_weight is not None, grad_bias is not None)
        return x.new_empty((), dtype=FP32), None, None, None

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *more: Any) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        if ctx.deferred:
            x, weight = saved[0], saved[1]
            grads: list[Any] = [torch.empty_like(x), torch.empty_like(weight), None,
                                torch.empty_like(saved[3]) if len(saved) > 3 else None]
        else:
            grad_input = saved.pop(0)
            grad_weight = saved.pop(0) if ctx.has[0] else None
            grad_bias = saved.pop(0) if ctx.has[1] else None
            grads = [grad_input, grad_weight, None, grad_bias]
        return (*grads, *([None] * (ctx.n_args - 4)))


# Liger's function (liger_kernel.ops) -> its stand-in
STAND_INS: dict[str, type[torch.autograd.Function]] = {
    "LigerRMSNormFunction": _RMSNorm,
    "LigerSiLUMulFunction": _GatedMul,
    "LigerGELUMulFunction": _GatedMul,
    "LigerRopeFunction": _Rope,
    "LigerFusedLinearCrossEntropyFunction": _FusedLinearCrossEntropy,
    "LigerCrossEntropyFunction": _CrossEntropy,
}


@contextlib.contextmanager
def liger_twin(model: nn.Module, loss_only: bool = False) -> Iterator[nn.Module]:
    """A twin of the Hugging Face ``model`` on the meta device with Liger's kernels applied as
    meshrun applies them (kernels/liger.py; ``loss_only``: its fused loss alone), its Triton
    functions stood in for; what
    Liger changed in the architecture's module is put back when the block ends."""
    from ..kernels.liger import liger_options, quiet_registry

    quiet_registry()
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    modeling = sys.modules[type(model).__module__]
    ops = importlib.import_module("liger_kernel.ops")
    functions = [getattr(ops, name) for name in STAND_INS if hasattr(ops, name)]
    # Liger's plain cross-entropy replaces torch.nn.functional's for the process: put back too
    with _restored(modeling), _restored(torch.nn.functional), _applies_swapped(functions):
        hf: Any = model  # a transformers PreTrainedModel: its config, its class's _from_config
        config = copy.deepcopy(hf.config)
        attention = getattr(config, "_attn_implementation", None)
        if attention is not None:  # as the model was built (transformers checks it again otherwise)
            config._attn_implementation = None
        with torch.device("meta"):
            twin = type(hf)._from_config(config)
        if attention is not None:
            twin.config._attn_implementation = attention
        twin.train(model.training)
        _apply_liger_kernel_to_instance(model=twin, **liger_options(twin, loss_only))
        yield twin


@contextlib.contextmanager
def _applies_swapped(functions: list[Any]) -> Iterator[None]:
    missing = object()
    old = [(f, vars(f).get("apply", missing)) for f in functions]
    try:
        for f in functions:
            f.apply = STAND_INS[f.__name__].apply
        yield
    finally:
        for f, was in old:
            if was is missing:
                delattr(f, "apply")
            else:
                f.apply = was


@contextlib.contextmanager
def _restored(module: Any) -> Iterator[None]:
    """``module``'s names and its classes' attributes as they were when the block began."""
    names = dict(vars(module))
    classes = {c: dict(vars(c)) for c in names.values()
               if isinstance(c, type) and c.__module__ == module.__name__}
    try:
        yield
    finally:
        for name in set(vars(module)) - set(names):
            delattr(module, name)
        for name, value in names.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
        for c, attrs in classes.items():
            for name in set(vars(c)) - set(attrs):
                delattr(c, name)
            for name, value in attrs.items():
                if vars(c).get(name) is not value:
                    setattr(c, name, value)
