"""meshrun.kernels.fused_mlp on a GPU (cuBLASLt's epilogues through nvmath-python)
against the same ops' plain torch path, then the MLP's time per forward + backward at the
benchmark's shapes: Inductor's (Linear, GELU, Linear compiled) against the epilogues'. Run by
`bash bench/gpu_session.sh checks OUT`; prints one line per check and ALL OK, or stops at the
first failure with what differed. Needs CUDA."""

from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshrun.kernels import fused_mlp

if not torch.cuda.is_available():
    raise SystemExit("fused_mlp_check: needs a GPU")
nv = fused_mlp._nvmath()
if isinstance(nv, str):
    raise SystemExit(f"fused_mlp_check: {nv}")
dev = torch.device("cuda")
torch.manual_seed(0)


def operands(n: int, d: int, dt=torch.bfloat16):
    up, down = nn.Linear(d, 4 * d, device=dev), nn.Linear(4 * d, d, device=dev)
    ws = [p.detach().to(dt) for p in (up.weight, up.bias, down.weight, down.bias)]
    x = torch.randn(n, d, device=dev, dtype=dt)
    return x, ws


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def both(x, wu, bu, wd, bd, dy):
    y, g, h = torch.ops.meshrun.gelu_mlp(x, wu, bu, wd, bd)
    return (y, g, h, *torch.ops.meshrun.gelu_mlp_backward(dy, x, wu, wd, g, h))


# 1. the epilogues against the plain path, forward and backward, at two shapes; then the
# same plans called directly (fused_mlp._Direct, every call after the one that makes a plan)
# against the call that makes it, through nvmath's execute(): bit for bit
for n, d in ((4096, 768), (8192, 2048)):
    x, (wu, bu, wd, bd) = operands(n, d)
    dy = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    fused_mlp._PLANS.clear()
    before = dict(fused_mlp.PATHS), dict(fused_mlp.EXECUTED)
    first = both(x, wu, bu, wd, bd, dy)
    took = fused_mlp.PATHS["cublaslt"] - before[0].get("cublaslt", 0)
    if took != 2:
        raise SystemExit(f"fused_mlp_check: the cuBLASLt path ran {took} of 2 times at {n}x{d}: {fused_mlp.FALLBACK}")
    y, g, h, *grads = first
    y0, g0, h0 = fused_mlp._forward_torch(x, wu, bu, wd, bd)
    ref = fused_mlp._backward_plain(x, wu, dy, wd, g0, h0)
    errs = {"y": rel(y, y0), "gelu out": rel(g, g0), "gelu in": rel(h, h0)}
    errs |= {k: rel(a, b) for k, a, b in zip(("dx", "dW_up", "db_up", "dW_down", "db_down"), grads, ref)}
    worst = max(errs, key=errs.get)
    print(f"{n} x {d}: relative errors " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    if errs[worst] > 2e-2:  # bf16 rounds to ~4e-3; the two paths round at different points
        raise SystemExit(f"fused_mlp_check: {worst} differs by {errs[worst]:.2e} at {n}x{d}")
    if any(t.shape != r.shape or t.dtype != r.dtype for t, r in zip(grads, ref)):
        raise SystemExit("fused_mlp_check: gradient shapes or dtypes differ from the plain path's")
    second = both(x, wu, bu, wd, bd, dy)
    direct = fused_mlp.EXECUTED["direct"] - before[1].get("direct", 0)
    if direct != 2:
        raise SystemExit(f"fused_mlp_check: {direct} of the second call's 2 matmuls ran directly: {fused_mlp.EXECUTED}")
    same = all(torch.equal(p, q) for p, q in zip(first, second))
    worst_direct = max(rel(p, q) for p, q in zip(second, first))
    print(f"  direct cuBLASLt calls against nvmath's execute(): bitwise equal {same}, worst {worst_direct:.1e}",
          flush=True)
    if worst_direct > 1e-2 or not all(p.stride() == q.stride() for p, q in zip(first, second)):
        raise SystemExit(f"fused_mlp_check: the direct calls differ from execute() by {worst_direct:.2e} "
                         "(or in layout)")

# 2. inside a compiled function, no graph break
x, (wu, bu, wd, bd) = operands(1024, 768)
mods = nn.Linear(768, 3072, device=dev), nn.Linear(3072, 768, device=dev)
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = torch.compile(lambda t: fused_mlp.gelu_mlp(t, *mods), fullgraph=True)(x.float())
    ref = mods[1](F.gelu(mods[0](x.float()), approximate="tanh"))
print(f"compiled, fullgraph: relative error {rel(out, ref):.1e}", flush=True)


# 3. time per MLP forward + backward at micro-batch 128 x 1024 tokens, GPT 124M widths (bf16)
PEAKS: dict[str, float] = {}  # GiB above what was allocated before, per timed function's name


def timed(fn, x: torch.Tensor, reps: int = 20, name: str = "") -> float:
    for _ in range(3):
        fn(x).backward(dy)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(x).backward(dy)
    torch.cuda.synchronize()
    PEAKS[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return (time.perf_counter() - t0) / reps * 1e3


n, d = 131072, 768
up, down = nn.Linear(d, 4 * d, device=dev), nn.Linear(4 * d, d, device=dev)
x = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(n, d, device=dev, dtype=torch.bfloat16)


def plain(t):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return down(F.gelu(up(t), approximate="tanh"))


def fused(t):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return fused_mlp.gelu_mlp(t, up, down)


INDUCTOR, EPILOGUES = "Inductor (compiled Linear, GELU, Linear)", "epilogues (compiled)"
runs = {INDUCTOR: torch.compile(plain), "plain eager": plain,
        EPILOGUES: torch.compile(fused), "epilogues (eager)": fused}
rows = {k: timed(f, x, name=k) for k, f in runs.items()}
for k, v in rows.items():  # the peak: what one forward holds for its backward, and the backward's transients
    print(f"MLP fwd+bwd, {n} tokens x {d}: {k}: {v:.2f} ms, peak +{PEAKS[k]:.2f} GiB", flush=True)
print(f"epilogues: {rows[EPILOGUES] / rows[INDUCTOR] - 1:+.1%} against Inductor's", flush=True)
# the host's cost per MLP (Python, the planned calls), where the GPU's is small
small = torch.randn(256, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, d, device=dev, dtype=torch.bfloat16)
print(f"MLP fwd+bwd, 256 tokens (host-bound): epilogues {timed(fused, small):.3f} ms, "
      f"plain eager {timed(plain, small):.3f} ms", flush=True)
# where the time goes: the GPU kernels of one forward + backward each way (top 6 by time)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

x = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
for k in (INDUCTOR, EPILOGUES):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runs[k](x).backward(dy)
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]
    print(f"kernels, {k}, per fwd+bwd: " + "; ".join(
        f"{e.key[:60]} {e.device_time_total / 3e3:.2f} ms x{e.count // 3}" for e in evs), flush=True)
print("ALL OK")
sys.exit(0)
