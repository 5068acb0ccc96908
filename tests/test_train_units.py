"""Pure pieces of the trainer: block discovery, schedule, MFU, data sharding, config."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from helpers import BENCH, DATA, bench_module, clean_env, require  # noqa: E402

from meshrun.config import TrainConfig, build_config  # noqa: E402
from meshrun.errors import MeshrunError  # noqa: E402
from meshrun.modelinfo.blocks import find_blocks  # noqa: E402
from meshrun.training.loader import ShardedIterable, TokenChunks  # noqa: E402
from meshrun.training.metrics import mfu, peak_for_name  # noqa: E402
from meshrun.training.models.gpt import GPT, GPTConfig  # noqa: E402
from meshrun.training.optim import lr_factor  # noqa: E402

nn = torch.nn


class HFLlamaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


class GPT2Like(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class Unusual(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        self.stack = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_find_blocks_common_layouts_and_override():
    assert find_blocks(HFLlamaLike())[0] == "model.layers"
    assert find_blocks(GPT2Like())[0] == "transformer.h"
    assert find_blocks(GPT(GPTConfig(vocab=16, seq_len=8, d_model=8, n_layers=2, n_heads=2)))[0] == "blocks"
    assert find_blocks(Unusual())[0] == "stack"  # the largest ModuleList
    assert find_blocks(nn.Linear(2, 2)) is None
    assert find_blocks(Unusual(), "small")[0] == "small"
    with pytest.raises(MeshrunError, match="--blocks='nothing.here'"):
        find_blocks(Unusual(), "nothing.here")


def test_warmup_then_cosine_to_min_ratio():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA A10G", 70e12),
    ("Some Future GPU", None),
])
def test_peak_table(name, peak):
    assert peak_for_name(name) == peak


def test_mfu_formula_matches_the_baseline_document():
    # BASELINE.md: 124M, 333,396 tokens/s/GPU -> 29.0% on a 989.4 TFLOP/s card.
    model = GPT(GPTConfig(vocab=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12))
    assert mfu(333_396, model.flops_per_token(), 989.4e12) == pytest.approx(0.290, abs=0.002)
    assert mfu(1000, None, 989.4e12) is None and mfu(1000, 1e9, None) is None


def test_token_chunks_shift_targets():
    ds = TokenChunks(torch.arange(10, dtype=torch.uint8), seq_len=4)
    assert len(ds) == 2
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]


def test_iterable_sharding_is_disjoint_and_complete():
    class Count(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    shards = [list(ShardedIterable(Count(), r, 3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[1] == [1, 4, 7]


def test_config_sources_and_accumulation():
    cfg = build_config({"steps": 7}, {"micro_batch": 4, "global_batch": 32}, "a.yaml")
    assert cfg.accumulation(4) == 2 and cfg.steps == 7
    assert cfg.source("steps") == "--steps (from config a.yaml)" and cfg.source("micro_batch") == "--micro-batch"
    assert TrainConfig().accumulation(8) == 1
    assert TrainConfig.from_json(cfg.to_json()) == cfg


def test_attention_choice_goes_first_and_the_order_comes_back():
    """--attention puts one SDPA kernel first and keeps the others behind it (fallbacks for
    inputs it does not take); leaving the context restores torch's order. auto and CPU runs
    leave torch's order alone. (The order is process state; no GPU is needed to read it.)"""
    from torch.nn.attention import SDPBackend

    from meshrun.training.models.attention import attention_kernels

    torchs = torch._C._get_sdp_priority_order()
    gpu = torch.device("cuda", 0)
    with attention_kernels("cudnn", gpu):
        inside = torch._C._get_sdp_priority_order()
        assert inside[0] == int(SDPBackend.CUDNN_ATTENTION)
        assert sorted(inside) == sorted(torchs)
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == torchs
    for choice, device in (("auto", gpu), ("flash", torch.device("cpu"))):
        with attention_kernels(choice, device):
            assert torch._C._get_sdp_priority_order() == torchs


