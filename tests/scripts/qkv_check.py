"""meshrun.train.qkv (GPTConfig.split_qkv) against the fused q/k/v projection: run by
tests/test_qkv.py on the CPU, and as it is on a GPU host, where it also checks the layout of
cuDNN's attention gradients and times a compiled block both ways. Prints ALL OK."""

from __future__ import annotations

import copy
import time

import torch

from meshrun.train.models import GPT, Block, GPTConfig

dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
cuda = dev.type == "cuda"
torch.manual_seed(0)


def grads(model: GPT, idx: torch.Tensor, tgt: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(idx, tgt)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def rel(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b)


def with_split(model: GPT, split: bool) -> GPT:
    out = copy.deepcopy(model)
    for blk in out.blocks:
        blk.split_qkv = split
    return out


# 1. the same loss and gradients as the fused projection: in fp32 to rounding, in bf16 as far
# from fp32 as the fused projection is (split adds two bf16 roundings of the input gradient)
cfg = GPTConfig(vocab=256, seq_len=128, d_model=128 if not cuda else 768, n_layers=2, n_heads=2 if not cuda else 12,
                split_qkv=False, head_loss=False, fused_mlp=False)
base = GPT(cfg).to(dev)
idx = torch.randint(0, cfg.vocab, (4, cfg.seq_len), device=dev)
tgt = torch.randint(0, cfg.vocab, (4, cfg.seq_len), device=dev)
fused, split = with_split(base, False), with_split(base, True)
l_ref, g_ref = grads(fused, idx, tgt, bf16=False)
l_split, g_split = grads(split, idx, tgt, bf16=False)
torch.testing.assert_close(l_split, l_ref, rtol=1e-5, atol=1e-5)
err32 = rel(g_split, g_ref)
if err32 > 1e-4:
    raise SystemExit(f"FAILED fp32: split's gradients {err32:.2e} from the fused projection's")
print(f"ok fp32: loss {l_split.item():.5f} = {l_ref.item():.5f}, gradients within {err32:.1e}")
if cuda or torch.backends.mkldnn.is_available():
    _, g16_fused = grads(fused, idx, tgt, bf16=True)
    _, g16_split = grads(split, idx, tgt, bf16=True)
    e_fused, e_split = rel(g16_fused, g_ref), rel(g16_split, g_ref)
    if e_split > 1.5 * e_fused + 1e-3:
        raise SystemExit(f"FAILED bf16: split {e_split:.2e} from fp32, fused {e_fused:.2e}")
    print(f"ok bf16: gradients from fp32's: split {e_split:.2e}, fused {e_fused:.2e}")

if cuda:
    # 2. the layout: dense q -> cuDNN's dq in (batch, tokens, heads, head_dim) order, no copy
    import torch.nn.functional as F

    from meshrun.train.qkv import split_qkv

    blk = Block(GPTConfig(d_model=768, n_heads=12, split_qkv=True)).to(dev)
    x = torch.randn(8, 1024, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    orders = {}
    for name in ("fused", "split"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "split":
                q, k, v = (z.view(8, 1024, 12, 64) for z in split_qkv(x, blk.qkv.weight, blk.qkv.bias))
            else:
                q, k, v = blk.qkv(x).view(8, 1024, 3, 12, 64).unbind(2)
            q4 = q.transpose(1, 2)
            q4.retain_grad()
            F.scaled_dot_product_attention(q4, k.transpose(1, 2), v.transpose(1, 2), is_causal=True).sum().backward()
        orders[name] = (q4.stride(), q4.grad.stride())
        print(f"{name}: q strides {q4.stride()}, dq strides {q4.grad.stride()}")
    q_st, dq_st = orders["split"]
    if sorted(range(4), key=lambda i: -q_st[i]) != sorted(range(4), key=lambda i: -dq_st[i]):
        raise SystemExit("FAILED layout: dq not in q's dense order: the copy this is for would remain")
    print("ok layout: dq in q's (batch, tokens, heads, head_dim) order")

    # 3. a compiled block's forward + backward, 128 x 1024 tokens, both ways, and the copy
    # kernels each leaves
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(128, 1024, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for name, flag in (("fused", False), ("split", True), ("fused", False), ("split", True)):
        torch.manual_seed(0)
        b = Block(GPTConfig(d_model=768, n_heads=12, split_qkv=flag)).to(dev)
        step = torch.compile(lambda: b(x).float().square().mean().backward())  # noqa: B023
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 20 * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        copies = sorted({e.key[:60] for e in prof.key_averages()
                         if any(s in e.key for s in ("stack", "transpose", "cat", "clone", "copy"))})
        print(f"block {name}: {ms:.2f} ms fwd+bwd; copy-like kernels: {copies}")
print("ALL OK")
