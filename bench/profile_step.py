"""Where a training step's GPU time goes: meshrun's Trainer on one GPU under torch.profiler.

    PYTHONPATH=src python3 bench/profile_step.py --size gpt-124m --micro 64
    PYTHONPATH=src torchrun --nproc_per_node=4 bench/profile_step.py --size gpt-124m --micro 128

Prints the wall-clock time of a step (unprofiled) beside the device time its kernels take,
the difference being the time the GPU waits for the host; then the share of device time per
kernel family (matmuls, attention, Triton-fused elementwise/norm/loss kernels, optimizer,
copies) and the top kernels. Under torchrun (DDP) rank 0 also prints the time some compute
kernel ran (the union of their intervals: NCCL runs on its own stream, so summed device time
counts overlapped communication twice) and, beside the wall clock, the communication and
waiting left exposed; against a 1-GPU run of the same micro-batch this splits a
data-parallel step's loss into slower kernels (SM contention) and exposed time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from meshrun.config import TrainConfig
from meshrun.training.loader import BatchStream, RandomTokens
from meshrun.training.trainer import Trainer

# Attention first: cuDNN's flash kernels also carry "sm90" in their names.
FAMILIES = (("attention", ("flash", "fmha", "attention", "sdpa")),
            ("gemm", ("gemm", "sm90", "cutlass", "matmul", "nvjet")),
            ("optimizer", ("adam", "multi_tensor", "foreach")), ("nccl", ("nccl",)),
            ("triton", ("triton",)), ("copy", ("copy", "memcpy", "memset")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time some kernel of them ran,
    overlaps (kernels on several streams) counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _gaps(kernels: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """(start, end, kernel before, kernel after) of each stretch with no kernel at all running,
    on any stream, between the first kernel and the last ((start, end, name), sorted by start;
    a kernel inside another's interval closes no gap)."""
    out: list[tuple[float, float, str, str]] = []
    reach, last = None, ""
    for start, end, name in kernels:
        if reach is not None and start > reach:
            out.append((reach, start, last, name))
        if reach is None or end >= reach:
            reach, last = end, name
    return out


def idle_gaps(kernels: list[tuple[float, float, str]], per_step: float, top: int = 5) -> str:
    """The idle gaps' total per step by size (launch gaps of a few microseconds against the host
    stalling the stream), and the longest few with the kernels on either side. The profiled
    steps follow a synchronize, so the first of them starts with the host loading a batch and
    nothing queued: a gap of several milliseconds that the timed steps do not have."""
    bins = {"<10us": 0.0, "10-100us": 0.0, ">100us": 0.0}
    gaps = _gaps(kernels)
    for lo, hi, _, _ in gaps:
        bins["<10us" if hi - lo < 10 else "10-100us" if hi - lo < 100 else ">100us"] += hi - lo
    parts = ", ".join(f"{k} {v * per_step:.2f} ms" for k, v in bins.items())
    longest = "; ".join(f"{hi - lo:.0f}us {a[:40]} -> {b[:40]}"
                        for lo, hi, a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top])
    return f"{len(gaps) * per_step * 1e3:.0f} gaps per step, {parts}; longest: {longest}"


def host_in_gaps(kernels: list[tuple[float, float, str]], host: list[tuple[float, float, str]],
                 top: int = 3) -> list[str]:
    """For the longest idle gaps: the host's longest operations that began inside the gap
    (what the host was doing while the GPU had nothing queued)."""
    out = []
    for lo, hi, _, _ in sorted(_gaps(kernels), key=lambda g: g[0] - g[1])[:top]:
        inside = sorted(((e - s, n) for s, e, n in host if lo <= s < hi), reverse=True)[:4]
        out.append(f"{hi - lo:.0f}us gap: " + ", ".join(f"{n[:50]} {d:.0f}us" for d, n in inside))
    return out


def is_kernel(e, cuda: bool) -> bool:
    """A device event that is a kernel: user annotations (DDP's "DistributedDataParallel.forward",
    "nccl:all_reduce") also show as device-side ranges, spanning kernels."""
    return (e.device_type.name == "CUDA" if cuda else True) and not getattr(e, "is_user_annotation", False)