def _ddp_rebuild_release():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshrun.training.parallel.ddp import release_old_buckets

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ddp = DDP(model, bucket_cap_mb=1)
    release_old_buckets(ddp)
    seen = []
    for _ in range(3):
        ddp(torch.randn(4, 8)).sum().backward()
        seen.append((ddp._has_rebuilt_buckets, ddp.released_old_buckets, len(model._forward_pre_hooks)))
    dist.barrier()
    return seen


def test_ddp_releases_its_first_buckets_once_right_after_the_rebuild():
    """Real DDP on 2 gloo processes: the buckets are rebuilt at the second forward; the
    release runs in that forward (after the rebuild, before the model's own forward) and
    the hook is gone afterwards, so later steps pay nothing."""
    import meshrun

    seen = meshrun.run(_ddp_rebuild_release, nproc=2, timeout_s=120)
    assert seen == [(False, False, 1), (True, True, 0), (True, True, 0)]


@pytest.mark.parametrize("requested,compiled,world,local,expected", [
    (None, True, 4, 4, 1000),   # compiled, one host: Dynamo's cuts cost more than the overlap saves
    (None, True, 8, 4, 100),    # two hosts: the network makes the overlap worth more
    (None, False, 4, 4, 100),   # eager: no graph to cut, keep the overlap
    (25, True, 4, 4, 25),       # the user's size wins
], ids=["compiled-one-host", "compiled-two-hosts", "eager", "requested"])
def test_ddp_bucket_size_follows_compile_and_hosts(requested, compiled, world, local, expected):
    from meshrun.training.parallel.ddp import ddp_bucket_mb
    from meshrun.training.runtime import Runtime

    rt = Runtime(rank=0, local_rank=0, world_size=world, local_world_size=local, device=torch.device("cpu"),
                 backend="gloo")
    assert ddp_bucket_mb(requested, compiled, rt) == expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's, raised as Inductor is imported
def test_compile_tune_asks_inductor_for_tuned_kernels_torch_accepts():
    """--compile-tune: coordinate-descent tuning, as options of the compiled graphs only (beside
    the dropout setting every compiled graph takes).
    torch.compile checks option names when it is called, so a key this torch lacks would
    raise here rather than at a GPU job's first step. Tuning compiles (also on the CPU, where
    compiling is otherwise off by default), and refuses --compile off."""
    from meshrun.config import validate
    from meshrun.errors import MeshrunError
    from meshrun.kernels.inductor import compile_options

    assert compile_options(False) == {"fallback_random": True}
    assert compile_options(True) == {"fallback_random": True, "coordinate_descent_tuning": True}
    torch.compile(lambda x: x + 1, options=compile_options(True))
    with pytest.raises(RuntimeError):  # the check this relies on
        torch.compile(lambda x: x + 1, options={"no_such_inductor_option": True})
    assert validate(TrainConfig(compile_tune=True)).compiles(cuda=False)
    assert not validate(TrainConfig()).compiles(cuda=False) and validate(TrainConfig()).compiles(cuda=True)
    assert validate(TrainConfig(compile=True)).compile == "on" and validate(TrainConfig(compile="no")).compile == "off"
    with pytest.raises(MeshrunError, match="--compile-tune=True: tunes compiled kernels, but --compile is off"):
        validate(TrainConfig(compile="off", compile_tune=True))


