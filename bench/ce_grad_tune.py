"""Launch settings of the head loss's kernel (ce_kernel.GRAD_FORWARD: entries per loop step,
warps per program, programs per SM) timed at the GPT benchmark's shape: 131072 token rows x
50304 vocabulary entries, bf16 (13.2 GB of logits), one GPU.

Why: the kernel reads each 100-KB row twice (the log-sum-exp, then the gradient it writes over
the row) and took 9.9 ms of a 124M step (fourteenth session, call BE) where one read and one
write of the logits take ~5.5 ms at the H200's bandwidth: with one program per row, ~1,000 rows
(~100 MB) are in flight, more than the 50-MB L2, so the second read goes back to DRAM. Fewer,
longer-lived programs keep the rows in flight inside L2.

Each setting is first checked on a small input against F.cross_entropy (the rows' losses and
the gradient), then timed with CUDA events. Prints one line per setting, fastest first, and
BEST with its train_bench.py --head-kernel argument.

    python bench/ce_grad_tune.py [--rows 131072] [--vocab 50304] [--reps 8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from meshrun.train import ce_kernel


def check(dev: torch.device) -> float:
    """The worst difference from F.cross_entropy's rows and gradient, on a small input."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1000, 9000, device=dev, generator=g).bfloat16()
    t = torch.randint(0, 9000, (1000,), device=dev, generator=g)
    t[3] = -100
    ref_rows = F.cross_entropy(x.float(), t, reduction="none")
    ref_grad = torch.softmax(x.float(), 1) - F.one_hot(t.clamp_min(0), 9000).float()
    ref_grad[3] = 0
    y = x.clone()
    rows = torch.ops.meshrun.cross_entropy_grad_(y, t, -100)
    return max((rows - ref_rows).abs().max().item(), (y.float() - ref_grad).abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ce_kernel.register().get("cuda"):
        raise SystemExit("ce_grad_tune: needs a GPU and Triton")
    dev = torch.device("cuda")
    x = torch.randn(args.rows, args.vocab, device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.rows,), device=dev)
    gbytes = x.numel() * x.element_size() / 1e9
    default = dict(ce_kernel.GRAD_FORWARD)
    settings = [default] + [dict(BLOCK=b, num_warps=w, per_sm=p) for b, w, p in
                            itertools.product((4096, 8192), (8, 16, 32), (None, 1, 2, 4, 8))]
    rows = []
    for s in settings:
        ce_kernel.GRAD_FORWARD.update(s)
        try:
            err = check(dev)
            for _ in range(2):
                torch.ops.meshrun.cross_entropy_grad_(x, t, -100)  # in place: the values change, not the work
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                torch.ops.meshrun.cross_entropy_grad_(x, t, -100)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.reps
        except Exception as e:  # a setting Triton cannot compile (registers): reported, skipped
            print(f"  {s}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        rows.append((ms, err, s))
        print(f"  {s}: {ms:.2f} ms ({2 * gbytes / ms:.2f} TB/s for one read + one write), max error {err:.1e}",
              flush=True)
    ce_kernel.GRAD_FORWARD.update(default)
    base = next(ms for ms, _, s in rows if s == default)
    print(f"CE_TUNE {args.rows} x {args.vocab} bf16, {torch.cuda.get_device_name()}: fastest first")
    for ms, err, s in sorted(rows, key=lambda r: r[0])[:8]:
        print(f"  {ms:6.2f} ms  {base / ms - 1:+6.1%} vs default  error {err:.1e}  {s}")
    ms, err, s = min(rows, key=lambda r: r[0] if r[1] < 2e-2 else float("inf"))
    print(f"BEST {ms:.2f} ms vs default {base:.2f} ms: --head-kernel {s['BLOCK']},{s['num_warps']},{s['per_sm'] or 0}")


if __name__ == "__main__":
    main()
