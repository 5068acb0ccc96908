"""What a stood-in kernel asks of, and tells, the running meta trace (trace.py): whether the
trace runs under its emulated bf16 autocast, and the buffers a fused kernel's backward makes.
Shared by trace.py and trace_liger.py so that neither imports the other's stand-ins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

# the running trace's (saved-tensor counter, {phase: bytes}) for note_backward_work
_backward_work: ContextVar[tuple[Any, dict[int, int]] | None] = ContextVar("backward_work", default=None)


def autocast_on() -> bool:
    """Whether the trace runs under its emulated CUDA autocast (trace._autocast answers
    torch.is_autocast_enabled for the meta device)."""
    try:
        return bool(torch.is_autocast_enabled("meta"))
    except RuntimeError:
        return False


@contextlib.contextmanager
def backward_work(saved: Any) -> Iterator[dict[int, int]]:
    """Collects note_backward_work's bytes by ``saved.phase`` while the block runs."""
    work: dict[int, int] = {}
    token = _backward_work.set((saved, work))
    try:
        yield work
    finally:
        _backward_work.reset(token)


def note_backward_work(nbytes: int) -> None:
    """For a stood-in fused kernel (trace_liger.py): the buffers its backward makes beyond the
    gradients of its inputs, counted to the block whose forward runs it."""
    got = _backward_work.get()
    if got is not None:
        saved, work = got
        work[saved.phase] = work.get(saved.phase, 0) + nbytes