def test_mixture_of_experts_flops_count_the_experts_a_token_visits():
    """MFU of an MoE GPT: a token runs its top-k experts' MLPs (and the router), not all of
    them; counting every expert makes the layouts benchmark's EP rows read 47% instead of ~16%
    (4 x H200, torch 2.11)."""
    dims = dict(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    dense = GPT(GPTConfig(**dims)).flops_per_token()
    moe = GPT(GPTConfig(n_experts=8, top_k=2, **dims))
    d, f, layers = 32, 128, 2
    mlp = d * f + f + f * d + d
    # top-2 experts instead of the one dense MLP, plus the router's d x E weights
    assert moe.flops_per_token() == dense + 6 * layers * (2 * mlp - mlp + d * 8)


def test_power_limit_is_read_from_the_recorded_clock_samples():
    """bench/smi_summary.py on recorded nvidia-smi samples (4 x H200, four 1-GPU runs side by
    side, tests/data/smi): the GPT 1.3B cards (2, 3) ran at their 700-W limit with the SM clock near 1500 MHz,
    the 124M ones near 1650-1690; samples of idle or compiling cards do not count."""
    smi = bench_module("smi_summary")
    with open(os.path.join(DATA, "smi", "h200x4_four-1gpu-runs_2026-11-27.csv")) as fh:
        samples = smi.parse(fh.read().splitlines())
    assert {s.gpu for s in samples} == {0, 1, 2, 3} and any(s.util < 90 for s in samples)
    lines = smi.summarize(samples)
    assert len(lines) == 4 and all("sw-power-cap" in line and "of 700 W" in line for line in lines), lines
    assert "median 1500 MHz" in lines[2] and "median 1508 MHz" in lines[3] and "median 1650 MHz" in lines[0], lines
    assert smi.parse(["Field \"x\" is not a valid field to query.", "0, [N/A], 1980, 1980, 70, 700, 0x0"]) == []


def test_profile_counts_overlapping_kernels_once():
    """bench/profile_step.py under DDP: the time some compute kernel runs is the union of
    their intervals (kernels of two streams overlapping count once, gaps not at all), and
    NCCL's kernels are told from the compute ones by name."""
    ps = bench_module("profile_step")
    assert ps.covered([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert ps.covered([(20, 25), (0, 10)]) == 15 and ps.covered([]) == 0
    assert ps.family("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "nccl"
    assert ps.family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert ps.family("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN") == "gemm"


def test_profile_sizes_the_gpus_idle_gaps_and_names_the_hosts_work_inside():
    """bench/profile_step.py's idle gaps: time with no kernel at all on any stream (a kernel
    inside another's interval closes no gap), binned by size, the longest named by the kernels
    on either side; and the host's longest operations that began inside the longest gaps."""
    ps = bench_module("profile_step")
    kernels = [(0, 10, "a"), (12, 20, "b"), (15, 18, "c"), (150, 160, "d"), (161, 170, "e"), (400, 401, "f")]
    line = ps.idle_gaps(kernels, per_step=1e-3)  # microseconds -> milliseconds, one step
    assert line.startswith("4 gaps per step, <10us 0.00 ms, 10-100us 0.00 ms, >100us 0.36 ms"), line
    assert "longest: 230us e -> f; 130us b -> d; 2us a -> b; 1us d -> e" in line
    host = [(30, 90, "enumerate(DataLoader)"), (31, 32, "aten::stack"), (5, 8, "before the gap"),
            (200, 210, "aten::mm")]
    assert ps.host_in_gaps(kernels, host, top=2) == [
        "230us gap: aten::mm 10us", "130us gap: enumerate(DataLoader) 60us, aten::stack 1us"]


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_state_made_before_the_first_step_changes_nothing(fused):
    """create_state makes AdamW's moments at setup (so the caching allocator places them before
    the first step's large blocks) without moving a parameter: after it, and after the same
    real step, parameters and state equal those of an optimizer left to make its state lazily."""
    import copy

    import torch

    from meshrun.training.optim import build_optimizer, create_state

    torch.manual_seed(0)
    a = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    b = copy.deepcopy(a)
    before = [p.detach().clone() for p in a.parameters()]
    oa, ob = build_optimizer(a, 1e-2, 0.1, fused=fused), build_optimizer(b, 1e-2, 0.1, fused=fused)
    create_state(oa)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    assert all(p.grad is None for p in a.parameters())
    assert len(oa.state) == sum(1 for _ in a.parameters())
    assert all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in oa.state.values())
    create_state(oa)  # called again (a resumed run's optimizer already has state) it keeps it
    idx = torch.randint(0, 64, (4, 17))
    for model, opt in ((a, oa), (b, ob)):
        for _ in range(2):
            model(idx[:, :-1], idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[pa], ob.state[pb]
        assert float(sa["step"]) == float(sb["step"]) == 2
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def _per_mesh_adamw_steps():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from meshrun.training.optim import _PerMeshAdamW

    torch.manual_seed(0)
    meshes = [init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1, 1))]
    values = [torch.randn(4, 3), torch.randn(5), torch.randn(3, 3), torch.randn(2)]
    ref = [nn.Parameter(v.clone()) for v in values]
    mine = [nn.Parameter(distribute_tensor(v.clone(), meshes[i % 2], [Replicate()] * meshes[i % 2].ndim))
            for i, v in enumerate(values)]

    def groups(ps):
        return [{"params": [ps[0], ps[1], ps[2]], "weight_decay": 0.1}, {"params": [ps[3]], "weight_decay": 0.0}]

    opt = _PerMeshAdamW(groups(mine), lr=1e-2, betas=(0.9, 0.95), fused=True)
    plain = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(v) for v in values]
        for p, q, g in zip(mine, ref, grads):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            q.grad = g.clone()
        opt.step()
        plain.step()
    close = all(torch.allclose(p.to_local(), q, atol=1e-6) for p, q in zip(mine, ref))
    # the groups are the ones built: the state dict is the plain AdamW's
    sd, ref_sd = opt.state_dict(), plain.state_dict()
    same = ([g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]]
            and sorted(sd["state"]) == sorted(ref_sd["state"])
            and [len(g["params"]) for g in opt.param_groups] == [3, 1])
    return close, same


