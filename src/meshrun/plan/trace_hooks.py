"""What a stood-in kernel asks of the running meta trace (trace.py): whether the trace runs
under its emulated bf16 autocast. Shared by trace.py and trace_liger.py so that neither imports
the other's stand-ins."""

from __future__ import annotations

import torch


def autocast_on() -> bool:
    """Whether the trace runs under its emulated CUDA autocast (trace._autocast answers
    torch.is_autocast_enabled for the meta device)."""
    try:
        return bool(torch.is_autocast_enabled("meta"))
    except RuntimeError:
        return False
