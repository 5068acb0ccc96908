"""Which fused attention kernel torch's scaled_dot_product_attention tries first.

``auto`` keeps torch's own order (flash first on CUDA). Measured (docs/benchmarks.md, call G,
1 x H200, GPT 124M compiled, side by side on four cards): cuDNN's attention 546K tokens/s,
flash 517K, torch's order (= flash) 532K. The two flash runs differ by as much as cuDNN gains
over their mean (card-to-card spread), and on 4 GPUs the cuDNN run (520K) did not beat the
flash one of an earlier call (524K); torch also ranks cuDNN last on purpose (correctness
reports on some shapes in earlier releases). So cuDNN is an option, not the default. A
chosen kernel goes first; the others stay behind it as fallbacks for inputs it does not
take, so no model loses its attention.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def attention_kernels(choice: str, device: torch.device) -> contextlib.AbstractContextManager:
    """A context for forward and backward (recomputation under activation checkpointing
    must pick the kernel the forward picked) with ``choice`` first in SDPA's order."""
    if choice == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names: dict[str, Any] = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    order = [names[choice]] + [b for n, b in names.items() if n != choice]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: its own order, every backend allowed
        return contextlib.nullcontext()
