"""meshrun's head loss (kernels/head_loss.py: the head's matmul and the cross-entropy,
its gradient written in the forward by a Triton kernel) against torch's, on the CPU.

The kernel runs here through Triton's interpreter (TRITON_INTERPRET=1, in a process of its
own: the interpreter is chosen when a kernel is defined), and through Triton's compiler down
to an sm_90 binary; CI installs Triton for both. On a GPU host the same script runs the
compiled kernel (bench/gpu_session.sh checks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import clean_env, require

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "head_loss_check.py")


def test_head_loss_without_triton_is_the_plain_expression_and_the_gpt_default():
    """head_cross_entropy where its kernel cannot run: F.cross_entropy(F.linear(h, w).float())
    bit for bit, gradients too; wrong shapes refused by name. meshrun's GPT takes it by
    default, and its loss and gradients equal those of the GPT with the plain loss."""
    from meshrun.kernels import head_loss as ce_kernel
    from meshrun.training.models.gpt import GPT, GPTConfig

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    torch.manual_seed(0)
    h = torch.randn(7, 8, requires_grad=True)
    w = torch.randn(33, 8, requires_grad=True)
    t = torch.randint(0, 33, (7,))
    t[2] = -100
    loss = ce_kernel.head_cross_entropy(h, w, t)
    loss.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(F.linear(h, w).float(), t)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(grads[0], h.grad) and torch.equal(grads[1], w.grad)
    with pytest.raises(ValueError, match=r"h \(7, 8\), weight \(33, 9\) and targets \(7,\)"):
        ce_kernel.head_cross_entropy(h, torch.randn(33, 9), t)

    cfg = dict(vocab=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    assert GPTConfig(**cfg).head_loss  # the default
    head, plain = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, head_loss=False))
    plain.load_state_dict(head.state_dict())
    idx = torch.randint(0, 64, (2, 9))
    out = []
    for model in (head, plain):
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_a_zero3_partitioned_head_takes_the_plain_loss(monkeypatch):
    """The head loss uses the tied weight without calling the head's Linear, so a weight only
    that Linear's hooks gather (DeepSpeed ZeRO-3's, marked ``ds_id``) takes the plain loss."""
    from meshrun.kernels import head_loss as ce_kernel
    from meshrun.training.models.gpt import GPT, GPTConfig

    calls = []
    real = ce_kernel.head_cross_entropy
    monkeypatch.setattr(ce_kernel, "head_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = GPT(GPTConfig(vocab=64, seq_len=8, d_model=16, n_layers=1, n_heads=2))
    idx = torch.randint(0, 64, (2, 9))
    model(idx[:, :-1], idx[:, 1:])
    assert calls == [1]
    model.head.weight.ds_id = 0
    model(idx[:, :-1], idx[:, 1:])
    assert calls == [1]


def test_kernels_match_torch_under_the_interpreter():
    """Loss and gradients equal torch's over a vocabulary across and not a multiple of the
    kernel's block, with ignored tokens, all tokens ignored (nan), eager and compiled by
    Inductor in one graph, and inside meshrun's GPT against its plain loss."""
    require("triton")
    env = clean_env(TRITON_INTERPRET="1", PYTHONPATH=os.path.join(os.path.dirname(HERE), "src"))
    out = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "ALL OK" in out.stdout, out.stdout[-2000:]


def test_kernels_compile_for_hopper():
    """The kernel through Triton's real compiler down to an sm_90 binary (no GPU needed):
    catches what the interpreter lets through (types of loop-carried values, casts)."""
    require("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from meshrun.kernels import head_loss, head_loss_triton

    sig = {"x_ptr": "*bf16", "stride": "i64", "t_ptr": "*i64", "rows_ptr": "*fp32", "V": "i32",
           "ignore_index": "i64", "BLOCK": "constexpr"}
    kernel = head_loss_triton.triton_ce_grad_forward
    src = ASTSource(kernel, {k: sig[k] for k in kernel.arg_names}, {"BLOCK": head_loss.BLOCK})
    binary = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert binary.asm.get("cubin")
