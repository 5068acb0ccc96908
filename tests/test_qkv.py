"""The q/k/v projection as three dense matmuls (train/qkv.py, GPTConfig.split_qkv) against the
one fused projection, on the CPU: eager, compiled, under autocast, and where it must not run."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrun.train.models import GPT, GPTConfig
from meshrun.train.qkv import split_qkv

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, head_loss=False, fused_mlp=False)


def _grads(model: GPT, idx: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair() -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    fused = GPT(GPTConfig(**SMALL, split_qkv=False))
    split = copy.deepcopy(fused)
    for blk in split.blocks:
        blk.split_qkv = True
    return fused, split


def test_the_check_script_passes_on_the_cpu():
    """tests/scripts/qkv_check.py, which the GPU host runs as it is (plus cuDNN's layout and timing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "tests/scripts/qkv_check.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ALL OK" in out.stdout and "ok fp32" in out.stdout


def test_split_equals_the_fused_projection_in_fp32():
    fused, split = _pair()
    idx = torch.randint(0, 64, (3, 16))
    (l1, g1), (l2, g2) = _grads(fused, idx), _grads(split, idx)
    assert l2 == pytest.approx(l1, rel=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # the same parameters, so the same state dict: checkpoints move between the two ways
    assert fused.state_dict().keys() == split.state_dict().keys()


def test_split_compiled_equals_eager():
    _, split = _pair()
    compiled = copy.deepcopy(split)
    idx = torch.randint(0, 64, (2, 16))
    l1, g1 = _grads(split, idx)
    l2, g2 = _grads(torch.compile(compiled), idx)  # type: ignore[arg-type]
    assert l2 == pytest.approx(l1, rel=1e-5)
    g2 = {name.removeprefix("_orig_mod."): g for name, g in g2.items()}
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6)


def test_autocast_casts_the_operands_and_fp32_parameters_get_fp32_gradients():
    lin = torch.nn.Linear(32, 96)
    x = torch.randn(2, 5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = split_qkv(x, lin.weight, lin.bias)
        ref = lin(x)
    assert q.dtype == torch.bfloat16 and q.shape == (2, 5, 32)
    for i, z in enumerate((q, k, v)):
        torch.testing.assert_close(z, ref[..., 32 * i:32 * (i + 1)])
        assert z.is_contiguous()  # dense: what cuDNN's gradients then match
    (q.float().sum() + 2 * k.float().sum() + 3 * v.float().sum()).backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    db = torch.cat([torch.full((32,), 10.0), torch.full((32,), 20.0), torch.full((32,), 30.0)])
    torch.testing.assert_close(lin.bias.grad, db)  # 10 tokens, each output's weight 1, 2, 3


def test_the_input_gradient_op_accumulates_the_three_products():
    dq, dk, dv = (torch.randn(7, 4, dtype=torch.float64) for _ in range(3))
    w = torch.randn(12, 5, dtype=torch.float64)
    got = torch.ops.meshrun.qkv_input_grad(dq, dk, dv, w)
    torch.testing.assert_close(got, torch.cat([dq, dk, dv], 1) @ w)
    torch.library.opcheck(torch.ops.meshrun.qkv_input_grad.default, (dq, dk, dv, w))


def test_auto_splits_only_on_cuda_and_only_whole_linears():
    """"auto" keeps the CPU on the fused projection (the default job's numbers are unchanged);
    a sharded weight (DeepSpeed ZeRO-3's ``ds_id``) or tensor parallelism's split module takes the
    fused path; a bad value is refused."""
    model = GPT(GPTConfig(**SMALL))
    blk = model.blocks[0]
    h = torch.randn(1, 4, 32)
    assert blk.split_qkv == "auto" and not blk._split(h)
    blk.split_qkv = True
    assert blk._split(h)
    blk.qkv.weight.ds_id = 3
    assert not blk._split(h)
    del blk.qkv.weight.ds_id
    blk.qkv = torch.nn.Sequential()  # as apply_tp replaces it (parallelize.SplitQKV)
    assert not blk._split(h)
    with pytest.raises(ValueError, match="split_qkv 'yes': expected True, False or 'auto'"):
        GPT(GPTConfig(**SMALL, split_qkv="yes"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"split_qkv: weight \(10, 4\)"):
        split_qkv(torch.randn(2, 4), torch.randn(10, 4), torch.randn(10))
