"""The line a log step prints: what a person follows in a terminal, at most WIDTH columns.

It keeps the step of the run's total, the loss (and the validation loss when measured), the
learning rate, the throughput (tokens/s, or samples/s where the inputs are no token ids; and
MFU on GPUs), the step time, and the time elapsed and
left; each at the precision it is read at: a loss to 4 significant digits, times to 3,
tokens/s whole with thousands separators. Everything else a record holds (the gradient norm,
the loader's share, the epoch, tokens/s per GPU, peak memory, snapshot and validation times)
and the full precision of every figure are in metrics.jsonl. A line that would be wider than
WIDTH leaves out, in this order, the step time (the throughput says it too), the elapsed time,
MFU and the learning rate; the step, the losses, the throughput and the time left always stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..units import clock, fmt_seconds

WIDTH = 100
SEP = " | "
# The fields a line may leave out to fit, the first left out first
DROPPABLE = ("step_time", "elapsed", "mfu", "lr")


def loss_text(value: float) -> str:
    """A loss to 4 significant digits: 4.368, 12.07, 0.001234."""
    return f"{value:.4g}"


def rate_text(value: float) -> str:
    """A learning rate to 3 significant digits, with a short exponent below 0.001: 0.001,
    0.000628 reads as 6.28e-4, 3e-05 as 3e-5."""
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def fields(record: Mapping[str, Any], total: int, elapsed_s: float, left_s: float | None,
           rate: str = "tok/s") -> list[tuple[str, str]]:
    """The line's fields in order, each (name, text); a figure the record lacks is left out.
    ``rate``: the throughput's unit (``samples/s`` where the inputs are no tokens)."""
    out = [("step", f"step {record['step']}/{total}")]
    if record.get("loss") is not None:
        out.append(("loss", f"loss {loss_text(record['loss'])}"))
    if record.get("val_loss") is not None:
        out.append(("val_loss", f"val loss {loss_text(record['val_loss'])}"))
    if record.get("lr") is not None:
        out.append(("lr", f"lr {rate_text(record['lr'])}"))
    if record.get("tokens_per_s") is not None:
        out.append(("tokens_per_s", f"{record['tokens_per_s']:,.0f} {rate}"))
    if record.get("mfu") is not None:
        out.append(("mfu", f"mfu {100 * record['mfu']:.1f}%"))
    if record.get("step_time_s") is not None:
        out.append(("step_time", f"{fmt_seconds(record['step_time_s'])}/step"))
    out.append(("elapsed", f"elapsed {clock(elapsed_s)}"))
    if left_s is not None:
        out.append(("left", f"left {clock(left_s)}"))
    return out


def step_line(record: Mapping[str, Any], total: int, elapsed_s: float, left_s: float | None,
              width: int = WIDTH, rate: str = "tok/s") -> str:
    """The record of a log step as its line: ``total`` steps in the run, ``elapsed_s`` trained
    so far, ``left_s`` to go (None at the last step); fields left out until it fits ``width``.
    ``rate``: the throughput's unit (the trainer counts a step's samples where its inputs are
    no token ids: ``samples/s``)."""
    parts = fields(record, total, elapsed_s, left_s, rate)
    for name in DROPPABLE:
        if len(SEP.join(text for _, text in parts)) <= width:
            break
        parts = [(n, text) for n, text in parts if n != name]
    return SEP.join(text for _, text in parts)