def test_per_mesh_adamw_steps_each_mesh_as_the_plain_adamw_steps_all():
    """The AdamW that runs the fused kernel once per device mesh (torch 2.7's fused AdamW refuses
    DTensors of two meshes in one call, as FSDP2 x TP has them) updates every parameter as a
    plain AdamW does, and keeps the groups as built, so its state dict and snapshots are a plain
    AdamW's."""
    import meshrun

    assert meshrun.run(_per_mesh_adamw_steps, nproc=1, timeout_s=120) == (True, True)


def _summing_gloo_refuses_hybrid_with_tp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from meshrun.training.parallel.fsdp import _summing_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    plain = nn.Linear(2, 2)
    shard, hook = _summing_mesh(plain, mesh, "hybrid")  # replicas all-reduced by the hook, then divided
    grad = torch.full((3,), 6.0)
    hook(grad)
    tp = nn.Linear(2, 2)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), init_device_mesh("cpu", (1,)), [Replicate()]))
    try:
        _summing_mesh(tp, mesh, "no_shard")
    except MeshrunError as e:
        return shard.mesh_dim_names, grad.tolist(), str(e)
    return shard.mesh_dim_names, grad.tolist(), None


def test_where_gloo_sums_for_avg_hybrid_shards_alone_and_refuses_tensor_parallelism():
    """Where gloo's reduce-scatter sums for ReduceOp.AVG (torch 2.7), hybrid sharding shards over
    its second dimension and averages the replicas in FSDP2's all-reduce hook; with tensor
    parallel parameters that is refused in one line naming the strategy."""
    import meshrun

    names, grad, error = meshrun.run(_summing_gloo_refuses_hybrid_with_tp, nproc=1, timeout_s=120)
    assert names == ("dp_shard",) and grad == [6.0, 6.0, 6.0]
    assert error is not None
    assert error.startswith("--strategy='fsdp-no-shard': with --tp on gloo needs a torch whose gloo averages")


def _state_at_setup():
    import copy

    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import gpt
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = gpt("gpt-tiny", 16, 64)
    initial = copy.deepcopy(model).state_dict()
    cfg = TrainConfig(model_size="gpt-tiny", seq_len=16, micro_batch=2, steps=1, precision="fp32", strategy="fsdp")
    t = Trainer(model, RandomTokens(64, 16, 64), None, cfg)
    states = [t.optimizer.state.get(p) for g in t.optimizer.param_groups for p in g["params"]]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in t.model.state_dict().items()}
    return (all(s is not None and float(s["step"]) == 0 and not s["exp_avg"].any() for s in states),
            all(torch.equal(full[k], initial[k]) for k in initial),
            all(p.grad is None for p in t.model.parameters()))


