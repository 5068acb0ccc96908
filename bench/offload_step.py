"""The optimizer step with AdamW's moments in host memory (``fsdp-offload``'s StreamedAdamW)
against torch's fused AdamW with them on the device, in the same process, on the same tensors.

    python3 bench/offload_step.py                    # 4B parameters in Llama-3-8B's matrix shapes
    python3 bench/offload_step.py --params-b 0.001   # a CPU check of the same code

Builds fp32 parameters of ``--params-b`` billion values (4096 x 14336 and 4096 x 4096 matrices,
one 128256 x 4096 embedding, Llama-3-8B's shapes) with fixed random gradients, steps a copy
with each optimizer ``--warmup`` times, checks that the two copies' parameters are bitwise
equal, then times ``--steps`` more steps of each (the device synchronised around every one).
One line ``OFFLOAD {json}``: the median seconds per step of each, their ratio, the moments'
bytes each way per second over the streamed step, and whether the parameters matched. Both
copies live on the device at once (12 bytes a parameter for the streamed one, 16 for fused
AdamW, plus the gradients' 4 each): 4B parameters take about 112 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = ((4096, 14336), (4096, 4096))


def _tensors(params: float, device: torch.device) -> list[torch.Tensor]:
    """About ``params`` values: an embedding when there is room for one, then the matrices in turn."""
    want = int(params)
    shapes = [(128256, 4096)] if want >= 2 * 128256 * 4096 else []
    used = sum(a * b for a, b in shapes)
    i = 0
    while used < want:
        a, b = SHAPES[i % len(SHAPES)]
        if used + a * b > want:  # the last one shorter, to end near the count asked
            a = max(1, (want - used) // b)
        shapes.append((a, b))
        used += a * b
        i += 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


def _seconds(opt: torch.optim.Optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-b", type=float, default=4.0, help="billions of parameters (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each (default 3)")
    args = ap.parse_args(argv)
    if args.params_b <= 0 or args.warmup < 1 or args.steps < 1:
        ap.error(f"--params-b {args.params_b}, --warmup {args.warmup}, --steps {args.steps}: each must be positive")
    from meshrun.training.offload import StreamedAdamW
    from meshrun.training.optim import AdamW

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = _tensors(args.params_b * 1e9, device)
    n = sum(t.numel() for t in base)
    copies = []
    for cls in (AdamW, StreamedAdamW):
        params = [torch.nn.Parameter(t.clone()) for t in base]
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator(device="cpu").manual_seed(p.numel()),
                                 ).to(device) * 1e-3
        copies.append((params, cls(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)))
    del base
    timings: dict[str, list[float]] = {}
    for _, opt in copies:
        for _ in range(args.warmup):
            _seconds(opt, device)
    same = all(torch.equal(p, q) for p, q in zip(copies[0][0], copies[1][0]))
    for name, (_, opt) in zip(("fused", "streamed"), copies):
        timings[name] = [_seconds(opt, device) for _ in range(args.steps)]
    fused, streamed = (statistics.median(timings[k]) for k in ("fused", "streamed"))
    row = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "params": n, "fused_s": round(fused, 4), "streamed_s": round(streamed, 4),
           "ratio": round(streamed / fused, 2), "moments_gb_s_each_way": round(8 * n / streamed / 1e9, 1),
           "bitwise_equal": same}
    print("OFFLOAD " + json.dumps(row), flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
