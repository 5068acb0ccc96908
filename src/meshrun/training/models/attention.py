"""Which fused attention kernel torch's scaled_dot_product_attention tries first.

``auto`` keeps torch's own order. That order is not fixed: torch 2.11 on an H200 (cuDNN 9) runs
cuDNN's fused attention first, as a profile shows (cuDNN's ``sdpa_sm90_flash`` kernels under
``auto``). Measured side by side on GPT 124M, torch's order (cuDNN there) and cuDNN first differ
by no more than the spread from card to card, and flash first is a few percent behind
(docs/decisions.md#attention-kernel). Where torch prefers flash (older cuDNN, other cards), auto
follows it rather than forcing a kernel torch has reasons to rank lower. A chosen kernel goes
first; the others stay behind it as fallbacks for inputs it does not take, so no model loses its
attention. (Compiled autograd fails on torch 2.11 with cuDNN first and with flash first alike:
``.item()`` on an int while tracing the backward, so the attention kernel is not the cause;
docs/decisions.md#rejected-compiled-autograd.)
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