def test_trainer_makes_the_optimizer_state_at_setup():
    """Under FSDP2 on 2 gloo processes the Trainer has AdamW's state for every parameter before
    its first step (step 0, zero moments), no gradient left behind and every parameter as built:
    made in the first step it splits the loss's freed blocks on a GPU (4 x H200, torch 2.11;
    docs/decisions.md#optimizer-state)."""
    import meshrun

    assert meshrun.run(_state_at_setup, nproc=2, timeout_s=120) == (True, True, True)


def _validation_compiles():
    import torch
    from torch._dynamo.testing import CompileCounter

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import gpt
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    cfg = TrainConfig(model_size="gpt-tiny", seq_len=16, micro_batch=2, steps=1, precision="fp32", strategy="single")
    t = Trainer(gpt("gpt-tiny", 16, 64), RandomTokens(64, 16, 64), RandomTokens(8, 16, 64), cfg)
    counter = CompileCounter()
    t.model.compile(backend=counter)  # as a compiled run's model is
    loss = t.evaluate()
    eager_after = counter.frame_count
    t.model.train()
    x = torch.randint(0, 64, (2, 16))
    t.model(x, x)  # the same module compiles when called outside validation
    return loss is not None, eager_after, counter.frame_count > 0


def test_a_compiled_model_validates_eager():
    """Validation runs the compiled model eager (torch.compiler's force_eager stance): compiling
    its eval graph at the validation micro-batch took 84 s at the end of a 3B model's run."""
    import meshrun

    assert meshrun.run(_validation_compiles, nproc=1, timeout_s=120) == (True, 0, True)


def test_a_model_whose_loss_needs_its_logits_validates_in_micro_batches_they_fit_in():
    from meshrun.defaults import EVAL_LOGITS_BYTES, val_micro

    # Llama-3.2-1B's vocabulary at 4096 tokens: 3 GiB of logits (bf16 and fp32) a sample
    assert val_micro(8, 4096, 128256, "labels-nocache") == 1
    assert val_micro(16, 4096, 32768, "labels") == EVAL_LOGITS_BYTES // (4096 * 32768 * 6) == 5
    assert val_micro(32, 1024, 50304, "targets") == 32  # meshrun's GPT takes its loss in chunks
    assert val_micro(8, 32, 256, "logits") == 8  # small logits: the run's micro-batch
    assert val_micro(8, None, None, "logits") == 8  # a model with no vocabulary (regression)


def test_the_defaults_matrix_reads_meshruns_first_lines_as_the_gpu_runs_printed_them():
    """bench/defaults_matrix.py on lines recorded on 2 x H200 (2026-11-28): the layout meshrun
    chose, compiled or not, its kernels, the planner's prediction, the steady throughput."""
    from helpers import bench_module

    bench_module("cli_train")  # (defaults_matrix imports it as a sibling script)
    matrix = bench_module("defaults_matrix")
    llama = matrix.parse_meshrun([
        "meshrun train: strategy fsdp-grad-op: initialised -> FSDP2 grad_op over 2 ranks, Liger kernels for llama "
        "(RMSNorm, SwiGLU, rotary, fused linear cross-entropy), 2 process(es), 1235.81M parameters, global batch "
        "8 x 8 x 2 = 128 of 4096 tokens, bf16",
        "  planner: fsdp-grad-op predicted 121 GiB per GPU of 126 GiB usable",
        "  eager with Liger Kernel's fused kernels (compiling adds nothing on top of them; --compile on for "
        "torch.compile's kernels instead)",
        "step 1 | loss 12.1 | tokens_per_s_per_gpu 60,000 | mfu 54.8% | peak_reserved 56.30 GiB",
        "step 2 | loss 12.0 | tokens_per_s_per_gpu 64,405 | mfu 58.8% | peak_reserved 56.30 GiB",
        "step 3 | loss 11.9 | tokens_per_s_per_gpu 64,500 | mfu 58.9% | peak_reserved 56.30 GiB",
    ])
    assert (llama["strategy"], llama["micro"], llama["accum"], llama["compiled"]) == ("fsdp-grad-op", 8, 8, False)
    assert llama["kernels"] == ["Liger"] and llama["planner_predicted_gib"] == 121.0
    assert llama["tokens_per_s_per_gpu"] == 64452  # the median of the steps after the first
    gpt = matrix.parse_meshrun([
        "meshrun train: strategy single: compiled, loss with its gradient in the forward (Triton), MLP's GELU in "
        "cuBLASLt epilogues, 1 process(es), 1313.72M parameters, global batch 64 x 8 x 1 = 512 of 1024 tokens, bf16",
        "  planner: single predicted 125 GiB per GPU of 126 GiB usable",
    ])
    assert gpt["compiled"] and gpt["strategy"] == "single" and gpt["micro"] == 64
    # today's lines: the step with the run's total, the time taken and left
    line = ("step 10/200 | loss 4.7 | tokens_per_s_per_gpu 577,066 | mfu 50.2% | peak_reserved 56.30 GiB "
            "| elapsed 0:07 | left 2:13")
    assert bench_module("cli_train").parse_line(line) == {
        "step": 10, "loss": 4.7, "tokens_per_s_per_gpu": 577066, "mfu": 0.502, "peak_reserved_gib": 56.3}


