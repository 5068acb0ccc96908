"""`meshrun bench comm|matmul` against a direct measurement in the same run (target: within 5%).

    torchrun --standalone --nproc_per_node=4 bench/bench_vs_direct.py [--size 1GiB] [--matmul-n 8192]

Direct: a plain loop of dist.all_reduce on a bf16 buffer (NCCL) and of a @ b, timed with
CUDA events, 5 warm-up and 20 timed calls (the matmul also over as many calls as fill one
second, as meshrun's sustained figure does: 20 calls run at boost clocks); busbw = bytes / time x 2(n-1)/n as nccl-tests
report it. meshrun: the benchworker functions `meshrun bench` runs. Rank 0 prints one line
per measurement and the ratios. On CPU it runs with gloo and fp32 (to check the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshrun.doctor import benchworker  # noqa: E402
from meshrun.training.runtime import init_runtime, teardown  # noqa: E402
from meshrun.units import parse_bytes  # noqa: E402


def direct_seconds(fn, device, warmup=5, iters=20) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        t = start.elapsed_time(end) / 1e3 / iters
    else:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t = (time.perf_counter() - t0) / iters
    took = torch.tensor([t], device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--matmul-n", type=int, default=8192)
    args = ap.parse_args()
    rt = init_runtime()
    n = rt.world_size
    dtype = torch.bfloat16 if rt.cuda else torch.float32
    size = parse_bytes(args.size, "--size")
    count = size // torch.tensor([], dtype=dtype).element_size() // n * n
    buf = torch.ones(count, dtype=dtype, device=rt.device)
    t = direct_seconds(lambda: dist.all_reduce(buf), rt.device)
    direct_busbw = count * buf.element_size() / t * 2 * (n - 1) / n / 1e9
    buf = None  # free the 1 GiB buffer before the matmul
    mine = benchworker.comm({"ops": ["all_reduce"], "sizes": [size], "warmup": 5, "min_time": 1.0,
                             "max_iters": 1000}, rt.device)["rows"][0]
    a = torch.randn(args.matmul_n, args.matmul_n, dtype=dtype, device=rt.device)
    b = torch.randn(args.matmul_n, args.matmul_n, dtype=dtype, device=rt.device)
    flop = 2 * args.matmul_n**3
    burst_s = direct_seconds(lambda: a @ b, rt.device)  # 20 calls: boost clocks
    # as many calls as fill one second, as meshrun's sustained figure does (power/heat-capped clocks)
    direct_tflops = flop / direct_seconds(lambda: a @ b, rt.device, iters=max(20, int(1.0 / burst_s))) / 1e12
    direct_burst = flop / burst_s / 1e12
    mm = benchworker.matmul({"n": args.matmul_n, "warmup": 5, "min_time": 1.0, "max_iters": 1000}, rt.device)["rows"][0]
    if rt.rank == 0:
        print("RESULT " + json.dumps({
            "card": torch.cuda.get_device_name(rt.device) if rt.cuda else "cpu", "world": n, "torch": torch.__version__,
            "allreduce_bytes": mine["bytes"], "busbw_direct_gbps": round(direct_busbw, 2),
            "busbw_meshrun_gbps": round(mine["busbw_gbps"], 2),
            "busbw_ratio": round(mine["busbw_gbps"] / direct_busbw, 4),
            "matmul_n": args.matmul_n, "tflops_direct": round(direct_tflops, 2),
            "tflops_meshrun": round(mm["tflops_min"], 2),
            "matmul_ratio": round(mm["tflops_min"] / direct_tflops, 4),
            "tflops_direct_burst": round(direct_burst, 2), "tflops_meshrun_burst": round(mm["burst_tflops_min"], 2),
            "matmul_burst_ratio": round(mm["burst_tflops_min"] / direct_burst, 4)}), flush=True)
    teardown()


if __name__ == "__main__":
    main()
