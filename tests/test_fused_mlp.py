"""The GPT MLP through meshrun's custom ops (kernels/fused_mlp.py): on the CPU they take
the plain torch path, which must compute what Linear, GELU (tanh), Linear compute, eager and
compiled, with and without autocast. The cuBLASLt path is checked on a GPU by
tests/scripts/fused_mlp_check.py (bench/gpu_session.sh checks)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshrun.kernels import fused_mlp
from meshrun.training.models.gpt import GPT, GPTConfig

ONE_BLOCK = dict(vocab=64, seq_len=16, d_model=32, n_layers=1, n_heads=4)  # a GPT small enough for the CPU


def _plain(x: torch.Tensor, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    return down(F.gelu(up(x), approximate="tanh"))


def _pair(d: int = 16) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


def _grads(mods: tuple[nn.Linear, nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for m in mods for p in (m.weight, m.bias)]


def test_ops_compute_linear_gelu_linear_and_its_gradients_fp32():
    up, down = _pair()
    up2, down2 = copy.deepcopy(up), copy.deepcopy(down)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    before = fused_mlp.PATHS["torch"]
    y = fused_mlp.gelu_mlp(x, up, down)
    ref = _plain(x2, up2, down2)
    assert y.shape == ref.shape == (3, 5, 16)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(y)  # a gradient that is not all ones, so a transposed term would show
    (y * w).sum().backward()
    (ref * w).sum().backward()
    for got, want in zip(_grads((up, down), x), _grads((up2, down2), x2)):
        assert got is not None and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the forward and the backward, both on the ops' torch path, and the reason on record
    assert fused_mlp.PATHS["torch"] - before == 2
    assert fused_mlp.FALLBACK.get("not on a GPU") == "not on a GPU"


def test_under_autocast_the_operands_are_cast_and_the_fp32_parameters_get_fp32_gradients():
    up, down = _pair()
    up2, down2 = copy.deepcopy(up), copy.deepcopy(down)
    x = torch.randn(4, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused_mlp.gelu_mlp(x, up, down)
        ref = _plain(x2, up2, down2)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    ref.float().sum().backward()
    for got, want in zip(_grads((up, down), x), _grads((up2, down2), x2)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_the_op_has_no_graph_break_under_torch_compile():
    up, down = _pair()
    x = torch.randn(8, 16)
    compiled = torch.compile(lambda t: fused_mlp.gelu_mlp(t, up, down), fullgraph=True)  # a break raises
    torch.testing.assert_close(compiled(x), _plain(x, up, down), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_with_the_fused_mlp_trains_as_the_plain_gpt(compiled):
    """Three SGD steps of a small GPT, fused MLP against the plain one from the same weights
    (fp32): the same losses and the same weights after. (Not AdamW: the key bias's gradient
    is zero up to rounding, softmax being blind to it, and Adam scales rounding noise to
    full steps.)"""
    cfg = {**ONE_BLOCK, "n_layers": 2}
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**cfg, fused_mlp=False))
    fused = GPT(GPTConfig(**cfg, fused_mlp=True))
    fused.load_state_dict(plain.state_dict())
    assert all(b.fused_mlp for b in fused.blocks) and not any(b.fused_mlp for b in plain.blocks)
    losses = {}
    for name, model in (("plain", plain), ("fused", fused)):
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = torch.compile(model) if compiled else model
        idx = torch.randint(0, 64, (4, 16))  # one batch, learnt over the steps
        out = []
        for _ in range(3):
            loss = step(idx, torch.roll(idx, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    assert losses["plain"][-1] < losses["plain"][0]  # it trains at all
    torch.testing.assert_close(losses["fused"], losses["plain"], rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=n)


def test_moe_blocks_keep_their_experts():
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_experts=2, fused_mlp=True))
    assert not model.blocks[0].fused_mlp


def test_the_configured_way_resolves_per_block():
    """GPTConfig.fused_mlp: "auto" is the plain MLP where nvmath-python does not import (as
    here: the CPU build of torch has no CUDA libraries for it) and the fused MLP, on CUDA only,
    where it does; True the fused MLP everywhere; anything else is refused by name."""
    from meshrun.training.models.gpt import _mlp_way

    auto = _mlp_way(GPTConfig(**ONE_BLOCK))
    assert auto == ((True, True) if fused_mlp.available() else (False, True))
    assert _mlp_way(GPTConfig(**ONE_BLOCK, fused_mlp=True)) == (True, False)
    assert _mlp_way(GPTConfig(**ONE_BLOCK, fused_mlp=False)) == (False, False)
    assert _mlp_way(GPTConfig(**ONE_BLOCK, fused_mlp=True, n_experts=2)) == (False, False)
    with pytest.raises(ValueError, match="fused_mlp 'dglue': expected True, False or 'auto'"):
        GPT(GPTConfig(**ONE_BLOCK, fused_mlp="dglue"))


def test_the_model_names_the_kernels_it_runs_for_the_trainers_first_line():
    """Nothing on the CPU; on CUDA the fused MLP (the head loss only where Triton runs on CUDA,
    not on this machine), nothing on tensor-parallel shards."""
    model = GPT(GPTConfig(**ONE_BLOCK, fused_mlp=True))
    cuda = torch.device("cuda")
    assert model.meshrun_kernels(torch.device("cpu")) == []
    assert model.meshrun_kernels(cuda) == ["MLP's GELU in cuBLASLt epilogues"]
    assert model.meshrun_kernels(cuda, tp=2) == []
    assert GPT(GPTConfig(**ONE_BLOCK, fused_mlp=False)).meshrun_kernels(cuda) == []


def test_partitioned_weights_take_the_plain_mlp():
    """A weight that its Linear's own forward must gather (a DeepSpeed ZeRO-3 parameter, marked
    ``ds_id``) is never used by the op, which does not call the Linear: the plain MLP runs."""
    model = GPT(GPTConfig(**ONE_BLOCK, fused_mlp=True))
    x = torch.randn(2, 16, 32)
    before = dict(fused_mlp.PATHS)
    model.blocks[0](x)
    assert fused_mlp.PATHS["torch"] == before.get("torch", 0) + 1  # the op ran (its torch path, on the CPU)
    for p in model.blocks[0].parameters():
        p.ds_id = 0
    model.blocks[0](x)
    assert fused_mlp.PATHS["torch"] == before.get("torch", 0) + 1  # not again


def test_meshrun_train_kernels_option_builds_the_gpt_with_or_without_them():
    """`meshrun train --kernels auto` (the default) builds the GPT with the head loss and the
    MLP's "auto" way; `--kernels plain` with neither."""
    from meshrun.config import TrainConfig, validate
    from meshrun.training.factories import build_model

    auto = build_model(validate(TrainConfig(model_size="gpt-tiny", seq_len=16)))
    plain = build_model(validate(TrainConfig(model_size="gpt-tiny", seq_len=16, kernels="plain")))
    assert auto.cfg.head_loss and auto.cfg.fused_mlp == "auto"
    assert not plain.cfg.head_loss and plain.cfg.fused_mlp is False