def test_the_defaults_matrix_reads_todays_first_lines_step_lines_and_closing_line():
    """The same figures as meshrun words them now (training/report.py, stepline.py, the
    closing line of metrics.MetricsSink): the strategy line, the batch in the steps line,
    tokens/s over the strategy line's GPUs, peak memory from the closing line."""
    from helpers import bench_module

    from meshrun.training.metrics import MetricsSink
    from meshrun.training.report import steps_line, strategy_line
    from meshrun.training.stepline import step_line

    cli = bench_module("cli_train")
    matrix = bench_module("defaults_matrix")
    records = [{"step": step, "loss": loss, "lr": 3e-4, "tokens_per_s": 2 * per_gpu, "mfu": mfu, "step_time_s": 1.0,
                "peak_reserved_bytes": 56.3 * 2**30}
               for step, loss, per_gpu, mfu in ((1, 12.1, 60000, 0.548), (2, 12.0, 64405, 0.588),
                                                (3, 11.9, 64500, 0.589))]
    sink = MetricsSink(None, 200, enabled=True)
    sink.records = records
    layout = ("fsdp-grad-op: initialised -> FSDP2 grad_op over 2 ranks, Liger kernels for llama (RMSNorm, SwiGLU, "
              "rotary, fused linear cross-entropy)")
    lines = [f"meshrun train: {steps_line(0, 200, 8, 8, 2, 4096, 3e-4, 20, 0.1)}",
             f"meshrun train: {strategy_line(layout, 2, 2, True, 'bf16')}",
             "  planner: fsdp-grad-op predicted 121 GiB per GPU of 126 GiB usable",
             *(step_line(r, 200, 10.0 * r["step"], 100.0) for r in records), sink.finished(None)]
    llama = matrix.parse_meshrun(lines)
    assert (llama["strategy"], llama["micro"], llama["accum"], llama["dp"], llama["compiled"]) == \
        ("fsdp-grad-op", 8, 8, 2, False)
    assert llama["kernels"] == ["Liger"] and llama["planner_predicted_gib"] == 121.0
    assert llama["tokens_per_s_per_gpu"] == 64452 and llama["mfu"] == 0.5885 and llama["peak_reserved_gib"] == 56.3
    cpu = {**records[-1], "step": 200, "val_loss": 12.2, "mfu": None, "step_time_s": 0.0593}  # (the last: none left)
    assert cli.parse_line(step_line(cpu, 200, 5.0, None)) == {
        "step": 200, "loss": 11.9, "val_loss": 12.2, "lr": 3e-4, "tokens_per_s": 129000, "step_time_s": 0.0593}
    assert cli.gpus_of(lines) == 2 and cli.gpus_of([strategy_line("ddp", 2, 2, False, "fp32")]) is None


