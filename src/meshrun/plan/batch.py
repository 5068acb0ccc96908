"""Batch arithmetic: global batch = micro-batch x accumulation steps x data-parallel size."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MeshrunError, bad_value


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    dp: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp


def solve(global_batch: int | None, micro: int, dp: int, where: str = "--global-batch") -> Batch:
    """Accumulation steps for the requested global batch, or a one-line refusal naming the
    nearest global batches that work."""
    if global_batch is None:
        return Batch(micro, 1, dp)
    unit = micro * dp
    if global_batch % unit:
        lo, hi = (global_batch // unit) * unit, (global_batch // unit + 1) * unit
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise bad_value(where, global_batch,
                        f"is not a multiple of micro-batch {micro} x data-parallel size {dp} = {unit}",
                        f"use {near}, or change --micro-batch")
    return Batch(micro, global_batch // unit, dp)


def micro_choices(global_batch: int | None, dp: int, cap: int = 8) -> list[int]:
    """Micro-batch sizes to try, largest first: divisors of the per-replica batch when a
    global batch is given (so accumulation is exact), else powers of two up to ``cap``."""
    if global_batch is not None:
        if global_batch % dp:
            return []
        per = global_batch // dp
        return [d for d in range(min(per, 1024), 0, -1) if per % d == 0]
    out, m = [], 1
    while m <= cap:
        out.append(m)
        m *= 2
    return out[::-1]


def check_divisible(global_batch: int | None, dp: int) -> MeshrunError | None:
    if global_batch is not None and global_batch % dp:
        return bad_value("--global-batch", global_batch, f"does not split evenly over data-parallel size {dp}",
                         f"use a multiple of {dp}")
    return None
