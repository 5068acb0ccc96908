"""The Inductor settings of every graph meshrun compiles: the trainer compiles with them
(training/parallel/apply.py) and the planner traces a compiled block's saved tensors under them
(plan/trace.py), so that both see the same partition."""

from __future__ import annotations


def compile_options(tune: bool) -> dict[str, bool]:
    """``torch.compile(options=...)``: Inductor's settings for every graph meshrun compiles.

    ``fallback_random``: random operations (dropout) run as torch's own kernels, their masks
    saved for the backward, where Inductor would draw them again inside its backward kernels.
    A Hugging Face GPT-2 124M (dropout 0.1) trained 1.09x faster, 445,764 -> 487,962 tokens/s
    (1 x H200, torch 2.11): Inductor's fused dropout-backward and layer-norm-backward kernel
    took 70 of a 596-ms step, 10 with the masks saved (docs/decisions.md#dropout). Compiled
    dropout then draws from torch's generator as eager dropout does. A model without random
    operations compiles as before.

    ``--compile-tune``: Inductor's coordinate-descent search of its Triton kernels' block
    sizes. A step faster by about a percent or two, for minutes more compiling: not a default, a
    short run loses more than it gains (docs/decisions.md#rejected-coordinate-descent-tuning).
    Max-autotune matmuls are left out: cuBLAS beat every Triton template at these shapes, and
    they cost more compiling and a large transient at the first step
    (docs/decisions.md#rejected-max-autotune-matmuls)."""
    return {"fallback_random": True, **({"coordinate_descent_tuning": True} if tune else {})}