def test_the_defaults_matrix_runs_each_candidate_path_of_a_hugging_face_model(tmp_path):
    """--paths: one meshrun row per path for a Hugging Face model, the path's flags after the
    row's own and --train-args; meshrun's GPT runs the default path alone; the table keeps a
    row per path and names it, and each row's layout names Liger's loss and FlexAttention."""
    from helpers import bench_module

    bench_module("cli_train")
    matrix = bench_module("defaults_matrix")
    models = [matrix.CPU_MODELS["llama-tiny"], matrix.CPU_MODELS["gpt-tiny"]]
    jobs = matrix.jobs_for(models, 2, str(tmp_path), None, True, None, ("default", "compiled-plain"),
                           ("--global-batch", "8"))
    assert [(j.model.name, j.path) for j in jobs] == [("llama-tiny", "default"), ("llama-tiny", "compiled-plain"),
                                                      ("gpt-tiny", "default")]
    assert jobs[1].argv[-6:] == ["--global-batch", "8", "--compile", "on", "--kernels", "plain"]
    assert jobs[0].argv[-2:] == ["--global-batch", "8"] and jobs[0].log != jobs[1].log
    rows = [{"kind": "meshrun", "model": "llama-tiny", "gpus": 1, "path": p, "status": "ran", "ran": True,
             "tokens_per_s_per_gpu": n} for p, n in (("compiled-plain", 5), ("default", 7))]
    text = matrix.table(rows)
    assert "| llama-tiny | 1 |" in text and "| llama-tiny [compiled-plain] | 1 |" in text
    assert text.index("| llama-tiny | 1 |") < text.index("[compiled-plain]")  # the default first
    assert matrix.short_kernel("Liger's fused linear cross-entropy for llama") == "Liger loss"
    assert matrix.short_kernel("FlexAttention (instead of eager attention)") == "FlexAttention"
    # a GPU row's expected duration follows the steps and batch --train-args set
    llama = matrix.MODELS["llama3-8b"]
    full = matrix.estimate_s("meshrun", llama, 1, False)
    short = matrix.estimate_s("meshrun", llama, 1, False, ("--global-batch", "16", "--steps=4"))
    tokens = 4 * 16 * matrix.PEER_SEQ
    assert short == pytest.approx(matrix.SETUP_S + 6 * llama.params_b * 1e9 * tokens / matrix.EFFECTIVE_FLOPS)
    assert short < full


def test_a_users_modules_offer_the_hooks_by_their_methods_alone():
    """The trainer's hooks are declared protocols (models/hooks.py): a user's module that has
    the methods is treated as meshrun's own, without inheriting from anything of meshrun's."""
    import torch.distributed as dist

    from meshrun.api import run
    from meshrun.training.models.hooks import ExpertModule, KernelModel
    from meshrun.training.models.moe import MoE
    from meshrun.training.parallel.expert import shard_experts

    class MyExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stats_group, self.kept = None, None

        def shard_experts(self, group):
            self.kept = (dist.get_rank(group), dist.get_world_size(group))

    class MyModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MyExperts()

        def meshrun_kernels(self, device, tp=1, pp=1):
            return [f"mine on {device.type}"]

    assert isinstance(MyModel(), KernelModel) and not isinstance(torch.nn.Linear(2, 2), KernelModel)
    assert isinstance(MyExperts(), ExpertModule) and isinstance(MoE(8, 2), ExpertModule)
    assert not isinstance(torch.nn.Linear(2, 2), ExpertModule)

    def shard() -> tuple:
        model = MyModel()
        shard_experts(model, dist.group.WORLD, dist.get_world_size())
        return model.moe.kept

    assert run(shard, nproc=2, backend="gloo", timeout_s=120) == (0, 2)
    with pytest.raises(MeshrunError, match="the model has no experts"):
        shard_experts(torch.nn.Linear(2, 2), None, 2)


