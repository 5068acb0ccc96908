"""meshrun's head loss (kernels/head_loss.py) against F.cross_entropy: run by
tests/test_head_loss.py on the CPU under Triton's interpreter (TRITON_INTERPRET=1), and as it
is on a GPU host (bench/gpu_session.sh checks). Prints ALL OK."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshrun.kernels import head_loss as ce_kernel
from meshrun.training.models.gpt import GPT, GPTConfig

dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
usable = ce_kernel.register()
if not usable.get(dev.type):
    raise SystemExit(f"the kernels cannot run on {dev.type} here ({usable}): nothing would be tested")
BLOCK = ce_kernel.BLOCK


torch.manual_seed(0)
# a vocabulary that is not a multiple of the head's alignment: its matmuls run padded
cfg = dict(vocab=500, seq_len=16, d_model=32, n_layers=2, n_heads=2)
assert ce_kernel.padded_vocab(500) == 512 and ce_kernel.padded_vocab(512) == 512
plain = GPT(GPTConfig(**cfg, head_loss=False)).to(dev)
idx = torch.randint(0, 500, (2, 17), device=dev)


# head_cross_entropy: the head's matmul and the loss, the gradient written in the forward,
# against F.cross_entropy(F.linear(h, w).float()): loss and both gradients, with ignored rows,
# a vocabulary across blocks and padded (5,000 -> 5,056), an incoming gradient that is not 1,
# eager and compiled whole; then a vocabulary the head runs unpadded
def head_pair(fn, n: int, v: int, d: int, ignored: tuple[int, ...] = ()):
    g = torch.Generator(device=dev).manual_seed(n + v)
    h0 = torch.randn(n, d, device=dev, generator=g)
    w0 = torch.randn(v, d, device=dev, generator=g) * 0.3
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    for i in ignored:
        t[i] = -100
    out = []
    for f in (fn, lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = f(h, w, t)
        (loss * 0.5).backward()
        out.append((loss.detach(), h.grad, w.grad))
    return out


for case, fn in (("eager", ce_kernel.head_cross_entropy),
                 ("compiled, fullgraph", torch.compile(ce_kernel.head_cross_entropy, fullgraph=True))):
    (l1, dh1, dw1), (l2, dh2, dw2) = head_pair(fn, 6, BLOCK + 904, 16, ignored=(2,))
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh1, dh2, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw1, dw2, rtol=1e-4, atol=1e-6)
    print("ok head loss", case, flush=True)
(l1, dh1, dw1), (l2, dh2, dw2) = head_pair(ce_kernel.head_cross_entropy, 5, 3 * ce_kernel.VOCAB_ALIGN, 16)
torch.testing.assert_close((l1, dh1, dw1), (l2, dh2, dw2), rtol=1e-4, atol=1e-6)
print("ok head loss, a vocabulary that needs no padding", flush=True)
(l1, dh1, _), (l2, _, _) = head_pair(ce_kernel.head_cross_entropy, 3, 100, 8, ignored=(0, 1, 2))
assert l1.isnan() and l2.isnan() and not dh1.any(), (l1, l2)
print("ok head loss, every token ignored", flush=True)

# and in meshrun's GPT against its plain loss, eager and compiled, same weights
head = GPT(GPTConfig(**cfg, head_loss=True)).to(dev)
head.load_state_dict(plain.state_dict())
for compile_ in (False, True):
    res = []
    for model in (plain, head):
        model.zero_grad()
        step = torch.compile(model, fullgraph=True) if compile_ else model
        loss = step(idx[:, :-1], idx[:, 1:])
        loss.backward()
        res.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    print(f"ok GPT head loss, compiled {compile_}", flush=True)
print("ALL OK")