class _FakeAdvanced:
    """Stands in for nvmath.linalg.advanced where no GPU is (the real one needs CUDA): records
    what _matmul asks of a Matmul, so its plan cache's logic is checked here."""

    class MatmulEpilog:
        DGELU = "DGELU"

    def __init__(self, refuse: bool = False):
        self.log: list[str] = []
        self.refuse = refuse
        outer = self

        class Matmul:
            def __init__(self, a, b, stream=None):
                outer.log.append("new")
                self.a, self.b = a, b

            def plan(self, epilog, epilog_inputs, stream=None):
                if outer.refuse:
                    raise RuntimeError("no algorithm")
                outer.log.append(f"plan {epilog}")

            def autotune(self, iterations, stream=None):
                outer.log.append("autotune")

            def reset_operands_unchecked(self, a, b, epilog_inputs, stream=None):
                outer.log.append("reset")
                self.a, self.b = a, b

            def execute(self, stream=None):
                outer.log.append("execute")
                return self.a @ self.b

            def release_operands(self):
                outer.log.append("release")
                self.a = self.b = None

        self.Matmul = Matmul


def test_plans_are_made_once_per_layout_and_operands_not_kept(monkeypatch):
    fake = _FakeAdvanced()
    monkeypatch.setattr(fused_mlp, "_nvmath", lambda: fake)
    monkeypatch.setattr(fused_mlp, "_PLANS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    for _ in range(3):
        torch.testing.assert_close(fused_mlp._matmul(a, b, "DGELU", {}), a @ b)
    assert fake.log == ["new", "plan DGELU", "autotune", "execute", "release"] + ["reset", "execute", "release"] * 2
    fused_mlp._matmul(torch.randn(4, 16), torch.randn(16, 2), "DGELU", {})  # another layout: another plan
    assert fake.log.count("new") == 2 and len(fused_mlp._PLANS) == 2

    refusing = _FakeAdvanced(refuse=True)
    monkeypatch.setattr(fused_mlp, "_nvmath", lambda: refusing)
    monkeypatch.setattr(fused_mlp, "_PLANS", {})
    for _ in range(2):  # refused once, remembered: not planned again
        with pytest.raises(RuntimeError, match="no algorithm"):
            fused_mlp._matmul(a, b, "DGELU", {})
    assert refusing.log == ["new"]


class _PlannedStandIn:
    """A planned nvmath Matmul as _Direct reads it (the attributes execute() uses), with an
    epilogue that has one input (by pointer) and one output (allocated per call)."""

    def __init__(self):
        self.num_operands, self.beta, self.alpha = 2, np.zeros(1, np.float32), np.ones(1, np.float32)
        self.handle, self.mm_desc, self.mm_desc_ifc = 11, 12, {}
        self.a_layout_ptr, self.b_layout_ptr, self.c_layout_ptr, self.d_layout_ptr = 21, 22, 23, 24
        self.cached_best_algorithm_struct = np.zeros(8, np.uint64)
        self.result_traits = type("T", (), {"result_shape": (4, 2), "result_strides": (1, 4)})()
        self.d_dtype_name = "float32"
        self.workspace = type("W", (), {"size": 1024})()

        class Handler:
            def __init__(self, name, shape=None):
                self.name, self.shape = name, shape

            def attributes(self):
                return self.shape, (1, self.shape[0]), "float32"

            def update_pointer(self, desc, ptr):
                desc[self.name] = ptr

        self.epilog_output_handlers = [Handler("gelu_aux", (4, 2))]
        self.epilog_input_name_to_handler = {"bias": Handler("bias")}


def test_direct_call_passes_the_plans_descriptors_and_fresh_buffers(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_mlp, "_cublaslt_matmul", lambda: lambda *args: calls.append(args))
    mm = _PlannedStandIn()
    direct = fused_mlp._Direct(mm, torch.device("cpu"))
    a, b, bias = torch.randn(4, 8), torch.randn(8, 2), torch.randn(4)
    stream = type("S", (), {"cuda_stream": 99})()
    d, outs = direct(a, b, {"bias": bias}, stream)
    (args,) = calls
    assert args[:3] == (11, 12, mm.alpha.ctypes.data)
    assert args[3:7] == (a.data_ptr(), 21, b.data_ptr(), 22) and args[7:10] == (mm.beta.ctypes.data, 0, 23)
    assert args[10:12] == (d.data_ptr(), 24) and args[12] == mm.cached_best_algorithm_struct.ctypes.data
    assert args[14:] == (1024, 99) and args[13] != 0  # a workspace of the plan's size, on the caller's stream
    assert d.shape == (4, 2) and d.stride() == (1, 4) and d.dtype == torch.float32  # the plan's result layout
    assert outs["gelu_aux"].stride() == (1, 4)
    assert mm.mm_desc_ifc == {"bias": bias.data_ptr(), "gelu_aux": outs["gelu_aux"].data_ptr()}
    d2, outs2 = direct(a, b, {"bias": bias}, stream)  # each call its own result and aux
    assert d2.data_ptr() != d.data_ptr() and mm.mm_desc_ifc["gelu_aux"] == outs2["gelu_aux"].data_ptr()

    mm.beta[0] = 1.0  # a @ b + beta c: left to execute()
    with pytest.raises(AttributeError):
        fused_mlp._Direct(mm, torch.device("cpu"))


def _epilogue_semantics(a, b, epilog, inputs):
    """What cuBLASLt's epilogues compute (NVIDIA's cublasLtEpilogue_t documentation), in torch:
    stands in for _matmul on the CPU so that the operands, transposes and outputs the fused
    MLP hands to cuBLASLt are checked here; the GPU check (tests/scripts/fused_mlp_check.py)
    compares the real epilogues with the plain path."""
    d = a @ b
    if epilog == "GELU_AUX_BIAS":
        pre = d + inputs["bias"][:, None]
        return F.gelu(pre, approximate="tanh"), {"gelu_aux": pre}
    if epilog == "DGELU":
        return torch.ops.aten.gelu_backward(d, inputs["gelu_aux"], approximate="tanh")
    raise AssertionError(epilog)


def test_the_epilogues_get_operands_that_give_the_plain_gradients(monkeypatch):
    monkeypatch.setattr(fused_mlp, "_matmul", _epilogue_semantics)
    torch.manual_seed(0)
    n, d = 12, 8
    x, dy = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    w_up, b_up = torch.randn(4 * d, d, dtype=torch.float64), torch.randn(4 * d, dtype=torch.float64)
    w_down, b_down = torch.randn(d, 4 * d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    y, g, h = fused_mlp._forward_cublaslt(x, w_up, b_up, w_down, b_down)
    y0, g0, h0 = fused_mlp._forward_torch(x, w_up, b_up, w_down, b_down)
    for got, want in ((y, y0), (g, g0), (h, h0)):
        torch.testing.assert_close(got, want)
    got = fused_mlp._backward_cublaslt(x, w_up, dy, w_down, g, h)
    want = fused_mlp._backward_plain(x, w_up, dy, w_down, g0, h0)
    for name, a, b in zip(("dx", "dW_up", "db_up", "dW_down", "db_down"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=name)
