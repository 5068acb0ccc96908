"""Replay a recorded CUDA allocator history through a model of PyTorch's caching allocator.

FSDP2 without activation checkpointing once reserved one logits-sized block more than it
allocated. ``plan_accuracy.py measure --history --trace-out P`` writes rank
0's allocator events of large blocks (>= 8 MiB) with their addresses; this replays them through
a best-fit, split-and-coalesce model of the caching allocator's large pool (sizes rounded as
``CUDACachingAllocator.cpp`` rounds them, one pool per stream) and asks what if some
allocations had been made at setup, before the first step:

  python bench/allocator_replay.py tests/data/calibration/h200x4_alloc-trace-fsdp2-124m-micro8_2026-11-27.jsonl.gz

It is a model for reading a trace, not an allocator: blocks under 8 MiB and what setup left
cached are not in the trace, so its figures are approximate (the measured rows are in
docs/benchmarks/planner-accuracy_H200_2026-11-27.md). On the FSDP2 trace it reproduces the
extra segment (taken in step 1 at the same event) and predicts it gone when the backward
thread's 32-MiB cuBLAS workspace is taken at setup, as measured on the GPU (4 x H200, torch 2.11).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30
SMALL = 1 * MiB  # remainders above this are split off as free blocks (large pool)


def segment_size(n: int) -> int:
    """cudaMalloc's size for a request the cache cannot serve: 20 MiB under 10 MiB, else 2-MiB steps."""
    return 20 * MiB if n < 10 * MiB else -(-n // (2 * MiB)) * (2 * MiB)


@dataclass
class Block:
    segment: int
    addr: int
    size: int
    stream: int
    used: bool = False


@dataclass
class Pool:
    """Free blocks ordered by (stream, size, address): best fit is the first at or after the request."""
    free: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[int, Block] = field(default_factory=dict)
    reserved: int = 0
    new_segments: list[tuple[int, int, int]] = field(default_factory=list)  # (event, step, bytes)
    _next: int = 1 << 44

    def malloc(self, size: int, stream: int, event: int, step: int) -> int:
        size = -(-size // 512) * 512
        i = bisect.bisect_left(self.free, (stream, size, -1))
        if i < len(self.free) and self.free[i][0] == stream:
            addr = self.free.pop(i)[2]
            b = self.blocks[addr]
        else:
            n = segment_size(size)
            addr, self._next = self._next, self._next + n + GiB
            b = self.blocks[addr] = Block(addr, addr, n, stream)
            self.reserved += n
            self.new_segments.append((event, step, n))
        if b.size - size > SMALL:
            rest = Block(b.segment, addr + size, b.size - size, stream)
            self.blocks[rest.addr] = rest
            bisect.insort(self.free, (stream, rest.size, rest.addr))
            b.size = size
        b.used = True
        return addr

    def release(self, addr: int) -> None:
        b = self.blocks[addr]
        b.used = False
        nxt = self.blocks.get(addr + b.size)
        if nxt is not None and not nxt.used and nxt.segment == b.segment:
            self.free.remove((nxt.stream, nxt.size, nxt.addr))
            del self.blocks[nxt.addr]
            b.size += nxt.size
        prev = next((p for p in self.blocks.values()
                     if p.segment == b.segment and p.addr + p.size == addr and not p.used), None)
        if prev is not None:
            self.free.remove((prev.stream, prev.size, prev.addr))
            del self.blocks[addr]
            prev.size += b.size
            b = prev
        bisect.insort(self.free, (b.stream, b.size, b.addr))


def load(path: str) -> list[dict]:
    """The events of a --trace-out file (plain or gzipped); the segment summary lines are left out."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [e for e in (json.loads(line) for line in f if line.strip()) if "action" in e]


def replay(events: list[dict], early: set[int] = frozenset()) -> Pool:
    """Allocations whose event index is in ``early`` are made first, as if at setup; the rest in order."""
    pool, where = Pool(), {}
    first = [e for e in events if e["i"] in early and e["action"] == "alloc"]
    rest = [e for e in events if not (e["i"] in early and e["action"] == "alloc")]
    for e in first + rest:
        if e["action"] == "alloc":
            where[e["addr"]] = pool.malloc(e["size"], e["stream"], e["i"], e["step"])
        elif e["action"] == "free_completed" and e["addr"] in where:  # blocks from before the trace: not ours
            pool.release(where.pop(e["addr"]))
    return pool


def backward_workspaces(events: list[dict]) -> set[int]:
    """cuBLAS's workspace taken by autograd's thread: 32 MiB, allocated without a Python frame."""
    return {e["i"] for e in events if e["action"] == "alloc" and e["size"] == 32 * MiB and not e["where"]}


def optimizer_states(events: list[dict]) -> set[int]:
    return {e["i"] for e in events if e["action"] == "alloc" and any("optim/" in w for w in e["where"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a plan_accuracy.py --trace-out file (.jsonl or .jsonl.gz)")
    events = load(ap.parse_args().trace)
    ws, opt = backward_workspaces(events), optimizer_states(events)
    for label, early in (("as recorded", set()), ("backward workspace at setup", ws),
                         ("optimizer state at setup", opt), ("both at setup", ws | opt)):
        pool = replay(events, early)
        later = [(i, step, round(n / GiB, 3)) for i, step, n in pool.new_segments if step >= 1]
        print(f"{label:30s} reserved {pool.reserved / GiB:6.3f} GiB; segments taken after the first step "
              f"(event, step, GiB): {later}")


if __name__ == "__main__":
    main()
