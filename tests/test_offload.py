"""AdamW with its moments in host memory (training/offload.py): the same update as torch's
fused AdamW, bit for bit, however the parameters are cut into slices; a state dict that loads
into host memory; and the planner's use of it, only where nothing else fits."""

import copy
import json
import subprocess
import sys

import pytest
from helpers import require


def _model_and_batches():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    # 8,000 and 3,300 values: cut at the slices of 1,024 and 2,048 tried below; the norm and biases whole
    model = nn.Sequential(nn.Embedding(500, 16), nn.Linear(16, 330), nn.LayerNorm(330), nn.Linear(330, 7))
    batches = [torch.randint(0, 500, (4, 3), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    return model, batches


def _steps(model, opt, batches, skip=None):
    import torch

    for i, x in enumerate(batches):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.found_inf = torch.tensor(1.0 if i == skip else 0.0)  # (Layout.update's flag: skip a non-finite step)
        opt.step()


@pytest.mark.parametrize("slice_elements", [1024, 2048, 1 << 20])
def test_the_streamed_update_is_fused_adamws_bit_for_bit(slice_elements):
    require("torch")
    import torch

    from meshrun.training.offload import StreamedAdamW, build_offloaded
    from meshrun.training.optim import build_optimizer

    model, batches = _model_and_batches()
    plain, streamed = copy.deepcopy(model), copy.deepcopy(model)
    a = build_optimizer(plain, 1e-2, 0.1)
    b = build_offloaded(streamed, 1e-2, 0.1)
    assert isinstance(b, StreamedAdamW) and a.defaults["fused"]
    b.slice_elements = slice_elements
    _steps(plain, a, batches, skip=2)
    _steps(streamed, b, batches, skip=2)
    for p, q in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        assert set(st) == set(sb["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(st["step"]) == float(sb["state"][i]["step"]) == 5.0  # six steps, one skipped
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], sb["state"][i][k])
    # the device holds two slices of moments, not the model's
    assert all(buf.numel() == slice_elements for pair in b._buffers.values() for buf in pair)


def test_a_loaded_state_goes_on_exactly_and_stays_in_host_memory():
    require("torch")
    import torch

    from meshrun.training.offload import build_offloaded

    model, batches = _model_and_batches()
    whole = copy.deepcopy(model)
    a = build_offloaded(whole, 1e-2, 0.1)
    a.slice_elements = 1024
    _steps(whole, a, batches)

    first = copy.deepcopy(model)
    b = build_offloaded(first, 1e-2, 0.1)
    _steps(first, b, batches[:3])
    saved = copy.deepcopy(b.state_dict())  # as a snapshot holds it
    second = copy.deepcopy(first)
    c = build_offloaded(second, 1e-2, 0.1)
    c.load_state_dict(saved)
    for st in c.state.values():
        assert st["exp_avg"].device.type == "cpu" and st["exp_avg_sq"].device.type == "cpu"
    c.slice_elements = 2048
    _steps(second, c, batches[3:])
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)


def test_slices_are_whole_multiples_of_the_cut():
    require("torch")
    import torch

    from meshrun.training.offload import StreamedAdamW

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="slice_elements=1000"):
        StreamedAdamW([p], slice_elements=1000, lr=1e-3, fused=True)
    with pytest.raises(ValueError, match="fused"):
        StreamedAdamW([p], lr=1e-3)


def _decide(host_gib):
    """The run policy for Llama-3-8B's shape (seq 4096) on one H200 with this host memory."""
    code = f"""
import json
from meshrun.config import TrainConfig
from meshrun.config.policy import Facts, resolve
from meshrun.errors import MeshrunError
from meshrun.modelinfo.spec import PRESETS
spec = PRESETS["llama3-8b"]
facts = Facts(world=1, local_world=1, dp=1, gpu_mem=141 * 2**30, bf16=True, params=spec.params,
              cpu_mem={host_gib} * 2**30)
try:
    c = resolve(spec, TrainConfig(seq_len=4096), facts)
    print(json.dumps([c.kind.name, c.activation_checkpointing, c.micro_batch, list(c.reasons)]))
except MeshrunError as exc:
    print(json.dumps(["refused", str(exc)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_llama3_8b_on_one_h200_offloads_its_moments_where_the_host_holds_them():
    """Nothing with the moments on the GPU fits one H200 (fp32 weights, gradients and moments
    alone are 120 GiB of 127 usable): the policy takes FSDP2 with the moments on the host,
    and refuses, naming the host's memory, where the host cannot hold them (60 GiB)."""
    kind, ac, micro, reasons = _decide(128)
    assert kind == "fsdp-offload" and micro >= 1, reasons
    assert reasons[0].startswith("planner: fsdp-offload predicted"), reasons
    refused = _decide(32)
    assert refused[0] == "refused" and "offload needs 59.8 GiB of CPU memory per node, of 32 GiB there" \
        in refused[1], refused


