"""Which fused attention kernel torch's scaled_dot_product_attention runs.

Measured (docs/benchmarks.md, call G, 1 x H200, GPT 124M compiled, side by side): cuDNN's
attention 546K tokens/s, torch 2.11's own choice 532K, flash 517K. On Hopper and newer,
``auto`` therefore puts cuDNN first in SDPA's priority order; the others stay behind it as
fallbacks for the inputs cuDNN does not take, so no model loses its attention. Elsewhere (and
in deterministic mode) torch's order is kept.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

CHOICES = ("auto", "torch", "cudnn", "flash", "efficient", "math")


def attention_kernels(choice: str, device: torch.device, deterministic: bool = False) -> contextlib.AbstractContextManager:
    """A context for forward and backward (recomputation under activation checkpointing
    must pick the kernel the forward picked) with ``choice`` first in SDPA's order."""
    if choice == "torch" or device.type != "cuda":
        return contextlib.nullcontext()
    if choice == "auto":
        if deterministic or torch.cuda.get_device_capability(device) < (9, 0):
            return contextlib.nullcontext()
        choice = "cudnn"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names: dict[str, Any] = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    order = [names[choice]] + [b for n, b in names.items() if n != choice]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: its own order, every backend allowed
        return contextlib.nullcontext()
