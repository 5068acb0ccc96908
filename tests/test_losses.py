"""The chunked linear + cross-entropy (training/models/losses.py) against torch's own loss."""

import pytest

pytestmark = pytest.mark.framework
torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from meshrun.training.models import losses  # noqa: E402
from meshrun.training.models.gpt import GPT, GPTConfig  # noqa: E402
from meshrun.training.models.losses import linear_cross_entropy  # noqa: E402


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_TOKENS", 96)  # 500 tokens: six chunks, the last one short


def _inputs(seed=0, tokens=500, d=32, vocab=300):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g, requires_grad=True)
    w = (0.1 * torch.randn(vocab, d, generator=g)).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::7] = -100  # ignored positions, as padding would be
    return x, w, y


def _grads(loss_fn, x, w, y, scale=1.0):
    x.grad = w.grad = None
    loss = loss_fn(x, w, y)
    (scale * loss).backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


def test_loss_and_gradients_equal_torchs_in_fp32(small_chunks):
    x, w, y = _inputs()
    ref = _grads(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y), x, w, y, scale=3.0)
    got = _grads(linear_cross_entropy, x, w, y, scale=3.0)  # the incoming gradient scales both
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_every_token_ignored_is_nan_like_torch():
    x, w, y = _inputs(tokens=8)
    y[:] = -100
    assert torch.isnan(F.cross_entropy(x @ w.t(), y)) and torch.isnan(linear_cross_entropy(x, w, y))


def test_under_bf16_autocast_it_matches_torchs_recipe(small_chunks):
    x, w, y = _inputs(1)

    def under_autocast(fn):
        def run(x, w, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x, w, y)
        return run

    ref = _grads(under_autocast(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y)), x, w, y)
    got = _grads(under_autocast(linear_cross_entropy), x, w, y)
    assert got[1].dtype == x.dtype and got[2].dtype == w.dtype  # gradients in the parameters' dtype
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(ref[1:], got[1:]):  # bf16 matmuls both ways: agree to bf16's resolution
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()


def _gpt(fused):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=256, seq_len=32, d_model=32, n_layers=2, n_heads=4, fused_loss=fused))


def test_gpt_with_the_fused_loss_trains_like_the_plain_one(small_chunks):
    """Same initial weights, same batch: same loss, and the same gradient on every
    parameter, the tied embedding / head included."""
    idx = torch.randint(0, 256, (6, 33), generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        model = _gpt(fused)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiles_as_one_graph():
    """torch.compile traces the autograd function whole (fullgraph: no graph break). In a
    process of its own: Inductor's compile-worker pool in the pytest process would hang the
    processes later tests fork from it."""
    import subprocess
    import sys

    code = """
import torch
from meshrun.training.models import losses
from meshrun.training.models.gpt import GPT, GPTConfig
losses.CHUNK_TOKENS = 96
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=256, seq_len=32, d_model=32, n_layers=2, n_heads=4, fused_loss=True))
idx = torch.randint(0, 256, (6, 33), generator=torch.Generator().manual_seed(3))
eager = model(idx[:, :-1], idx[:, 1:])
compiled = torch.compile(model, fullgraph=True)(idx[:, :-1], idx[:, 1:])
torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
print("same", compiled.item(), eager.item())
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "same" in res.stdout, res.stderr[-3000:]


def test_the_planner_holds_one_chunk_of_logits_for_the_fused_loss():
    """At 256K tokens the whole-logits loss is ~14 bytes per vocabulary entry per token
    (about 170 GiB for GPT 1.3B: it cannot fit); the fused one holds a chunk."""
    from dataclasses import replace

    from meshrun.modelinfo.spec import PRESETS
    from meshrun.plan import ClusterSpec, TrainSpec, make_plan
    from meshrun.plan.memory import logits_bytes

    t = TrainSpec(262144, 1, None, precision="bf16", activation_checkpointing="full")
    peaks, logits = {}, {}
    for fused in (False, True):
        spec = replace(PRESETS["gpt-1.3b"], fused_loss=fused)
        plan = make_plan(spec, ClusterSpec(1, 4, 141 * 10**9), t, framework="any")
        c = next(x for x in plan.candidates if x.strategy.label == "fsdp-grad-op+ac")
        logits[fused] = logits_bytes(spec, t, c.strategy, 1)
        peaks[fused] = c.memory.allocator_peak
    assert logits[False] > 150 * 2**30 and logits[True] < 3 * 2**30
    assert peaks[False] > 141 * 10**9 > peaks[True]  # fits a 141 GB card only with the fused loss