def test_a_model_that_fits_keeps_its_moments_on_the_gpu():
    """Offload is the last resort: with room for everything on the GPU, the pick is not an
    offload even where freeing the moments would allow a larger micro-batch."""
    code = """
from meshrun.config import TrainConfig
from meshrun.config.policy import Facts, resolve
from meshrun.modelinfo.spec import PRESETS
spec = PRESETS["gpt-1.3b"]
facts = Facts(world=1, local_world=1, dp=1, gpu_mem=80 * 2**30, bf16=True, params=spec.params, cpu_mem=2**40)
print(resolve(spec, TrainConfig(seq_len=2048), facts).kind.name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] in ("single", "fsdp-full"), out.stdout


def test_the_step_benchmark_runs_both_optimizers_on_the_same_tensors():
    """bench/offload_step.py, as a CPU check: both steps timed, and the parameters bitwise equal."""
    require("torch")
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "offload_step.py"), "--params-b", "0.001",
                          "--steps", "1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.join(root, "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.split("OFFLOAD ", 1)[1])
    assert row["bitwise_equal"] is True and row["params"] >= 10**6 and row["fused_s"] > 0 and row["streamed_s"] > 0


def test_a_shard_that_is_not_contiguous_and_mixed_dtypes_step_as_fused_adamw():
    """A parameter that is not contiguous goes whole (the buffers grow to it), and parameters
    of another dtype take a run of their own: still fused AdamW's update, bit for bit."""
    require("torch")
    import torch

    from meshrun.training.offload import StreamedAdamW

    def params():
        gen = torch.Generator().manual_seed(0)
        wide = torch.nn.Parameter(torch.randn(3, 3000, generator=gen).t())  # 9,000 values, not contiguous
        half = torch.nn.Parameter(torch.randn(700, generator=gen).to(torch.bfloat16))
        plain = torch.nn.Parameter(torch.randn(5000, generator=gen))
        return [wide, half, plain]

    a, b = params(), params()
    assert not a[0].is_contiguous()
    fused = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, fused=True)
    streamed = StreamedAdamW(b, slice_elements=1024, lr=1e-2, weight_decay=0.1, fused=True)
    for i in range(3):
        for ps, opt in ((a, fused), (b, streamed)):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i + p.numel())).to(p.dtype)
                if not p.is_contiguous():
                    p.grad = p.grad.t().contiguous().t()  # the parameter's own strides
            opt.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert max(buf.numel() for pair in streamed._buffers.values() for buf in pair) == 9000
    assert {dtype for _, dtype in streamed._buffers} == {torch.float32, torch.bfloat16}


def test_a_dry_run_decides_for_the_host_memory_it_is_given(tmp_path):
    """`meshrun train --dry-run --gpu-mem 141GiB` for Llama-3-8B's shape: --cpu-mem 128GiB
    takes fsdp-offload and says how much of the node's memory the moments take; 32GiB refuses
    it in one line that names the host's memory; without --cpu-mem (GPUs elsewhere) the reasons
    say the host memory was not checked."""
    require("transformers")
    import transformers as T
    from helpers import meshrun_here

    T.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0).save_pretrained(str(tmp_path))
    args = ("train", "--model", str(tmp_path), "--data", "random", "--dry-run", "--json", "--gpu-mem", "141GiB",
            "--nproc", "1", "--seq-len", "4096")

    def decided(*more):
        out = meshrun_here(*args, *more)
        return out, (json.loads(out.stdout[out.stdout.index("{"):]) if out.returncode == 0 else None)

    out, roomy = decided("--cpu-mem", "128GiB")
    assert roomy is not None and roomy["strategy"] == "fsdp-offload", out.stderr[-2000:]
    assert "the optimizer state offloaded: 59.8 GiB of host memory per node of the node's 128 GiB" in roomy["reasons"]
    out, _ = decided("--cpu-mem", "32GiB")
    assert out.returncode == 2 and "offload needs 59.8 GiB of CPU memory per node, of 32 GiB there" in out.stderr
    _, unknown = decided()
    assert any("not known here: not checked" in r for r in unknown["reasons"])
