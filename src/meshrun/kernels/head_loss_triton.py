"""The Triton kernel of meshrun's head loss (head_loss.py registers it as an op).

Imported only where Triton is installed. One program per token row, ``BLOCK`` vocabulary
entries per loop step; fp32 statistics, the gradient written in the logits' dtype. Named
``triton_*`` so that profiles (bench/profile_step.py) count it with Inductor's kernels.
"""

import triton
import triton.language as tl


@triton.jit
def _row_lse(base, V, BLOCK: tl.constexpr):
    # A row's log-sum-exp by online softmax, block by block: the running max and the sum of
    # exp(x - max), one exponential per entry (per-lane accumulators would need two). Both
    # start as fp32 scalars, as a loop-carried value must keep its type.
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)
    d = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
    return m + tl.log(d)


@triton.jit
def _row_loss(base, row, t_ptr, rows_ptr, lse, ignore_index):
    # The row's loss, lse - x[target] (0 for an ignored row), stored; its target and whether it counts
    t = tl.load(t_ptr + row)
    counted = t != ignore_index
    picked = tl.load(base + tl.where(counted, t, 0)).to(tl.float32)
    tl.store(rows_ptr + row, tl.where(counted, lse - picked, 0.0))
    return t, counted


@triton.jit
def _write_grad(src, dst, V, t, lse, scale, BLOCK: tl.constexpr):
    # A row's gradient, (softmax(x) - onehot(t)) * scale, from the logits at src into dst (in
    # dst's dtype); each block is read before it is written, so dst may be src
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < V
        x = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
        tl.store(dst + cols, grad.to(dst.dtype.element_ty), mask=keep)


@triton.jit
def triton_ce_grad_forward(x_ptr, stride, t_ptr, rows_ptr, V, ignore_index, BLOCK: tl.constexpr):
    # The loss and, written over the logits, its gradient for an incoming gradient of 1:
    # softmax(x) - onehot(t) (zero for an ignored row). The second loop reads the row again,
    # from L2 (a 100-KB row per program, a few hundred programs in flight: well inside it),
    # so the logits cross DRAM once each way.
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lse = _row_lse(base, V, BLOCK)
    t, counted = _row_loss(base, row, t_ptr, rows_ptr, lse, ignore_index)  # before the row is overwritten
    _write_grad(base, base, V, t, lse, tl.where(counted, 1.0, 0.0), BLOCK)
