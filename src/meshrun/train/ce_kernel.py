"""Cross-entropy over bf16 logits in two memory-bound Triton passes (opt-in, CUDA).

Why: in the compiled GPT 124M step the loss takes 7.9% of the time (docs/benchmarks.md,
sixth session's profile): Inductor's forward reduction reads the 13.2 GB of bf16 logits at
1.4 TB/s, and its backward reads them again to recompute the softmax statistics. Here the
forward is one online-softmax pass per row (one read; it keeps each row's log-sum-exp, 4
bytes) and the backward one pass that reads the logits and writes their gradient,
``(exp(x - lse) - onehot) * g`` in the logits' dtype: three passes over the logits in all,
8.3 ms at 4.8 TB/s against the 17.9 ms measured. Predicted: ~4% of the 124M step, ~1% at
1.3B. Measured (seventh session, 1 x H200 each, side by side and swapped): +2.9% at 124M and
about even at 1.3B, but 12.2 GiB more peak memory at 124M: Inductor writes the plain loss's
gradient into the dead logits' buffer, which an opaque op cannot let it do. Since then,
with ``overwrite_logits`` (meshrun's GPT, which owns its logits) the backward writes the
gradient over the logits, dead by then, as Inductor does for its own loss: compiled, the
saved logits' buffer is reused and no second one is allocated (a test reads Inductor's
generated backward). Measured (eighth session, 4 x 1 H200 side by side, 124M): the peak is
now 1.0 GiB over the plain loss's (was 12.2), but the step 0.7% slower, so it stays opt-in
(``--loss triton`` in the benchmark, ``GPTConfig.triton_loss``).

Numerics: as ``F.cross_entropy(logits.float(), targets)``: statistics and gradient in fp32,
the gradient rounded once to the logits' dtype (what autocast's backward does); rows whose
target is ``ignore_index`` count neither in the loss nor in the mean, and get a zero
gradient.

The kernels are registered as opaque custom ops (``torch.library.custom_op``), so
torch.compile calls them from inside its graphs without a break. On a machine without Triton or without a
GPU, :func:`cross_entropy` is ``F.cross_entropy`` itself. Tests run the kernels on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``) and compile them for sm_90. The kernels
are in ``ce_triton.py``, imported only where Triton is.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

BLOCK = 4096  # vocabulary entries per loop step: 16 per thread at 8 warps


def register() -> dict[str, bool]:
    """Register the ops (once) where Triton imports, and say on which device types they run:
    a GPU, or the CPU under Triton's interpreter (how the tests run them). Called when a
    model that uses them is built, so that a compiled first step finds them registered."""
    if not _USABLE:
        try:
            _register_ops()  # imports Triton
        except ImportError:
            _USABLE.update(cuda=False, cpu=False)
        else:
            _USABLE.update(cuda=torch.cuda.is_available(), cpu=os.environ.get("TRITON_INTERPRET") == "1")
    return _USABLE


_USABLE: dict[str, bool] = {}


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  overwrite_logits: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (tokens, vocab) against ``targets`` (tokens,),
    equal to ``F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)``.
    ``overwrite_logits``: the backward writes the gradient into the logits' memory instead of
    a new tensor of the same size; only for a caller that keeps no other use of them, and
    not with ``backward(retain_graph=True)`` (a second backward would read the gradient)."""
    if not torch.compiler.is_compiling():  # traced, the model's constructor has registered
        if logits.dim() != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: "
                             "expected (tokens, vocab) and (tokens,)")
        register()
    if not _USABLE.get(logits.device.type, False) or logits.shape[0] == 0:
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    rows, _ = torch.ops.meshrun.cross_entropy_rows(logits.contiguous(), targets.contiguous(), ignore_index,
                                                   overwrite_logits)
    counted = (targets != ignore_index).sum()
    return rows.sum() / counted  # no counted token: 0 / 0 = nan, as torch gives


