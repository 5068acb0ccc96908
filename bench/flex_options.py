"""FlexAttention forward and backward under several kernel options, at one attention shape.

    python3 bench/flex_options.py                       # Gemma-2-2B's: 4 x 4096 tokens, 8/4 heads of 256, soft-cap 50
    python3 bench/flex_options.py --batch 2 --seq 8192 --heads 16 --kv-heads 8 --head-dim 128 --softcap 0

Each setting compiles ``flex_attention`` afresh (causal block mask, the soft-capping as a score
modification, grouped key/value heads) and prints the best of 5 timings of forward + backward
and of the forward alone, and the largest difference of its output and query gradient from the
first setting's. A setting Triton cannot fit (shared memory) prints why. The defaults that
``models/masks.py`` gives heads wider than 128 (``WIDE_HEAD_OPTIONS``) came from this run on
one H200 (docs/decisions.md#softcap-attention). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tma": {"USE_TMA": True},
    "b_w8": {"bwd_num_warps": 8},
    "b_s1w8": {"bwd_num_stages": 1, "bwd_num_warps": 8},
    "b_s3": {"bwd_num_stages": 3},
    "b_32_64": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32},
    "b_32_64_s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                   "bwd_num_stages": 3},
    "b_32_128_w8": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                    "bwd_num_warps": 8, "bwd_num_stages": 2},
    "b_64_128_w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 8, "bwd_num_stages": 1},
    "f_128_64_w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "f_64_64_w4s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--softcap", type=float, default=50.0, help="0: no score modification")
    ap.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/flex_options.py: needs a CUDA GPU (FlexAttention's Triton kernels)", file=sys.stderr)
        sys.exit(2)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, a.seq, a.seq, device=dev)
    cap = a.softcap

    def softcap(score: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=bf16, requires_grad=True)
    grad_out = torch.randn_like(q)
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    names = a.only.split(",") if a.only else list(SETTINGS)
    for name in names:
        opts = SETTINGS[name]
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False)
        kwargs = {"score_mod": softcap if cap else None, "block_mask": mask, "enable_gqa": a.heads != a.kv_heads,
                  "kernel_options": opts}

        def both(fn: Any = fn, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v, **kwargs)
            out.backward(grad_out)
            return out

        def forward(fn: Any = fn, kwargs: dict[str, Any] = kwargs) -> None:
            with torch.no_grad():
                fn(q, k, v, **kwargs)

        def best(f: Any) -> float:
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                f()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return min(times) * 1e3

        try:
            out = both()
            forward()
            total, fwd = best(both), best(forward)
        except Exception as exc:  # noqa: BLE001 (a setting that does not fit is a result)
            print(f"FLEX {name:14s} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
            continue
        if first is None:
            first = (out.detach(), q.grad.clone())
        diff = max((out.detach() - first[0]).abs().max().item(), (q.grad - first[1]).abs().max().item())
        print(f"FLEX {name:14s} fwd+bwd {total:7.2f} ms  fwd {fwd:6.2f} ms  bwd~ {total - fwd:7.2f} ms  "
              f"max diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
