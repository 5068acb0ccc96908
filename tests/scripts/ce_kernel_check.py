"""meshrun.train.ce_kernel against F.cross_entropy: run by tests/test_ce_kernel.py on the CPU
under Triton's interpreter (TRITON_INTERPRET=1), and as it is on a GPU host. Prints ALL OK."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from meshrun.train import ce_kernel
from meshrun.train.models import GPT, GPTConfig

dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
usable = ce_kernel.register()
if not usable.get(dev.type):
    raise SystemExit(f"the kernels cannot run on {dev.type} here ({usable}): nothing would be tested")
BLOCK = ce_kernel.BLOCK


def pair(fn, n: int, v: int, dtype: torch.dtype, scale: float = 3.0, ignored: tuple[int, ...] = ()):
    """(loss, gradient) of fn and of F.cross_entropy over the same logits; the loss is
    halved before backward so that the incoming gradient is not 1."""
    g = torch.Generator(device=dev).manual_seed(n * v)
    x = (torch.randn(n, v, device=dev, generator=g) * scale).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    for i in ignored:
        t[i] = -100
    out = []
    for f in (fn, lambda a, b: F.cross_entropy(a.float(), b)):
        loss = f(x, t)
        (loss * 0.5).backward()
        out.append((loss.detach(), x.grad.clone()))
        x.grad = None
    return out


def close(case: str, ours, ref, dtype: torch.dtype) -> None:
    (l1, g1), (l2, g2) = ours, ref
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6, msg=lambda m: f"{case}: loss: {m}")
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(g1.float(), g2.float(), **tol, msg=lambda m: f"{case}: gradient: {m}")
    assert g1.dtype == dtype, (case, g1.dtype)
    print("ok", case, flush=True)


cases = [
    ("vocabulary below one block", 6, 300, torch.float32, 3.0, ()),
    ("exactly one block", 5, BLOCK, torch.float32, 3.0, ()),
    ("two blocks and a tail, bf16, one token ignored", 6, BLOCK + 904, torch.bfloat16, 3.0, (1,)),
    ("large logits", 4, 2 * BLOCK + 808, torch.float32, 50.0, (0, 3)),
]
for case, n, v, dtype, scale, ignored in cases:
    close(case, *pair(ce_kernel.cross_entropy, n, v, dtype, scale, ignored), dtype)

# every token ignored: torch's nan, and no gradient into the logits
(l1, g1), (l2, _) = pair(ce_kernel.cross_entropy, 3, 100, torch.float32, ignored=(0, 1, 2))
assert l1.isnan() and l2.isnan() and not g1.any(), (l1, l2)
print("ok every token ignored", flush=True)

# compiled by Inductor as one graph: the ops are called from inside it
compiled = torch.compile(ce_kernel.cross_entropy, fullgraph=True)
close("compiled, fullgraph", *pair(compiled, 5, 700, torch.float32, ignored=(2,)), torch.float32)

# writing the gradient over the logits (an intermediate, as in the GPT): the same numbers
close("over the logits", *pair(lambda a, b: ce_kernel.cross_entropy(a * 1, b, overwrite_logits=True), 6, BLOCK + 904,
                               torch.bfloat16, ignored=(1,)), torch.bfloat16)

# compiled with a head matmul in front: Inductor hands the in-place backward the saved logits'
# own buffer, so the backward allocates nothing of the logits' size (the plain op's output would be)
from torch._inductor.utils import run_and_get_code  # noqa: E402

n, v, d = 8, 700, 16
h = torch.randn(n, d, device=dev, requires_grad=True)
w = torch.randn(v, d, device=dev, requires_grad=True)
t = torch.randint(0, v, (n,), device=dev)
head_loss = torch.compile(lambda a, b, c: ce_kernel.cross_entropy(a @ b.t(), c, overwrite_logits=True), fullgraph=True)
_, codes = run_and_get_code(lambda: head_loss(h, w, t).backward())
bwd = [c for c in codes if "cross_entropy_rows_backward_" in c]
assert len(bwd) == 1, [c[:200] for c in codes]
assert "cross_entropy_rows_backward_.default(" in bwd[0]
assert not re.search(rf"empty_strided_\w+\(\({n}, {v}\)", bwd[0]), "the backward allocates a logits-sized buffer"
hg, wg = h.grad.clone(), w.grad.clone()
h.grad = w.grad = None
F.cross_entropy(h @ w.t(), t).backward()
torch.testing.assert_close(hg, h.grad, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(wg, w.grad, rtol=1e-5, atol=1e-6)
print("ok compiled over the logits: no second logits buffer", flush=True)

# meshrun's GPT with the kernel loss against its plain loss, same weights
torch.manual_seed(0)
cfg = dict(vocab=512, seq_len=16, d_model=32, n_layers=2, n_heads=2)
plain = GPT(GPTConfig(**cfg)).to(dev)
kernel = GPT(GPTConfig(**cfg, triton_loss=True)).to(dev)
kernel.load_state_dict(plain.state_dict())
idx = torch.randint(0, 512, (2, 17), device=dev)
losses = []
for model in (plain, kernel):
    loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    losses.append(loss.detach())
torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
for (name, p), q in zip(plain.named_parameters(), kernel.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"GPT {name}: {m}")
print("ok GPT", flush=True)

# and both compiled as whole graphs (the in-place backward inside the GPT's compiled backward)
outs = []
for model in (plain, kernel):
    model.zero_grad()
    loss = torch.compile(model, fullgraph=True)(idx[:, :-1], idx[:, 1:])
    loss.backward()
    outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
for a, b in zip(outs[0][1], outs[1][1]):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("ok GPT compiled", flush=True)
# head_cross_entropy: the head's matmul and the loss, the gradient written in the forward,
# against F.cross_entropy(F.linear(h, w).float()): loss and both gradients, with ignored rows,
# a vocabulary across blocks, an incoming gradient that is not 1, eager and compiled whole
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