@functools.lru_cache(maxsize=1)
def _register_ops() -> None:
    """Build the kernels and register the ops once, on first use (Triton imported only then)."""
    from torch.library import custom_op, register_autograd, register_fake

    from .ce_triton import triton_ce_backward, triton_ce_forward, triton_ce_grad_forward

    # Opaque custom ops: compiled graphs call the kernels as they are (nothing to fuse into a
    # memory-bound pass over the logits), and trace them through the shapes given below.
    @custom_op("meshrun::cross_entropy_rows", mutates_args=())
    def forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                overwrite: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = logits.shape
        rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        triton_ce_forward[(n,)](logits, logits.stride(0), targets, rows, lse, v, ignore_index, BLOCK=BLOCK, num_warps=8)
        return rows, lse

    @register_fake("meshrun::cross_entropy_rows")
    def _forward_shapes(logits, targets, ignore_index, overwrite):
        n = logits.shape[0]
        return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)

    def _launch_backward(grad_rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                         ignore_index: int, dx: torch.Tensor) -> None:
        # each program reads a row's entries before it writes the same entries: dx may be logits
        grad_rows = grad_rows.contiguous()  # the mean's gradient arrives as an expanded scalar: N floats
        n, v = logits.shape
        triton_ce_backward[(n,)](logits, logits.stride(0), grad_rows, grad_rows.stride(0), targets, lse, dx, v,
                               ignore_index, BLOCK=BLOCK, num_warps=8)

    @custom_op("meshrun::cross_entropy_rows_backward", mutates_args=())
    def backward(grad_rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 ignore_index: int) -> torch.Tensor:
        dx = torch.empty_like(logits)
        _launch_backward(grad_rows, logits, targets, lse, ignore_index, dx)
        return dx

    @register_fake("meshrun::cross_entropy_rows_backward")
    def _backward_shapes(grad_rows, logits, targets, lse, ignore_index):
        return torch.empty_like(logits)

    # The same, written over the logits. Declared as a mutation, so the compiler keeps the
    # order (and, compiled, hands the op the saved logits' own buffer: no copy, no new one).
    @custom_op("meshrun::cross_entropy_rows_backward_", mutates_args=("logits",))
    def backward_in_place(grad_rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                          ignore_index: int) -> None:
        _launch_backward(grad_rows, logits, targets, lse, ignore_index, logits)

    def setup_context(ctx, inputs, output) -> None:
        logits, targets, ignore_index, overwrite = inputs
        ctx.save_for_backward(logits, targets, output[1])
        ctx.ignore_index, ctx.overwrite = ignore_index, overwrite

    def _backward(ctx, grad_rows, _grad_lse):
        logits, targets, lse = ctx.saved_tensors
        if ctx.overwrite:
            backward_in_place(grad_rows, logits, targets, lse, ctx.ignore_index)
            return logits, None, None, None
        return backward(grad_rows, logits, targets, lse, ctx.ignore_index), None, None, None

    register_autograd("meshrun::cross_entropy_rows", _backward, setup_context=setup_context)

    # head_cross_entropy's: the rows' losses, and their gradient (for an incoming 1) written
    # over the logits, in one kernel. No autograd of its own: _HeadCrossEntropy's backward
    # takes it from there.
    @custom_op("meshrun::cross_entropy_grad_", mutates_args=("logits",))
    def grad_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        n, v = logits.shape
        rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            triton_ce_grad_forward[(n,)](logits, logits.stride(0), targets, rows, v, ignore_index, BLOCK=BLOCK,
                                         num_warps=8)
        return rows

    @register_fake("meshrun::cross_entropy_grad_")
    def _grad_forward_shapes(logits, targets, ignore_index):
        return logits.new_empty(logits.shape[0], dtype=torch.float32)


class _HeadCrossEntropy(torch.autograd.Function):
    # The forward computes the logits, and one kernel reads them for the loss and writes over
    # them its gradient; the backward scales that gradient's two products (N x d and V x d,
    # small) by the incoming per-row gradient instead of scaling the (N, V) gradient itself.
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logits = h @ w.t()
        rows = torch.ops.meshrun.cross_entropy_grad_(logits, targets, ignore_index)
        ctx.save_for_backward(h, w, logits, targets)  # the logits' memory holds their gradient now
        ctx.ignore_index = ignore_index
        return rows

    @staticmethod
    def backward(ctx, g_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w, dlogits, targets = ctx.saved_tensors
        # (N, 1): the mean's 1/N, or any per-row weights; an ignored row's is 0 whatever came
        # (with every row ignored the mean's 1/0 would make 0 * inf = nan of its zero gradient)
        s = torch.where(targets != ctx.ignore_index, g_rows.float(), 0.0).unsqueeze(1)
        dh = ((dlogits @ w).float() * s).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = dlogits.t() @ (h.float() * s).to(h.dtype) if ctx.needs_input_grad[1] else None
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