def main() -> None:
    # beside this script (its directory is on the path when run)
    from train_bench import MLPS, make_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpt-124m")
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eager", action="store_true", help="--compile off (meshrun's default compiles on GPUs)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="how many of the longest kernels to list")
    ap.add_argument("--trace", default=None, help="rank 0 writes the profiled steps' Chrome trace here (.json.gz)")
    ap.add_argument("--loss", default="head", choices=["plain", "head"],
                    help="the GPT's loss: F.cross_entropy, or the one that writes the gradient in the forward (head)")
    ap.add_argument("--mlp", default="default", choices=list(MLPS), help="as train_bench.py's --mlp")
    args = ap.parse_args()
    model = make_model(args.size, args.seq, 50304, loss=args.loss, mlp=args.mlp)
    cfg = TrainConfig(micro_batch=args.micro, seq_len=args.seq, compile="off" if args.eager else "auto", steps=100,
                      log_every=10**9, grad_clip=1.0)
    trainer = Trainer(model, RandomTokens(1 << 20, args.seq, 50304), None, cfg)
    data = BatchStream(trainer.train_loader, trainer.cfg.micro, trainer.rt.world_size)
    cuda = torch.cuda.is_available()

    def step() -> None:
        trainer.train_step(data)

    for _ in range(6):
        step()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2 * args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / (2 * args.steps) * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    if args.trace and trainer.rt.rank == 0:
        prof.export_chrome_trace(args.trace)
    events = [e for e in prof.key_averages() if is_kernel(e, cuda)]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1
    by_family: dict[str, float] = defaultdict(float)
    for e in events:
        by_family[family(e.key)] += getattr(e, attr)
    device_ms = total / args.steps / 1e3
    from meshrun.training.runtime import teardown

    if trainer.rt.rank != 0:  # rank 0 speaks for all
        teardown()
        return
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if cuda and is_kernel(e, cuda) and family(e.key) != "nccl" and e.time_range.end > e.time_range.start]
    if spans:
        per_step = 1 / args.steps / 1e3  # profiler microseconds -> milliseconds per step
        nccl = by_family.get("nccl", 0.0)
        comm = [(e.time_range.start, e.time_range.end) for e in prof.events()
                if is_kernel(e, cuda) and family(e.key) == "nccl" and e.time_range.end > e.time_range.start]
        # NCCL's time with no compute kernel beside it: what communication adds to the step
        alone = covered(spans + comm) - covered(spans)
        print(f"PROFILE compute {args.size} micro {args.micro} world {trainer.rt.world_size}: kernels "
              f"{(total - nccl) * per_step:.1f} ms (summed), some compute kernel running "
              f"{covered(spans) * per_step:.1f} ms of the {wall_ms:.1f} ms step; nccl {nccl * per_step:.1f} ms "
              f"(own stream), {alone * per_step:.1f} ms of it with no compute kernel beside it")
        named = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if is_kernel(e, cuda) and e.time_range.end > e.time_range.start)
        print(f"PROFILE idle {args.size} world {trainer.rt.world_size}: " + idle_gaps(named, per_step))
        host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CPU"]
        for line in host_in_gaps(named, host):
            print(f"  during {line}")
    print(f"PROFILE {args.size} micro {args.micro} compiled {trainer.cfg.compiles(cuda)} loss {args.loss} "
          f"mlp {args.mlp}: "
          f"{wall_ms:.1f} ms wall per step, {device_ms:.1f} ms device time "
          f"(the GPU waits {max(0.0, wall_ms - device_ms):.1f} ms = {max(0.0, 1 - device_ms / wall_ms):.1%})")
    for fam, t in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {fam:10s} {100 * t / total:5.1f}%")
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:args.top]:
        print(f"  {100 * getattr(e, attr) / total:5.1f}%  {e.count // args.steps:4d}/step  {e.key[:100]}")
    if getattr(model.blocks[0], "fused_mlp", False):
        from meshrun.kernels import fused_mlp

        print(f"  fused MLP: calls {dict(fused_mlp.PATHS)} ({dict(fused_mlp.EXECUTED)}), "
              f"plans made {dict(fused_mlp.PLANNED)}, "
              f"fallback {list(fused_mlp.FALLBACK.values())}")
    teardown()


if __name__ == "__main__":
    main()