def test_the_memory_grid_runs_a_row_through_meshrun_train(tmp_path):
    """bench/memory_grid.py: one of its CPU stand-in rows through the real `meshrun train`
    (a plain torch module of bench/usermodels.py). Its report, on the rows measured on H200s,
    is tests/test_plan_trace.py's accuracy test."""
    require("torch")
    grid = os.path.join(BENCH, "memory_grid.py")
    run = subprocess.run([sys.executable, grid, "--cpu-check", "--rows", "user-llama-tiny-fsdp-full-s32-b2",
                          "--out", str(tmp_path / "grid")], capture_output=True, text=True, timeout=300,
                         env=clean_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads((tmp_path / "grid" / "matrix.jsonl").read_text())
    assert (row["status"], row["strategy"], row["micro"], row["held_out"]) == ("ran", "fsdp-full", 2, False)
    assert row["source"] == "user:llama_tiny" and row["metrics_lines"] == 4


def test_profile_train_profiles_two_steps_of_a_real_meshrun_train(tmp_path):
    """bench/profile_train.py: a real `meshrun train` (its rank in a process of its own) with
    the profiling hook on the path prints the profiled steps' time and kernels, and the run
    trains to its end."""
    require("torch")
    script = os.path.join(BENCH, "profile_train.py")
    run = subprocess.run([sys.executable, script, "--at", "2", "--top", "3", "--", "--model-size", "gpt-tiny",
                          "--data", "random", "--steps", "3", "--global-batch", "2", "--seq-len", "32",
                          "--nproc", "1"], capture_output=True, text=True, timeout=300,
                         env=clean_env(PYTHONPATH=os.path.join(os.path.dirname(BENCH), "src")))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROFILE ")]
    assert lines[0].startswith("PROFILE wall ") and lines[1].startswith("PROFILE families ")
    assert len(lines) == 2 + 3 and "aten::" in lines[2]
    assert "finished step 3/3" in run.stdout


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's, raised as Inductor is imported
def test_compiled_dropout_draws_the_masks_eager_dropout_draws():
    """meshrun's compiled graphs run dropout as torch's own kernel (compile_options:
    fallback_random, measured faster): from the same seed a compiled block drops what the eager
    block drops. Inductor's own random numbers would drop others."""
    from meshrun.kernels.inductor import compile_options

    block = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.5))
    x = torch.randn(8, 16)
    torch.manual_seed(3)
    eager = block(x)
    compiled = torch.compile(block, options=compile_options(False))
    torch.manual_seed(3)
    out = compiled(x)
    assert torch.equal(out == 0, eager == 0) and 0.3 < (eager == 0).float().mean() < 0.7
    torch.testing.assert_close(out, eager)  # (the GELU compiled rounds differently in the last bit)
    torch._dynamo.reset()
    torch.manual_seed(3)
    assert not torch.equal(torch.compile(block)(x) == 0, eager == 0)  # what the option changes


def test_checkpointed_dropout_recomputes_the_forwards_masks():
    """Activation checkpointing of blocks with dropout (a GPT-2's 0.1 on residuals and
    attention): the recomputed forward drops what the forward dropped, so the gradients are the
    unchecked model's. Recomputing with the generator moved on (the setting blocks without
    dropout keep) gives another mask's gradients; a block without dropout is told apart."""
    require("transformers")
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from meshrun.training.parallel.apply import apply_activation_checkpointing, has_dropout

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    x = torch.randint(0, 64, (2, 16))

    def grads(m: torch.nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        m(input_ids=x, labels=x).loss.backward()
        return [p.grad for p in m.parameters()]

    reference = grads(model)
    checked = copy.deepcopy(model)
    checked.zero_grad(set_to_none=True)
    apply_activation_checkpointing(checked.transformer.h)
    for a, b in zip(grads(checked), reference):
        torch.testing.assert_close(a, b)
    unkept = copy.deepcopy(model)
    unkept.zero_grad(set_to_none=True)
    for i, block in enumerate(unkept.transformer.h):
        unkept.transformer.h[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    assert not all(torch.allclose(a, b) for a, b in zip(grads(unkept), reference))

    assert has_dropout(model.transformer.h[0])
    quiet = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    assert not has_dropout(quiet.transformer.h[0])
    llama = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
    assert not has_dropout(LlamaDecoderLayer(LlamaConfig(**llama), 0))
    assert has_dropout(LlamaDecoderLayer(LlamaConfig(**llama, attention_dropout=0.1), 0))  # a float SDPA is given
