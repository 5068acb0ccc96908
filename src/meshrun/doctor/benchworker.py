"""What `meshrun bench` runs on every rank: collectives, matmul, or a short training run.
Rank 0 writes the result as JSON to $MESHRUN_BENCH_OUT (else one line ``MESHRUN_BENCH
{json}`` on stdout); the CLI turns it into a table.

Bandwidth follows nccl-tests' conventions (PERFORMANCE.md there): algorithm bandwidth =
bytes / time, where bytes is the buffer of all_reduce and broadcast, the gathered output of
all_gather and the scattered input of reduce_scatter; bus bandwidth = algbw x 2(n-1)/n for
all_reduce, x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast: the per-link
traffic, comparable with the hardware's peak."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..training.runtime import Runtime

# torch 2.13 renamed the flat-tensor collectives (the old names warn); 2.6-2.12 have only the old.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


# The options `meshrun bench` passes (cli/bench.py's ``options``), one kind's per run, as JSON.
class _Timing(TypedDict):
    warmup: int
    min_time: float
    max_iters: int


class CommOptions(_Timing):
    ops: list[str]
    sizes: list[int]


class MatmulOptions(_Timing):
    n: int


class TrainOptions(TypedDict):
    model: str
    seq: int
    micro: int
    steps: int
    warmup: int


# A result, written as JSON for the CLI's table.
Result = dict[str, object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, warmup: int, min_time_s: float, max_iters: int,
          burst: int = 0) -> tuple[float, float | None]:
    """Mean seconds per call, sustained: warm up, then as many calls as fit in min_time_s
    (agreed on by all ranks so they run the same number of collectives). With ``burst``,
    also the mean of that many calls right after the warm-up: a GPU's first milliseconds run
    at boost clocks, so a short loop reads higher than a long one where power or heat caps
    the clocks (docs/decisions.md#bench-clocks)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    short = None
    if burst:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        _sync(device)
        short = _slowest((time.perf_counter() - start) / burst, device)
    start = time.perf_counter()
    fn()
    _sync(device)
    one = _slowest(time.perf_counter() - start, device)
    iters = int(max(1, min(max_iters, min_time_s / max(one, 1e-9))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return _slowest((time.perf_counter() - start) / iters, device), short


def _slowest(seconds: float, device: torch.device) -> float:
    took = torch.tensor([seconds], device=device, dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(took.item())


def comm(opts: CommOptions, device: torch.device) -> Result:
    n = dist.get_world_size()
    rows: list[Result] = []
    fn: Callable[[], object]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    esize = torch.tensor([], dtype=dtype).element_size()
    for op in opts["ops"]:
        for size in opts["sizes"]:
            count = max(n, size // esize // n * n)  # divisible by n for the sharded collectives
            nbytes = count * esize
            buf = torch.ones(count, dtype=dtype, device=device)
            # each call's tensors bound: this size's, not the loop's last
            if op == "all_reduce":
                fn = functools.partial(dist.all_reduce, buf)
            elif op == "broadcast":
                fn = functools.partial(dist.broadcast, buf, src=0)
            elif op == "all_gather":
                part = buf[: count // n].clone()
                fn = functools.partial(ALL_GATHER, buf, part)
            else:
                out = torch.empty(count // n, dtype=dtype, device=device)
                fn = functools.partial(REDUCE_SCATTER, out, buf)
            t, _ = _time(fn, device, opts["warmup"], opts["min_time"], opts["max_iters"])
            algbw = nbytes / t
            rows.append({"op": op, "bytes": nbytes, "time_us": t * 1e6, "algbw_gbps": algbw / 1e9,
                         "busbw_gbps": algbw * BUS_FACTOR[op](n) / 1e9})
            del buf, fn  # free it before the next size allocates (a 1 GiB buffer)
    return {"kind": "comm", "world": n, "backend": dist.get_backend(), "dtype": str(dtype).replace("torch.", ""),
            "rows": rows}


def matmul(opts: MatmulOptions, device: torch.device) -> Result:
    from ..training.metrics import peak_flops

    rows: list[Result] = []
    dtypes = ["bfloat16", "float32"] if device.type == "cuda" else ["float32"]
    for name in dtypes:
        dtype = getattr(torch, name)
        n = opts["n"]
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        t, short = _time(functools.partial(torch.matmul, a, b), device, opts["warmup"], opts["min_time"],
                         opts["max_iters"], burst=20)
        tflops = torch.tensor([2 * n**3 / t / 1e12], device=device)
        each = [torch.zeros_like(tflops) for _ in range(dist.get_world_size())]
        dist.all_gather(each, tflops)
        per_rank = [float(x.item()) for x in each]
        peak = peak_flops(device) if name == "bfloat16" else None
        rows.append({"dtype": name, "n": n, "tflops_min": min(per_rank), "tflops_mean": sum(per_rank) / len(per_rank),
                     "burst_tflops_min": 2 * n**3 / short / 1e12 if short else None,
                     "per_rank": per_rank, "of_peak": min(per_rank) * 1e12 / peak if peak else None})
    return {"kind": "matmul", "world": dist.get_world_size(), "rows": rows,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def train(opts: TrainOptions, rt: Runtime) -> Result:
    from ..config import TrainConfig
    from ..training.loader import BatchStream, RandomTokens
    from ..training.models import gpt
    from ..training.trainer import Trainer

    cfg = TrainConfig(model_size=opts["model"], seq_len=opts["seq"], micro_batch=opts["micro"],
                      steps=opts["warmup"] + opts["steps"], log_every=10**9, lr=3e-4)
    torch.manual_seed(0)
    trainer = Trainer(gpt(opts["model"], opts["seq"]), RandomTokens(1 << 16, opts["seq"], 50304), None, cfg,
                      runtime=rt)
    data = BatchStream(trainer.train_loader, trainer.cfg.micro, rt.world_size)
    for _ in range(opts["warmup"]):
        trainer.train_step(data)
    _sync(rt.device)
    dist.barrier()
    start = time.perf_counter()
    tokens = 0
    for _ in range(opts["steps"]):
        _, _, n = trainer.train_step(data)
        tokens += n
    _sync(rt.device)
    took = time.perf_counter() - start
    from ..training.metrics import peak_flops

    tps = tokens / took
    peak = peak_flops(rt.device)
    mfu = tps * trainer.flops_per_token / peak if peak and trainer.flops_per_token else None
    return {"kind": "train", "world": rt.world_size, "model": opts["model"], "strategy": trainer.strategy,
            "tokens_per_s_per_gpu": tps, "mfu": mfu, "step_s": took / opts["steps"],
            "device": torch.cuda.get_device_name(rt.device) if rt.cuda else "cpu"}


def main() -> None:
    from ..training.runtime import init_runtime, teardown

    kind, opts = sys.argv[1], json.loads(sys.argv[2])  # the options of ``kind``
    rt = init_runtime()
    try:
        if kind == "train":
            result = train(opts, rt)
        elif kind == "comm":
            result = comm(opts, rt.device)
        else:
            result = matmul(opts, rt.device)
        if rt.rank == 0:
            import os

            out = os.environ.get("MESHRUN_BENCH_OUT")
            if out:
                with open(out + ".tmp", "w") as f:
                    json.dump(result, f)
                os.replace(out + ".tmp", out)
            else:
                sys.stdout.write("MESHRUN_BENCH " + json.dumps(result) + "\n")
                sys.stdout.flush()
    finally:
        teardown()


if __name__ == "__main__":
    main()
