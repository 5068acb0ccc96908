"""meshrun plan: formulas against hand-computed cases and against what autograd really
saves, the flowchart's branches, batch arithmetic, generated configs parsed by DeepSpeed,
accelerate and meshrun train themselves, and one-line errors."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest
from helpers import bench_module, clean_env, example, lines, meshrun, meshrun_here, require

from meshrun.errors import MeshrunError
from meshrun.modelinfo.read import from_hf_config, resolve_model
from meshrun.modelinfo.spec import PRESETS, gpt_spec
from meshrun.plan import ClusterSpec, TrainSpec, make_plan
from meshrun.plan.batch import solve
from meshrun.plan.memory import Strategy, layer_activation_bytes, model_states
from meshrun.vocab import KINDS, STRATEGIES, StrategyKind

GB = 1e9
GiB = 2**30
USERPKG = os.path.dirname(__file__)


def plan_env() -> dict[str, str]:
    return clean_env(PYTHONPATH=USERPKG + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ---- formulas ------------------------------------------------------------------------------

@pytest.mark.parametrize("shard,expected_gb", [("none", 120), ("optimizer", 31.4), ("grads", 16.6), ("params", 1.9)])
def test_zero_paper_model_states(shard, expected_gb):
    """Rajbhandari et al. 2020, figure 1: 7.5B parameters, Adam (K = 12), 64 GPUs."""
    m = gpt_spec("x", 4096, 1, 32)
    m = type(m)(**{**m.__dict__, "params": int(7.5e9)})
    t = TrainSpec(1024, 1, None)
    s = Strategy(StrategyKind("z", "deepspeed", shard, ""), 64, 1 if shard == "none" else 64)
    states, _, _ = model_states(m, t, s)
    total = states["params"] + states["grads"] + states["optimizer"]
    assert total / GB == pytest.approx(expected_gb, abs=0.06)


def test_torch_states_are_16_bytes_sharded_by_fsdp():
    m = PRESETS["gpt-1.3b"]
    t = TrainSpec(1024, 1, None, precision="fp32")
    full = model_states(m, t, Strategy(STRATEGIES["fsdp-full"], 8, 8))[0]
    assert full["params"] + full["grads"] + full["optimizer"] == pytest.approx(16 * m.params / 8, rel=1e-6)
    ddp = model_states(m, t, Strategy(STRATEGIES["ddp"], 8, 1))[0]
    assert ddp["params"] + ddp["grads"] + ddp["optimizer"] == pytest.approx(16 * m.params, rel=1e-6)


def _saved_bytes_per_token(block, x, autocast: bool) -> float:
    """Bytes of the distinct tensors autograd saves for backward in one block's forward
    (its input included, excluding the parameters themselves)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # keep OpenMP's pool unborn in the test process (later tests fork)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                block(x)
    finally:
        torch.set_num_threads(threads)
    weight_copies = sum(2 * p.numel() for n, p in block.named_parameters() if n.endswith("weight") and p.dim() == 2)
    total = sum(seen.values()) - (weight_copies if autocast else 0)
    return total / (x.shape[0] * x.shape[1])


@pytest.mark.parametrize("precision,residual", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_activation_formula_matches_what_autograd_saves(precision, residual):
    """The per-layer formula against the tensors autograd really keeps for meshrun's GPT block
    (bf16: CPU autocast, whose casts match CUDA's for these ops; its bf16 weight copies are the
    +2P the model counts separately), fed an fp32 residual stream (a model whose embeddings
    are fp32 under autocast) and a bf16 one (what meshrun's GPT feeds its blocks)."""
    require("torch")
    import torch

    from meshrun.training.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    h, heads, b, t = 128, 4, 2, 64
    block = Block(GPTConfig(vocab=256, seq_len=t, d_model=h, n_layers=1, n_heads=heads))
    x = torch.randn(b, t, h, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[residual]),
                    requires_grad=True)
    counted = _saved_bytes_per_token(block, x, precision == "bf16")
    predicted = layer_activation_bytes(gpt_spec("x", h, 1, heads, 256, t), precision, residual == "fp32")
    assert counted == pytest.approx(predicted, rel=0.02), (counted, predicted)


def test_meshrun_gpt_feeds_its_blocks_a_bf16_residual_stream_under_autocast():
    """What the planner's bf16_residual flag stands for: under autocast meshrun's GPT keeps
    the residual stream in bf16 (half the bytes in norms and adds), and the loss is still
    computed in fp32 and close to the fp32 model's."""
    require("torch")
    import torch

    from meshrun.training.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    idx, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    full = model(idx, y)
    assert seen == [(torch.float32, torch.float32)] * 2
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(idx, y)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    assert mixed.dtype == torch.float32 and mixed.item() == pytest.approx(full.item(), rel=2e-2)
    assert gpt_spec("x", 32, 2, 4).bf16_residual


def test_checkpointed_activations_are_the_block_inputs():
    """With activation checkpointing autograd keeps only each block's input (fp32 here):
    the planner's stored-activation term, 4 bytes x hidden per token per layer."""
    require("torch")
    import torch

    from meshrun.plan import memory
    from meshrun.training.models.gpt import Block, GPTConfig
    from meshrun.training.parallel.apply import apply_activation_checkpointing

    h, b, t, layers = 64, 2, 16, 3
    blocks = torch.nn.ModuleList(Block(GPTConfig(vocab=32, seq_len=t, d_model=h, n_layers=layers, n_heads=4))
                                 for _ in range(layers))
    apply_activation_checkpointing(blocks)
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return x

    x = torch.randn(b, t, h, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # keep OpenMP's pool unborn in the test process (later tests fork)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            y = x
            for block in blocks:
                y = block(y)
    finally:
        torch.set_num_threads(threads)
    m = gpt_spec("x", h, layers, 4, 32, t)
    train = TrainSpec(t, b, None, precision="fp32", compile=False, activation_checkpointing="full")
    stored, _ = memory.activations(m, train, memory.Strategy(STRATEGIES["single"], 1, 1, ac=True), b)
    assert sum(seen.values()) == stored == 4 * h * b * t * layers


def test_selective_checkpointing_keeps_what_the_planner_counts():
    """Selective checkpointing keeps each block's input and the outputs of its matmuls and of
    attention (the policy in training/parallel/apply.py): summed over one GPT block's forward (fp32,
    on the CPU), exactly the planner's selective term."""
    require("torch")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshrun.plan import memory
    from meshrun.training.models.gpt import Block, GPTConfig
    from meshrun.training.parallel.apply import _kept_ops

    h, b, t, heads = 64, 2, 16, 4
    block = Block(GPTConfig(vocab=32, seq_len=t, d_model=h, n_layers=1, n_heads=heads, fused_mlp=False))
    kept, outputs = _kept_ops(), []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kept:
                outputs.extend(o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor))
            return out

    x = torch.randn(b, t, h, requires_grad=True)
    with Outputs():
        block(x)
    got = x.nbytes + sum(o.nbytes for o in outputs)
    spec = gpt_spec("x", h, 1, heads, 32, t)
    assert got == memory.selective_layer_bytes(spec, "fp32") * b * t


def test_calibration_points_within_five_percent():
    """The allocated peaks measured on an H200 (tests/data/calibration) against the model."""
    path = os.path.join(CALIBRATION, "h200_train-bench-peaks_2026-11-26.jsonl")
    errors = []
    for line in open(path):
        r = json.loads(line)
        # measured on the GPT of that day, whose residual stream stayed fp32 under autocast
        p = make_plan(replace(PRESETS[r["model"]], bf16_residual=False), ClusterSpec(1, r["gpus"], 141 * GiB),
                      TrainSpec(r["seq"], r["micro"], None, compile=r["compile"], activation_checkpointing="none"))
        c = next(x for x in p.candidates if x.strategy.name == r["strategy"])
        b = c.memory.breakdown
        allocated = sum(v for k, v in b.items() if k not in ("fragmentation", "cuda_context"))
        errors.append(abs(allocated / GiB / r["allocated_gib"] - 1))
    assert len(errors) >= 7 and max(errors) <= 0.05, errors


CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration")


def _plan_accuracy():
    """bench/plan_accuracy.py, the harness that compares measured peaks with the model."""
    return bench_module("plan_accuracy")


def test_predictions_meet_the_accuracy_target_on_the_measured_grid():
    """The planner's accuracy target on every clean row measured on H200s (the training benchmarks'
    allocated peaks and the planner grid's reserved peaks, bench/plan_accuracy.py): median
    absolute error <= 5%, worst <= 10%; rows measured on top of an earlier configuration's
    leftovers are dropped by the harness, and at least 20 remain."""
    import statistics

    bench = _plan_accuracy()
    files = [os.path.join(CALIBRATION, f)
             for f in ("h200_train-bench-peaks_2026-11-26.jsonl", "h200_grid-eager_2026-11-26.jsonl")]
    errs = [abs(e) for *_, e in bench.errors(bench.load(files))]
    assert len(errs) >= 20, len(errs)
    assert statistics.median(errs) <= 0.05 and max(errs) <= 0.10, (statistics.median(errs), max(errs))


def _fresh_rows(bench) -> list[dict]:
    import glob

    files = sorted(f for f in glob.glob(os.path.join(CALIBRATION, "h200*.jsonl")) if "layouts" not in f)
    return bench.load(files, fresh_only=True)


def test_predictions_meet_the_target_on_every_row_measured_as_a_job_starts():
    """The accuracy target over every H200 row kept in tests/data/calibration that came first in its
    process, as a job starts, and measured the Trainer as it is (47 rows: 1, 2 and 4 GPUs;
    single, DDP, DeepSpeed ZeRO-1/2/3, FSDP2 with and without AC, compiled FSDP2's allocated
    peaks; eager and compiled): median <= 5%, worst <= 10%. Rows measured after another
    configuration in the same process reserve up to 5 GiB more for the same allocations
    (bench/plan_accuracy.py) and are left out; so are the FSDP2-without-AC rows measured
    before the Trainer made its long-lived allocations at setup (the next test)."""
    import statistics

    bench = _plan_accuracy()
    rows = [r for r in _fresh_rows(bench) if not bench.before_early_state(r)]
    errs = [abs(e) for *_, e in bench.errors(rows)]
    assert len(errs) >= 47, len(errs)
    assert statistics.median(errs) <= 0.05 and max(errs) <= 0.10, (statistics.median(errs), max(errs))


def _raw_rows() -> list[dict]:
    """The 4-GPU grid rows first in their process, before and after the early state, both kept."""
    import glob

    files = sorted(f for f in glob.glob(os.path.join(CALIBRATION, "h200x4_*.jsonl")) if "layouts" not in f)
    rows = _plan_accuracy().load(files, fresh_only=True, supersede=False)
    return [r for r in rows if r.get("reserved_gib") and not r.get("alloc_conf") and not r.get("setup_empty_cache")]


def test_fsdp2_without_checkpointing_lost_its_extra_logits_block_with_the_early_state():
    """FSDP2 without AC reserves one logits-sized block more than it needs (1.15-1.34x its
    allocated peak) when AdamW's state and cuBLAS's backward workspace are made in the first
    step (the rows without ``early_state``): the recorded allocator traces (h200x4_alloc-trace-*)
    show the workspace splitting a freed fp32-logits block. With both made at setup (the
    ``early_state`` rows, 4 x H200, torch 2.11), each GPT 124M configuration at micro-batch 8
    and 32 (eager and compiled) reserves 0.86-0.99 of one fp32 logits block (4 bytes x
    vocabulary x micro x 1024) less, for the same allocated peak. Where the lazy row has no such
    block (124M micro 64: 1.11x its allocated peak; 1.3B micro 32) or has other excess (1.3B
    micro 4 and 16, 350M), less or the same, never more; DDP and AC rows within 2.5% of the
    lazy ones."""
    from meshrun.modelinfo.spec import PRESETS

    rows = _raw_rows()
    keyed = {}
    for r in rows:
        key = (r["model"], r["strategy"], r["ac"], r["micro"], r["compile"])
        keyed.setdefault(key, {})[bool(r.get("early_state"))] = r
    pairs = {k: v for k, v in keyed.items() if len(v) == 2}
    assert len(pairs) >= 14, sorted(pairs)
    for (model, strategy, ac, micro, _), v in pairs.items():
        before = v[False]["reserved_gib"]
        drop = before - v[True]["reserved_gib"]
        assert abs(v[False]["allocated_gib"] - v[True]["allocated_gib"]) < 0.02, (model, strategy, micro)
        if strategy.startswith("fsdp") and not ac:
            assert drop >= -0.025 * before, (model, strategy, micro, drop)
            if model == "gpt-124m" and micro <= 32:
                block = 4 * PRESETS[model].vocab * micro * 1024 / GiB
                assert 0.8 * block <= drop <= 1.05 * block, (model, strategy, micro, drop, block)
        else:
            assert abs(drop) <= 0.025 * before, (model, strategy, micro, drop)


def test_fsdp2_without_checkpointing_meets_the_target():
    """The FSDP2-without-AC rows measured with the Trainer as it is (4 x H200, torch 2.11,
    eager: GPT 124M micro 8 and 32, GPT 1.3B micro 4 and 16, full and grad_op): median <= 5%,
    worst <= 10% of the reserved peak (median 0.4%, worst 1.7% with the gradient shards the
    reduce-scatter stream keeps cached counted; 2.2% / 8.2% without them). With them the five
    configurations measured again with the Trainer as it is
    (h200x4_early-state-remeasured_2026-11-27.jsonl: 124M micro 32 compiled; 124M micro 64,
    350M micro 8 and 32, 1.3B micro 32): +2.8%, +1.9%, -0.3%, +0.0%, -1.4%; each supersedes its
    older row, so none is left out."""
    import statistics

    bench = _plan_accuracy()
    rows = [r for r in _fresh_rows(bench) if bench.fsdp2_without_ac_reserved(r) and not bench.before_early_state(r)]
    errs = [abs(e) for *_, e in bench.errors(rows)]
    assert len(errs) == 13 and all(r.get("early_state") for r in rows), len(errs)
    assert statistics.median(errs) <= 0.05 and max(errs) <= 0.10, errs
    assert not [r for r in _fresh_rows(bench) if bench.before_early_state(r)]


def test_the_allocator_replay_finds_the_extra_segment_and_its_cause():
    """bench/allocator_replay.py on the recorded FSDP2 trace (GPT 124M, micro 8, 4 x H200,
    torch 2.11): a best-fit model of the caching allocator takes one new fp32-logits-sized
    segment in the second step, as the GPU did, and none once the backward thread's cuBLAS
    workspace is taken before the first step (as measured on the GPU: 9.805 -> 8.484 GiB)."""
    replay = bench_module("allocator_replay")
    events = replay.load(os.path.join(CALIBRATION, "h200x4_alloc-trace-fsdp2-124m-micro8_2026-11-27.jsonl.gz"))
    block = replay.segment_size(4 * 50304 * 8 * 1024)
    ws = replay.backward_workspaces(events)
    assert len(ws) == 1
    as_recorded = replay.replay(events)
    assert [(step, n) for _, step, n in as_recorded.new_segments if step >= 1] == [(1, block)]
    early = replay.replay(events, early=ws)
    assert [n for _, step, n in early.new_segments if step >= 1] == []
    assert as_recorded.reserved - early.reserved >= 0.9 * block


def test_segment_allocs_say_where_and_when_the_allocator_grew():
    """The allocator history's segment_alloc entries, by step (the trace's length after each
    warm-up step), with the innermost frames of meshrun's, FSDP2's or torch.nn's code; plain
    allocations and frames elsewhere are left out."""
    bench = _plan_accuracy()
    fr = [{"filename": "/x/torch/_tensor.py", "line": 1, "name": "float"},
          {"filename": "/x/src/meshrun/training/models/gpt.py", "line": 148, "name": "forward"},
          {"filename": "/x/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "line": 9, "name": "alloc"}]
    traces = [{"action": "alloc", "size": GiB, "frames": fr},
              {"action": "segment_alloc", "size": 2 * GiB, "stream": 0, "frames": fr},
              {"action": "free_completed", "size": GiB},
              {"action": "segment_alloc", "size": GiB // 2, "stream": 7, "frames": fr[:1]},
              {"action": "segment_alloc", "size": GiB, "stream": 0, "frames": fr[1:]}]
    got = bench.segment_allocs(traces, marks=[3, 4], top=1)
    assert got == [{"step": 0, "gib": 2.0, "stream": 0, "where": ["models/gpt.py:148 forward"]},
                   {"step": 1, "gib": 0.5, "stream": 7, "where": []},
                   {"step": 2, "gib": 1.0, "stream": 0, "where": ["models/gpt.py:148 forward"]}]


def test_grid_rows_say_which_stream_holds_the_reserved_segments():
    """The allocator's snapshot summarised per stream (segments, reserved, in use, largest
    free block, GiB): what tells reserved bytes stranded on a side stream from fragmentation
    on the compute stream."""
    bench = _plan_accuracy()
    snap = [{"stream": 0, "total_size": 2 * GiB, "allocated_size": GiB,
             "blocks": [{"size": GiB, "state": "active_allocated"}, {"size": GiB, "state": "inactive"}]},
            {"stream": 94, "total_size": GiB // 2, "allocated_size": 0,
             "blocks": [{"size": GiB // 2, "state": "inactive"}]},
            {"stream": 0, "total_size": GiB, "allocated_size": GiB,
             "blocks": [{"size": GiB, "state": "active_allocated"}]}]
    assert bench.segments_by_stream(snap) == {"0": [2, 3.0, 2.0, 1.0], "94": [1, 0.5, 0.0, 0.5]}


def test_deepspeed_zero_rows_within_six_percent():
    """DeepSpeed ZeRO-1/2/3 on 2 x H200 (tests/data/calibration/h200x2_grid-deepspeed_2026-11-26.jsonl,
    torch 2.11, DeepSpeed 0.19.8): each row's reserved peak within 6%. A model that counts the
    gradients and reduce buckets at the start of backward and leaves no room for the optimizer
    step's fresh segments is off by -3.6% to -28.3% on the same rows."""
    bench = _plan_accuracy()
    rows = [r for r in bench.load([os.path.join(CALIBRATION, "h200x2_grid-deepspeed_2026-11-26.jsonl")])
            if r["strategy"].startswith("zero")]
    errs = {f"{r['model']} {r['strategy']} {r['micro']}": round(e, 3) for r, _, _, e in bench.errors(rows)}
    assert len(errs) == 9 and max(abs(e) for e in errs.values()) <= 0.06, errs


def test_zero12_gradients_and_buckets_arrive_with_backward():
    """ZeRO-1/2's gradient partitions and reduce buckets are not part of the start-of-backward
    peak (activations and logits alive); ZeRO-3's fp32 gradient partitions are."""
    from meshrun.plan import memory

    m, t = PRESETS["gpt-1.3b"], TrainSpec(1024, 16, None, compile=False, activation_checkpointing="none")
    for shard, early in (("optimizer", 0), ("grads", 0), ("params", 4 * m.params / 2)):
        s = memory.Strategy(StrategyKind("z", "deepspeed", shard, ""), 2, 2)
        b = memory.estimate(m, ClusterSpec(1, 2, 141 * GiB), t, s, 16).breakdown
        assert b["grads"] == pytest.approx(early, rel=1e-6), (shard, b)
        assert b["activations"] > 0 and b["logits"] > 0
        if shard != "params":
            assert b["comm_buffers"] == 0
        # the step's fresh segments: 10 bytes per parameter of the rank's partition, on top of 4% fragmentation
        allocated = sum(v for k, v in b.items() if k not in ("fragmentation", "cuda_context"))
        assert b["fragmentation"] == pytest.approx(0.04 * allocated + 10 * m.params / 2, rel=1e-3)


def test_autocast_weight_copies_are_gone_by_the_end_of_backward():
    """GPT 1.3B on one H200 with activation checkpointing, micro-batch 4: the peak comes at the
    end of backward (fp32 weights, gradients, Adam). Measured 20.09 GiB allocated
    (tests/data/calibration/h200_grid-cudnn-attention_2026-11-26.jsonl); counting autocast's 2.4 GiB of bf16
    copies there predicted 22.3 GiB (+11%)."""
    from dataclasses import replace

    from meshrun.modelinfo.spec import PRESETS
    from meshrun.plan import ClusterSpec, TrainSpec, make_plan

    spec = replace(PRESETS["gpt-1.3b"], bf16_residual=True)
    plan = make_plan(spec, ClusterSpec(1, 1, 10**15),
                     TrainSpec(1024, 4, None, precision="bf16", compile=False, activation_checkpointing="full"),
                     framework="any")
    c = next(x for x in plan.candidates if x.strategy.label == "single+ac")
    allocated = (c.memory.allocator_peak - c.memory.breakdown["fragmentation"]) / 2**30
    assert abs(allocated / 20.093 - 1) <= 0.03, allocated


@pytest.mark.parametrize("model,micro,global_batch,measured,faster", [
    ("gpt-124m", 64, 256, 1.149, "ddp"),  # FSDP2 grad_op 13% slower than DDP
    ("gpt-1.3b", 32, 512, 1.029, "ddp"),  # DDP 2.9% faster with 4-step accumulation
    ("gpt-1.3b", 16, 64, 0.978, "fsdp-grad-op"),  # FSDP2 2.2% faster without accumulation
])
def test_ddp_or_fsdp_follows_the_measurements(model, micro, global_batch, measured, faster):
    """The step-time estimate's FSDP2 / DDP ratio against the same-card measurements (4 x H200,
    torch 2.11, docs/benchmarks/strategy-choice_4xH200_2026-11-26.md): within 2 points, and
    the plan recommends the faster."""
    p = make_plan(PRESETS[model], ClusterSpec(1, 4, 141 * GiB),
                  TrainSpec(1024, micro, global_batch, compile=True, activation_checkpointing="none"))
    t = {x.strategy.label: x.step_time_s for x in p.candidates}
    assert t["fsdp-grad-op"] / t["ddp"] == pytest.approx(measured, abs=0.02)
    assert p.recommended.strategy.label == faster


def test_step_time_follows_the_measured_layouts():
    """The step-time estimate against the layouts benchmark (GPT 1.3B on 4 x H200, torch 2.11,
    one run; docs/benchmarks/layouts_4xH200_2026-11-26.md): every layout's tokens/s per GPU
    within 12%, and the layouts in the measured order."""
    from meshrun.plan.batch import Batch
    from meshrun.plan.steptime import step_time
    from meshrun.plan.strategies import comm_bytes

    path = os.path.join(CALIBRATION, "h200x4_layouts-throughput_2026-11-26.jsonl")
    m, c = PRESETS["gpt-1.3b"], ClusterSpec(1, 4, 141 * GiB)
    measured, predicted = {}, {}
    for line in open(path):
        r = json.loads(line)
        if r["size"] != "gpt-1.3b" or r.get("cp"):
            continue
        tp, pp = r.get("tp") or 1, r.get("pp") or 1
        if r["strategy"] == "deepspeed":
            s = Strategy(STRATEGIES[f"zero{r['zero']}"], 4, 4)
        elif tp * pp > 1:
            s = Strategy(KINDS["megatron"], 4 // (tp * pp), 4 // (tp * pp), tp=tp, pp=pp)
        else:
            s = Strategy(STRATEGIES["fsdp-grad-op"], 4, 4)
        t = TrainSpec(r.get("seq", 1024), r["micro"], None, compile=r["compile"], activation_checkpointing="none")
        comm, _ = comm_bytes(m, t, s, r["micro"], 1)
        seconds = step_time(m, c, t, s, Batch(r["micro"], 1, s.dp), comm)
        name = f"tp{tp}-pp{pp}" if tp * pp > 1 else s.name  # the benchmark's layouts, by their model-parallel degrees
        predicted[name] = r["micro"] * 1024 / seconds / (s.tp * s.pp)
        measured[name] = r["tokens_per_s_per_gpu"]
    assert len(measured) == 6, measured
    for name in measured:
        assert abs(predicted[name] / measured[name] - 1) <= 0.12, (name, predicted[name], measured[name])
    order = lambda d: [k for k, _ in sorted(d.items(), key=lambda kv: -kv[1])]  # noqa: E731
    assert order(predicted)[-1] == order(measured)[-1] == "tp4-pp1"
    assert set(order(predicted)[:2]) == set(order(measured)[:2]) == {"fsdp-grad-op", "zero2"}


def test_accuracy_harness_measures_each_configuration_alone(tmp_path):
    """bench/plan_accuracy.py measure runs meshrun's rows of a grid in one process group: no
    trainer of an earlier configuration may still be alive when the next one is measured (one
    kept alive through its step closure would inflate every later peak).
    DeepSpeed never frees its engines inside a process, so its rows run one per process
    (``--select``), and such a row starts clean."""
    require("torch")
    import importlib.util
    import subprocess
    import sys

    root = os.path.dirname(USERPKG)
    env = clean_env()
    env["PYTHONPATH"] = os.path.join(root, "src")

    def measure(out, *extra):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               os.path.join(root, "bench", "plan_accuracy.py"), "measure", "--grid", "cpu", "--eager",
                               "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout, [json.loads(x) for x in out.read_text().splitlines()]

    # two of the CPU grid's six meshrun rows, each built after the other's trainer is gone
    _, rows = measure(tmp_path / "rows.jsonl", "--engines", "torch", "--select", "0,3")
    assert [(r["strategy"], r["ac"]) for r in rows] == [("ddp", False), ("fsdp-grad-op", True)]
    assert [r["live_trainers"] for r in rows] == [0, 0]
    assert [r["first_in_process"] for r in rows] == [True, False]
    if os.environ.get("MESHRUN_TEST_STRICT") == "1" or importlib.util.find_spec("deepspeed"):
        _, rows = measure(tmp_path / "ds.jsonl", "--engines", "deepspeed", "--select", "2")
        assert [(r["strategy"], r["live_trainers"]) for r in rows] == [("zero2", 0)]


# ---- model inputs --------------------------------------------------------------------------

def test_presets_have_their_published_sizes():
    sizes = {"gpt-124m": 124e6, "gpt-1.3b": 1.31e9, "llama-7b": 6.74e9, "llama-13b": 13.0e9, "llama-70b": 69.0e9,
             "llama3-8b": 8.03e9}
    for name, n in sizes.items():
        assert PRESETS[name].params == pytest.approx(n, rel=0.01), name


def test_hf_config_counted_from_shapes_and_by_transformers(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu",
           "max_position_embeddings": 4096, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))  # a folder holding config.json works too
    assert spec.params == PRESETS["llama-7b"].params == 6738415616
    require("transformers")
    assert "transformers on the meta device" in spec.source and spec.block_class == "LlamaDecoderLayer"


def test_factory_built_on_meta_device_is_read():
    require("torch")
    import sys

    sys.path.insert(0, USERPKG)
    try:
        spec = resolve_model("userpkg.factories:tiny_llama")
        from userpkg.factories import tiny_llama
    finally:
        sys.path.remove(USERPKG)
    real = tiny_llama()
    assert spec.params == sum(p.numel() for p in real.parameters())
    assert (spec.layers, spec.hidden, spec.ffn, spec.heads, spec.vocab) == (3, 64, 176, 4, 1000)
    assert spec.gated_mlp and not spec.tied and spec.block_class == "_GatedBlock"
    gpt = resolve_model("meshrun.training.models:gpt")  # meshrun's GPT: read exactly from its config
    assert gpt.hidden == 256 and gpt.layers == 4 and gpt.block_class == "Block"


# ---- the flowchart ---------------------------------------------------------------------------

def _pick(model, nodes=1, gpus=8, mem=80, framework="torch", **train):
    train.setdefault("seq_len", 1024)
    train.setdefault("micro_batch", None)
    train.setdefault("global_batch", None)
    p = make_plan(PRESETS[model] if isinstance(model, str) else model, ClusterSpec(nodes, gpus, mem * GiB),
                  TrainSpec(**train), framework)
    return p, p.recommended


def test_small_model_gets_ddp_or_a_single_gpu():
    assert _pick("gpt-124m")[1].strategy.name == "ddp"
    assert _pick("gpt-124m", gpus=1)[1].strategy.name == "single"


def _published(shape: str, tmp_path) -> object:
    """A published Hugging Face shape (bench/hf_config.py's), read from its config.json."""
    family, values = bench_module("hf_config").SHAPES[shape]
    path = tmp_path / f"{shape}.json"
    path.write_text(json.dumps({"model_type": family, **values}))
    return from_hf_config(str(path))


def _one_gpu(model, mem_gib: float, **train):
    """The plan of ``model`` on one GPU of ``mem_gib``, as meshrun train's defaults would run it
    (4,096-token sequences, a global batch of 128 for the planner to split) and its torch rows by label."""
    p, r = _pick(model, gpus=1, mem=mem_gib, **{"seq_len": 4096, "global_batch": 128, **train})
    return r, {x.strategy.label: x for x in p.candidates if x.strategy.engine == "torch"}


def test_one_gpu_shards_over_its_one_rank_where_single_does_not_fit(tmp_path):
    """One GPU: single wherever it fits; FSDP2 full shard over the one rank where it does not.
    Both hold fp32 parameters, gradients and AdamW state (16 bytes a parameter); under autocast
    single also holds a bf16 copy of every weight the matmuls use, from forward to backward,
    where FSDP2 gathers each block's bf16 weights only while the block runs."""
    mistral = _published("mistral-7b", tmp_path)
    r, rows = _one_gpu(mistral, 141)
    assert (r.strategy.label, r.strategy.dp, r.strategy.shard_group) == ("fsdp-full", 1, 1), {
        k: (x.fits, x.memory.peak / GiB) for k, x in rows.items()}
    assert not rows["single"].fits and not rows["single+ac"].fits
    assert r.memory.peak < 0.9 * 141 * GiB
    train = TrainSpec(4096, None, 128)
    states = {k: model_states(mistral, train, rows[k].strategy)[0] for k in ("single", "fsdp-full")}
    assert states["fsdp-full"]["params"] == 4 * mistral.params  # sharded over one rank: every fp32 weight, no copies
    untied_embedding = mistral.vocab * mistral.hidden  # (the lookup is not cast)
    assert states["single"]["params"] == 4 * mistral.params + 2 * (mistral.params - untied_embedding)
    assert rows["fsdp-full"].memory.breakdown["cuda_context"] == rows["single"].memory.breakdown["cuda_context"]

    # Llama-3.2-1B fits one process with room to spare: single, though FSDP2 fits too
    r, rows = _one_gpu(_published("llama3.2-1b", tmp_path), 141)
    assert r.strategy.label == "single" and rows["fsdp-full"].fits
    # and single where it fits even when FSDP2's room for a larger micro-batch makes its estimate faster
    r, rows = _one_gpu(mistral, 192)
    assert rows["fsdp-full"].batch.micro > rows["single"].batch.micro
    assert rows["fsdp-full"].step_time_s < r.step_time_s and r.strategy.label == "single"


def test_llama3_8b_on_one_h200_keeps_adamws_moments_on_the_host():
    """Llama-3-8B's 16 bytes a parameter are 120 GiB: one H200's 141 GiB hold them, not its
    127 usable (the 10% margin). With the moments on the GPU, FSDP2 on the one rank comes
    closest, under the GPU's memory; FSDP2 with AdamW's moments in host memory (8 bytes a
    parameter there, two slices of them on the GPU) fits without checkpointing."""
    r, rows = _one_gpu("llama3-8b", 141)
    assert r is not None and r.strategy.label == "fsdp-offload", {k: x.fits for k, x in rows.items()}
    on_gpu = [x for x in rows.values() if not x.strategy.offload_optimizer]
    assert not any(x.fits for x in on_gpu)
    least = min(on_gpu, key=lambda x: x.memory.peak)
    assert least.strategy.name == "fsdp-full" and least.memory.peak < 141 * GiB < rows["single+ac"].memory.peak
    full = rows["fsdp-full"].memory.breakdown
    assert r.memory.breakdown["optimizer"] == 0  # the moments on the host: 8 bytes a parameter, 2x the fp32 weights
    assert r.memory.cpu_bytes_per_node == pytest.approx(2 * full["params"], rel=1e-6)
    assert r.memory.breakdown["comm_buffers"] == full["comm_buffers"] + 2 * 4 * 2**26  # the two slice buffers


def test_model_that_fits_only_with_sharded_optimizer_and_grads():
    p, r = _pick("gpt-6.7b", micro_batch=1)
    ddp = next(x for x in p.candidates if x.strategy.label == "ddp")
    assert not ddp.fits and r.strategy.label == "fsdp-grad-op"
    _, ds = _pick("gpt-6.7b", micro_batch=1, framework="deepspeed")
    assert ds.strategy.label in ("zero1", "zero2")
    assert any("shard instead" in w for w in p.warnings)


def test_model_that_needs_everything_sharded():
    p, r = _pick("llama-13b", mem=40, micro_batch=1, seq_len=2048)
    assert r.strategy.name == "fsdp-full", [(x.strategy.label, x.fits) for x in p.candidates]
    assert any("optimizer and gradients" in line and "does not fit" in line for line in p.reasons)
    assert any(line.startswith("with activation checkpointing") for line in p.reasons) == r.strategy.ac


def test_still_out_of_memory_means_checkpointing_then_offload():
    p, r = _pick("llama-70b", framework="any", micro_batch=1, seq_len=4096)
    assert r.strategy.offload_optimizer and r.strategy.name.startswith("zero3")
    _, torch_only = _pick("llama-70b", micro_batch=1, seq_len=4096)
    assert torch_only.strategy.engine == "deepspeed"  # nothing torch-native fits: said so
    assert any("nothing torch runs fits" in w for w in _pick("llama-70b", micro_batch=1, seq_len=4096)[0].warnings)


def test_long_context_needs_context_or_tensor_parallelism(tmp_path):
    """Activations that no data-parallel sharding divides: 32K tokens of a 70B model. The
    SkyPilot document's table: very long sequences -> context parallel (TP x PP when CP is not there)."""
    cfg = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
           "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu",
           "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(str(tmp_path / "config.json"))
    p, r = _pick(m, nodes=8, micro_batch=1, seq_len=32768, activation_checkpointing="full")
    rows = [(x.strategy.label, x.fits, x.memory.peak // GiB if x.memory else None) for x in p.candidates]
    assert r is not None and r.strategy.cp > 1, rows
    assert any(x.fits and x.strategy.engine == "megatron" and x.strategy.tp > 1 for x in p.candidates), rows


def test_largest_micro_batch_that_fits_divides_the_global_batch():
    _, r = _pick("gpt-1.3b", gpus=4, mem=24, global_batch=96)
    b = r.batch
    assert b.global_batch == 96 and b.micro * b.accum * 4 == 96 and r.memory.peak <= 0.9 * 24 * GiB


# ---- batch arithmetic --------------------------------------------------------------------------

def test_batch_arithmetic():
    assert solve(256, 8, 4).accum == 8
    with pytest.raises(MeshrunError, match=r"--global-batch=100: is not a multiple of micro-batch 8 x "
                                           r"data-parallel size 4 = 32 \(hint: use 96 or 128"):
        solve(100, 8, 4)


# ---- CLI ---------------------------------------------------------------------------------------

def test_plan_json_shape():
    out = meshrun_here("plan", "--model", "gpt-1.3b", "--gpus-per-node", "4", "--gpu-mem", "80GiB", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    # meshrun train's defaults: compiled, the model's 1024-token context, a global batch of 512K
    # tokens with the largest micro-batch that fits: at 1.3B on 4 x 80 GiB FSDP2 grad_op, whose
    # sharded states leave room for twice DDP's micro-batch
    r = d["recommended"]
    assert d["train"]["compile"] and d["train"]["seq_len"] == 1024
    assert r["strategy"] == "fsdp-grad-op" and r["global_batch"] == 512
    assert r["micro_batch"] * r["accumulation"] * 4 == 512
    for c in d["candidates"]:
        assert {"strategy", "fits", "peak_bytes", "breakdown"} <= set(c)
        assert sum(c["breakdown"].values()) == c["peak_bytes"]


def test_plan_table_explain_and_check_choice():
    out = meshrun_here("plan", "--model", "gpt-1.3b", "--gpus-per-node", "4", "--gpu-mem", "80GiB",
                  "--framework", "deepspeed", "--strategy", "zero3-offload", "--explain")
    assert out.returncode == 0, out.stderr
    assert "recommended: zero1" in out.stdout
    assert "CPU offload although" in out.stdout  # the SkyPilot document's "ZeRO-3 + CPU offload by default"
    assert "activations and the loss spike: traced from the model on the meta device at seq 1024" in out.stdout


def test_written_configs_are_accepted_by_accelerate_and_meshrun_train(tmp_path):
    require("accelerate")
    out = meshrun_here("plan", "--model", "gpt-1.3b", "--gpus-per-node", "4", "--gpu-mem", "80GiB",
                  "--global-batch", "64", "--write", str(tmp_path))
    assert out.returncode == 0, out.stderr
    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert acc.distributed_type == "FSDP" and acc.num_processes == 4
    assert acc.fsdp_config["fsdp_reshard_after_forward"] is False  # grad_op
    from meshrun.config import build_config, load_file

    cfg = build_config(load_file(str(tmp_path / "train.yaml")), {}, "train.yaml")
    assert (cfg.strategy, cfg.global_batch, cfg.model_size, cfg.compile) == ("fsdp-grad-op", 64, "gpt-1.3b", "on")
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 64
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    assert "auto" not in json.dumps(ds)


@pytest.mark.parametrize("stage", [2, 3])
def test_written_ds_config_runs_in_deepspeed(tmp_path, stage):
    """DeepSpeed itself parses and trains with the generated file (2 gloo processes)."""
    require("deepspeed")
    from meshrun.plan.configs import ds_config

    p = make_plan(gpt_spec("tiny", 64, 2, 4, 256, 64), ClusterSpec(1, 2, 80 * GiB),
                  TrainSpec(64, 4, 16, precision="fp32"), framework="deepspeed")  # CPU: fp32
    cand = next(x for x in p.candidates if x.strategy.label == {2: "zero2", 3: "zero3"}[stage])
    cfg = ds_config(p, cand)
    cfg["optimizer"]["params"]["torch_adam"] = True  # CPU: DeepSpeed's fused Adam is CUDA-only
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    out = meshrun("launch", "-f", "deepspeed", "--nproc", "2", "--deepspeed-config", str(path),
                  example("deepspeed_train.py"), env=plan_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = lines(out.stdout, "DSTRAIN")
    assert len(got) == 2 and all(g["stage"] == str(stage) and g["world"] == "2" for g in got)
    assert got[0]["checksum"] == got[1]["checksum"]  # ZeRO kept the replicas in sync


BAD = [
    (["--model", "gpt-9b"], "--model='gpt-9b': is not a preset"),
    (["--gpu-mem=-5GiB"], "--gpu-mem='-5GiB': is not a size"),
    (["--gpu-mem", "0GiB"], "--gpu-mem='0GiB': must be positive"),
    (["--gpu-mem", "80"], "--gpu-mem='80': has no unit"),
    (["--gpu-mem", "80GiB", "--nodes", "0"], "--nnodes='0': must be >= 1"),
    (["--gpu-mem", "80GiB", "--nnodes", "0"], "--nnodes='0': must be >= 1"),
    (["--gpu-mem", "80GiB", "--gpus-per-node", "4", "--micro-batch", "8", "--global-batch", "100"],
     "--global-batch=100: is not a multiple of micro-batch 8 x data-parallel size 4 = 32"),
    (["--gpu-mem", "80GiB", "--gpus-per-node", "4", "--global-batch", "6"], "--global-batch=6: does not split"),
    (["--gpu-mem", "80GiB", "--model", "llama-7b", "--seq-len", "8192"], "is longer than the model's 4096"),
    (["--gpu-mem", "80GiB", "--margin", "1.5"], "--margin='1.5': must be in [0, 1)"),
    (["--gpu-mem", "80GiB", "--inter", "carrier-pigeon"], "--inter='carrier-pigeon': unknown"),
    (["--model", "nosuchmod:build", "--gpu-mem", "80GiB"], "cannot import module 'nosuchmod'"),
    ([], "--gpu-mem is not given: no GPU on this machine"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line(args, message, tmp_path):
    env = plan_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = meshrun("plan", *args, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in out.stderr, out.stderr


def test_bad_config_json_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": -4}))
    out = meshrun_here("plan", "--model", str(path), "--gpu-mem", "80GiB")
    assert out.returncode == 2 and "hidden_size=-4: must be a positive integer" in out.stderr


# ---- meshrun train --strategy auto ----------------------------------------------------------------

def test_train_auto_asks_the_planner():
    require("torch")
    import torch

    from meshrun.config import TrainConfig, build_config, validate
    from meshrun.training.models.gpt import gpt
    from meshrun.training.parallel.auto import decide

    with torch.device("meta"):
        model = gpt("gpt-1.3b", 1024)
    roomy = decide(model, validate(TrainConfig(micro_batch=16, seq_len=1024)), 4, 4, 4, 141 * GiB, True)
    assert (roomy.strategy, roomy.activation_checkpointing, roomy.micro_batch) == ("fsdp-grad-op", "none", 16)
    assert roomy.reasons[0].startswith("planner: fsdp-grad-op predicted")
    tight = decide(model, validate(TrainConfig(micro_batch=16, seq_len=1024)), 1, 1, 1, 40 * GiB, True)
    assert (tight.strategy, tight.activation_checkpointing) == ("single", "full")
    assert any("activation checkpointing on to fit" in r for r in tight.reasons)
    said_none = build_config({}, {"activation_checkpointing": "none", "micro_batch": 16, "seq_len": 1024})
    kept = decide(model, said_none, 1, 1, 1, 40 * GiB, True)
    assert kept.activation_checkpointing == "none" and "nothing fits" in kept.reasons[0]
    on_cpu = decide(model, validate(TrainConfig(seq_len=1024)), 2, 2, 2, None, False)
    assert (on_cpu.strategy, on_cpu.micro_batch, on_cpu.global_batch) == ("ddp", 8, None)


def test_train_auto_chooses_the_micro_batch_for_a_global_batch():
    """--global-batch without --micro-batch: the planner sizes the micro-batch; with
    accumulation DDP beats FSDP2 at the same micro-batch (its optimizer step runs once per
    several micro-steps, its whole-model graph runs no FSDP hooks: measured +2.9% at GPT 1.3B,
    32 x 4 on 4 x H200), without accumulation FSDP2's sharded optimizer step wins (measured
    +2.3% at micro-batch 16); activation checkpointing is not bought for a bigger micro-batch
    when one without it fits. With no batch size at all the global batch is 512K tokens."""
    require("torch")
    import torch

    from meshrun.config import TrainConfig, validate
    from meshrun.plan.steptime import MAX_MICRO_TOKENS
    from meshrun.training.models.gpt import gpt
    from meshrun.training.parallel.auto import decide

    def pick(size, world, mem, **kw):
        with torch.device("meta"):
            model = gpt(size, 1024)
        kw = {"global_batch": 512, **kw}
        d = decide(model, validate(TrainConfig(seq_len=1024, **kw)), world, world, world, mem, True)
        return d.strategy, d.activation_checkpointing, d.micro_batch

    assert pick("gpt-124m", 4, 141 * GiB) == ("ddp", "none", MAX_MICRO_TOKENS // 1024)
    # traced, GPT 1.3B's activations leave FSDP2 grad_op room for micro-batch 64 (measured: 125 GiB
    # of an H200 at 64 x 2 on 2 GPUs, predicted 122), where DDP's replicated states stop at 32:
    # half the micro-steps beat DDP's single graph
    assert pick("gpt-1.3b", 4, 141 * GiB) == ("fsdp-grad-op", "none", 64)
    assert pick("gpt-1.3b", 4, 80 * GiB) == ("fsdp-grad-op", "none", 32)
    assert pick("gpt-1.3b", 4, 141 * GiB, global_batch=64) == ("fsdp-grad-op", "none", 16)
    one = pick("gpt-1.3b", 1, 141 * GiB)[2]  # accumulation makes up the rest of the 512
    assert one >= 32 and 512 % one == 0, one
    assert pick("gpt-1.3b", 4, 141 * GiB, micro_batch=8)[2] == 8  # the user's micro-batch stands
    assert pick("gpt-124m", 4, 141 * GiB, global_batch=None) == ("ddp", "none", MAX_MICRO_TOKENS // 1024)
    with torch.device("meta"):
        default = decide(gpt("gpt-124m", 1024), validate(TrainConfig(model_size="gpt-124m")), 4, 4, 4, 141 * GiB, True)
    assert default.global_batch == 512 and any("512K tokens, the default on GPUs" in r for r in default.reasons)
    named = decide(gpt("gpt-tiny", 256), validate(TrainConfig(strategy="fsdp-full")), 2, 2, 2, 80 * GiB, True)
    assert named.strategy == "fsdp-full" and named.micro_batch > 8  # a named strategy is sized too


def test_plan_options_come_from_the_environment_too():
    env = plan_env()
    env.update(MESHRUN_PRECISION="fp32", MESHRUN_GPU_MEM="40GiB", MESHRUN_GPUS_PER_NODE="2")
    d = json.loads(meshrun_here("plan", "--model", "gpt-124m", "--json", env=env).stdout)
    assert d["train"]["precision"] == "fp32" and d["cluster"]["gpu_mem_bytes"] == 40 * GiB
    assert d["cluster"]["gpus_per_node"] == 2


@pytest.mark.parametrize("name", ["zero3-offload+ac", "tp2-pp2-dp2+ac"])
def test_train_config_for_deepspeed_and_model_parallel_candidates(name):
    """Every candidate meshrun train runs becomes a valid train config."""
    from meshrun.config import build_config
    from meshrun.plan.configs import train_config

    p = make_plan(PRESETS["gpt-1.3b"], ClusterSpec(1, 8, 10 * GiB), TrainSpec(1024, 1, None, compile=False),
                  framework="any")
    cands = {x.strategy.label: x for x in p.candidates}
    if name not in cands:  # model-parallel rows appear only when nothing data-parallel fits
        p = make_plan(PRESETS["llama-70b"], ClusterSpec(1, 8, 80 * GiB), TrainSpec(4096, 1, None, compile=False),
                      framework="any")
        cands = {x.strategy.label: x for x in p.candidates}
    cfg = build_config(train_config(p, cands[name], p.model), {})
    if name.startswith("zero"):
        assert (cfg.strategy, cfg.activation_checkpointing) == ("zero3-offload", "full")
    else:
        assert (cfg.strategy, cfg.tp, cfg.pp) == ("fsdp-full", 2, 2)


def test_mixture_of_experts_plans_expert_parallelism():
    """The SkyPilot document's table: MoE -> expert parallel. Experts over 4 ranks fit where a replica does
    not, and rank before FSDP; the train config carries --ep."""
    from meshrun.plan.configs import train_config

    p, r = _pick("gpt-moe-8x1.3b", micro_batch=4)
    ddp = next(x for x in p.candidates if x.strategy.label == "ddp")
    assert not ddp.fits and r.strategy.ep > 1
    ep2, ep4 = (next(x for x in p.candidates if x.strategy.label == f"ddp-ep{e}") for e in (2, 4))
    assert ep4.memory.breakdown["optimizer"] < ep2.memory.breakdown["optimizer"]  # experts split further
    assert train_config(p, r, p.model)["ep"] == r.strategy.ep


@pytest.mark.parametrize("gpus,seq,label,tokens_per_s_per_gpu,within", [
    (2, 262144, "fsdp-grad-op+ac", 4100, 0.05),  # 2 x H200, chunked loss
    (2, 262144, "fsdp-full-cp2+ac", 2524, 0.05),  # the same host: CP2 (grad_op ran; the same compute)
    (4, 262144, "fsdp-grad-op+ac", 4082, 0.05),  # 4 x H200, chunked loss
    (4, 262144, "fsdp-full-cp4+ac", 2411, 0.09),  # the same host: CP4 (0.59x FSDP2 alone; CP2's 0.62 planned)
    (4, 524288, "fsdp-full-cp4+ac", 1305, 0.05),
    (4, 524288, "fsdp-grad-op+ac", 2170, 0.05),  # 4 x H200: one step each
    (4, 1048576, "fsdp-full-cp4+ac", 680, 0.05),
    (4, 131072, "fsdp-grad-op+ac", 6770, 0.15),  # 4 x H200, another host
    (4, 65536, "fsdp-grad-op+ac", 11526, 0.15),
])
def test_long_sequence_step_time_follows_causal_work(gpus, seq, label, tokens_per_s_per_gpu, within):
    """GPT 1.3B, full activation checkpointing, one sequence per data-parallel rank, eager
    (H200, torch 2.11; docs/benchmarks/long-sequence_4xH200_2026-11-26.md). The estimate counts
    the work causal attention does (half of MFU's 12·L·h·s) and splits it over the
    context-parallel ranks at CP's measured efficiency; counting attention whole gives 115 s
    for both 256K rows (measured 64 and 52 s) and cannot tell CP from FSDP alone. Every row is
    a little under: the matmuls of these 64K-1M-token micro-batches count as more efficient
    than the layouts benchmark's 16K (steptime.matmul_efficiency), which moves them 0.3-2.6 points
    down; the CP4 row also ran at 0.59x FSDP2 alone against CP2's 0.62 that is planned."""
    from meshrun.modelinfo.spec import PRESETS
    from meshrun.plan import ClusterSpec, TrainSpec, make_plan

    plan = make_plan(PRESETS["gpt-1.3b"], ClusterSpec(1, gpus, 141 * 10**9),
                     TrainSpec(seq, 1, None, precision="bf16", compile=False, activation_checkpointing="full"),
                     framework="torch")
    c = next(x for x in plan.candidates if x.strategy.label == label)
    measured = c.batch.global_batch * seq / (tokens_per_s_per_gpu * gpus)
    assert abs(c.step_time_s / measured - 1) <= within, (c.step_time_s, measured)


@pytest.mark.parametrize("gpus,seq,cp,allocated_gib", [
    (4, 262144, 4, 18.71), (4, 524288, 4, 33.47), (4, 262144, 1, 49.48),  # 4 x H200
    (4, 524288, 1, 95.0), (4, 1048576, 4, 62.99),  # 4 x H200
    (2, 262144, 1, 51.2), (2, 262144, 2, 31.69), (2, 524288, 2, 58.2),  # 2 x H200
])
def test_long_sequence_memory_counts_the_position_table(gpus, seq, cp, allocated_gib):
    """GPT 1.3B, full AC, chunked loss, FSDP2 grad_op (what the benchmark's auto chose) alone
    or with CP, one sequence per data-parallel rank: the allocated peak within 11% (median of
    the six rows 3.9%). meshrun's GPT builds its learned position table at the sequence
    length: 1.07B parameters at 512K. Without it the 4-GPU rows were 4-12% under."""
    from dataclasses import replace

    from meshrun.plan import ClusterSpec, TrainSpec, memory

    m = replace(PRESETS["gpt-1.3b"], fused_loss=True)
    assert m.at_seq(seq).params - m.params == (seq - 1024) * 2048
    t = TrainSpec(seq, 1, None, precision="bf16", compile=False, activation_checkpointing="full")
    s = memory.Strategy(STRATEGIES["fsdp-grad-op"], gpus // cp, gpus, ac=True, cp=cp)
    est = memory.estimate(m.at_seq(seq), ClusterSpec(1, gpus, 141 * GiB), t, s, 1)
    allocated = est.allocator_peak - est.breakdown["fragmentation"] - est.breakdown["cuda_context"]
    assert abs(allocated / GiB / allocated_gib - 1) <= 0.11, allocated / GiB


def test_only_meshruns_gpt_grows_its_position_table():
    """A preset follows the sequence (the trainer builds it at --seq-len), and make_plan uses
    that; a Hugging Face config's table and a built module's stay as they are. The table is
    looked up, not multiplied: FLOPs per token do not grow with it."""
    from meshrun.plan import ClusterSpec, TrainSpec, make_plan

    m = PRESETS["gpt-1.3b"]
    assert m.learned_positions == 1024 and m.at_seq(1024) is m
    assert m.at_seq(8192).flops_per_token(8192) == m.flops_per_token(8192)
    plan = make_plan(m, ClusterSpec(1, 4, 141 * GiB), TrainSpec(65536, 1, None, compile=False), framework="torch")
    assert plan.model.params == m.params + (65536 - 1024) * 2048
    assert PRESETS["llama-7b"].at_seq(65536) is PRESETS["llama-7b"]


def test_plan_says_when_a_chunked_loss_would_let_a_simpler_layout_fit():
    """GPT 1.3B at 256K tokens on 4 x 141 GB, eager: the whole logits (~172 GiB) leave only
    context parallelism; without them FSDP2 alone fits (measured on 4 x H200, torch 2.11:
    without the chunked loss FSDP2 alone stops at 128K, the logits running out of memory at
    256K; docs/benchmarks/long-sequence_4xH200_2026-11-26.md). Short sequences get no such line."""
    from meshrun.modelinfo.spec import PRESETS
    from meshrun.plan import ClusterSpec, TrainSpec, make_plan

    long = make_plan(PRESETS["gpt-1.3b"], ClusterSpec(1, 4, 141 * 10**9),
                     TrainSpec(262144, 1, None, precision="bf16", compile=False), framework="torch")
    assert long.recommended.strategy.cp > 1
    said = [w for w in long.warnings if "--fused-loss" in w]
    assert len(said) == 1 and "would let fsdp-grad-op+ac fit" in said[0] and "172 GiB" in said[0], long.warnings
    short = make_plan(PRESETS["gpt-124m"], ClusterSpec(1, 4, 80 * 10**9),
                      TrainSpec(1024, 8, None, precision="bf16", compile=False), framework="torch")
    assert not any("--fused-loss" in w for w in short.warnings)


def test_fsdp2_reduce_scatter_stream_keeps_the_gradient_shards_reserved():
    """Why the planner adds FSDP2's gradient shards to the reserved peak when the peak comes with
    the activations: in the GPT 1.3B rows of h200x4_early-state_2026-11-27.jsonl (4 x H200,
    torch 2.11) the side stream with the most segments,
    the reduce-scatter stream, holds within 10% of the fp32 gradient shards (1.27 GiB for 1.21),
    free at that moment and out of the compute stream's reach; the compute stream holds the rest."""
    from meshrun.modelinfo.spec import PRESETS
    from meshrun.plan.memory import params_per_gpu

    path = os.path.join(CALIBRATION, "h200x4_early-state_2026-11-27.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["model"] == "gpt-1.3b" and r["strategy"].startswith("fsdp")]
    assert len(rows) == 4
    shards = 4 * params_per_gpu(PRESETS["gpt-1.3b"], Strategy(STRATEGIES["fsdp-full"], dp=4, shard_group=4)) / 4 / GiB
    for r in rows:
        side = [v for k, v in r["segments"].items() if k != "0"]
        rs = max(side, key=lambda v: v[0])  # [segments, GiB reserved, GiB in use, largest free]
        assert abs(rs[1] / shards - 1) <= 0.10, (r["strategy"], r["micro"], rs, shards)


@pytest.mark.parametrize("model", ["gpt-124m", "gpt-1.3b", "userpkg.factories:tiny_llama"])
def test_plan_and_train_resolve_the_same_defaults(model):
    """`meshrun plan`'s default candidate is planned as `meshrun train` would run the job on
    those GPUs: compiled, at the same sequence length, with the same global batch, and the
    same strategy and micro-batch (one policy: plan.recommend.choose)."""
    require("torch")
    import torch

    from meshrun.config import TrainConfig, resolve_seq_len, validate
    from meshrun.modelinfo.factory import call_factory
    from meshrun.modelinfo.read import context_of
    from meshrun.training.models.gpt import gpt
    from meshrun.training.parallel.auto import decide

    # a factory is imported from PYTHONPATH: in a process of its own
    out = (meshrun if ":" in model else meshrun_here)("plan", "--model", model, "--gpus-per-node", "4", "--gpu-mem",
                                                      "80GiB", "--json", env=plan_env())
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    factory = ":" in model
    cfg = validate(TrainConfig(**({"model": model} if factory else {"model_size": model})))
    with torch.device("meta"):
        # as `meshrun train` builds its GPT on GPUs (--kernels auto)
        live = call_factory(model, "--model") if factory else gpt(model, cfg.seq, head_loss=True, fused_mlp="auto")
    cfg = resolve_seq_len(cfg, context_of(live))
    choice = decide(live, cfg, 4, 4, 4, 80 * GiB, True)
    assert d["train"]["compile"] is cfg.compiles(cuda=True) is True
    assert d["train"]["seq_len"] == cfg.seq
    r = d["recommended"]
    assert (r["strategy"], r["global_batch"], r["micro_batch"]) == (choice.strategy, choice.global_batch,
                                                                     choice.micro_batch)


def _hf_llama_on_meta():
    require("transformers")
    import transformers

    from meshrun.modelinfo.hf import build_on_meta

    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=4096, tie_word_embeddings=True)
    return build_on_meta(config)


def test_the_policy_compiles_a_model_liger_knows_with_its_fused_loss_alone():
    """Per family: meshrun's GPT compiles with its own kernels; a Hugging Face model Liger
    knows compiles per block with Liger's fused loss alone (its other kernels do not compile:
    they fail under DDP); --compile off runs every Liger kernel eager; --kernels plain none of
    Liger's; a model Liger does not know compiles as before."""
    require("torch")
    import torch

    from meshrun.config import TrainConfig, validate
    from meshrun.training.models.gpt import gpt
    from meshrun.training.parallel.auto import decide

    llama = _hf_llama_on_meta()
    cfg = validate(TrainConfig(seq_len=4096))
    auto = decide(llama, cfg, 2, 2, 2, 141 * GiB, True, liger=True)
    assert (auto.compile, auto.liger, auto.liger_loss) == (True, False, True)
    assert any(r.startswith("compiled per block, with Liger Kernel's fused linear cross-entropy") for r in auto.reasons)
    by_hand = decide(llama, validate(TrainConfig(seq_len=4096, compile="on")), 2, 2, 2, 141 * GiB, True, liger=True)
    assert (by_hand.compile, by_hand.liger, by_hand.liger_loss, by_hand.kernels) == (True, False, True, "liger-loss")
    assert any("Liger Kernel's fused linear cross-entropy for the loss" in r for r in by_hand.reasons)
    unfused = decide(llama, validate(TrainConfig(seq_len=4096, compile="on", kernels="plain")), 2, 2, 2, 141 * GiB,
                     True, liger=True)
    assert (unfused.compile, unfused.liger, unfused.liger_loss, unfused.kernels) == (True, False, False, "plain")
    # planned as it runs: the compiled run with Liger's loss holds no logits either
    assert by_hand.largest_micro is not None and unfused.largest_micro is not None
    assert by_hand.largest_micro > unfused.largest_micro
    off = decide(llama, validate(TrainConfig(seq_len=4096, compile="off")), 2, 2, 2, 141 * GiB, True, liger=True)
    assert (off.compile, off.liger, off.liger_loss, off.kernels) == (False, True, False, "liger")
    plain = decide(llama, cfg, 2, 2, 2, 141 * GiB, True, liger=False)
    assert (plain.compile, plain.liger, plain.liger_loss) == (True, False, False)  # Liger does not patch it
    # planned as it runs: Liger's fused loss holds no logits, so a larger micro-batch fits
    assert auto.largest_micro is not None and plain.largest_micro is not None
    assert auto.largest_micro > plain.largest_micro
    # a Mixture-of-Experts model keeps its measured path, eager with Liger, unless --compile on
    from transformers import MixtralConfig

    from meshrun.modelinfo.hf import build_on_meta

    moe = build_on_meta(MixtralConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=4096))
    routed = decide(moe, cfg, 2, 2, 2, 141 * GiB, True, liger=True)
    assert (routed.compile, routed.liger, routed.liger_loss) == (False, True, False)
    assert any(r.startswith("a Mixture-of-Experts model: eager") for r in routed.reasons)
    asked = decide(moe, validate(TrainConfig(seq_len=4096, compile="on")), 2, 2, 2, 141 * GiB, True, liger=True)
    assert (asked.compile, asked.liger, asked.liger_loss) == (True, False, True)
    zero3 = decide(llama, validate(TrainConfig(seq_len=4096, strategy="zero3")), 2, 2, 2, 141 * GiB, True, liger=True)
    assert zero3.liger is False  # ZeRO-3's partitioned weights take the plain paths, and are planned so
    with torch.device("meta"):
        model = gpt("gpt-124m", 1024)
    own = decide(model, validate(TrainConfig(model_size="gpt-124m")), 2, 2, 2, 141 * GiB, True, liger=False)
    assert (own.compile, own.liger) == (True, False)
    on_cpu = decide(llama, cfg, 2, 2, 2, None, False, liger=False)
    assert (on_cpu.compile, on_cpu.liger) == (False, False)


def test_plan_and_train_agree_on_when_liger_runs():
    """`meshrun plan` traces with Liger's kernels exactly when `meshrun train` would patch them:
    one rule (defaults.liger_runs) for --kernels x --compile, asked of a model Liger knows; and
    its fused loss alone where the run compiles with --kernels auto."""
    require("torch")
    require("liger_kernel")
    import argparse

    from meshrun.cli.plan import run_config, run_facts
    from meshrun.config import TrainConfig, validate
    from meshrun.config.policy import settings
    from meshrun.training.parallel.auto import compile_and_kernels

    llama = _hf_llama_on_meta()
    facts = run_facts(ClusterSpec(1, 2, 141 * GiB), "bf16", llama, builtin_gpt=False)
    for kernels in ("auto", "plain"):
        for compile_choice in ("auto", "on", "off"):
            cfg = validate(TrainConfig(seq_len=4096, kernels=kernels, compile=compile_choice))
            decided = compile_and_kernels(cfg, True, True)
            runs = decided.liger
            ns = argparse.Namespace(kernels=kernels, compile=compile_choice, micro_batch=None, global_batch=None,
                                    precision="bf16", strategy=None, activation_checkpointing="auto", seq_len="4096",
                                    lora=None, quantize=None)
            planned = settings(run_config(ns, None), facts)  # what plan traces with
            assert (planned.liger, planned.liger_loss) == (runs, decided.liger_loss)
            assert runs is (kernels == "auto" and compile_choice == "off")
            assert decided.liger_loss is (kernels == "auto" and compile_choice != "off")
            # a LoRA run compiles where a full fine-tune takes Liger's kernels (--compile auto)
            lora = validate(TrainConfig(seq_len=4096, kernels=kernels, compile=compile_choice, lora=16))
            compiled, runs = compile_and_kernels(lora, True, True)[:2]
            ns.lora, ns.quantize = "16", None
            assert settings(run_config(ns, None), facts).liger is runs
            assert (compiled, runs) == ((True, False) if compile_choice == "auto" and kernels == "auto" else
                                        (compile_choice != "off", kernels == "auto" and compile_choice == "off"))
            ns.lora = None


def test_a_model_that_fits_nowhere_is_refused_before_it_runs_out_of_memory():
    require("torch")
    from meshrun.config import TrainConfig, validate
    from meshrun.training.parallel.auto import decide

    llama = _hf_llama_on_meta()
    with pytest.raises(MeshrunError, match=r"does not fit 1 GPU\(s\) of 8 GiB: the planner's least, .* needs "):
        decide(llama, validate(TrainConfig(seq_len=4096)), 1, 1, 1, 8 * GiB, True, liger=True)
    # what the user set by hand is tried as asked
    tried = decide(llama, validate(TrainConfig(seq_len=4096, micro_batch=1)), 1, 1, 1, 8 * GiB, True, liger=True)
    assert tried.micro_batch == 1


# ---- what the plan prints --------------------------------------------------------------------

LLAMA3_8B_2X8 = ["--model", "llama3-8b", "--nnodes", "2", "--gpus-per-node", "8", "--gpu-mem", "80GiB"]


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_every_size_in_the_table_is_gib_with_two_decimals_or_says_why_it_is_none():
    out = meshrun_here("plan", *LLAMA3_8B_2X8, "--framework", "any", env=plan_env())
    assert out.returncode == 0, out.stderr
    rows = _table_rows(out.stdout)
    assert len(rows) > 10
    for row in rows:
        label, sizes = row[0], row[2:9]  # params .. peak
        for size in sizes:
            assert re.fullmatch(r"\d+\.\d\d|-|cpu|0", size), (label, size)
        if label.lstrip("*").startswith("fsdp") and not label.endswith("+ac"):
            assert row[3] == "-", row  # FSDP2's gradients: not alive at the start of backward
        if "offload" in label:
            assert row[4] == "cpu", row
    assert "memory in GiB per GPU" in out.stdout
    assert "(-: none alive then; cpu: offloaded)" in out.stdout


def test_step_times_have_three_figures_and_name_the_peak_they_assume():
    from meshrun.units import fmt_seconds

    assert [fmt_seconds(x) for x in (0.000293, 0.00475, 0.512, 3.784, 11.04)] == \
        ["293 µs", "4.75 ms", "512 ms", "3.78 s", "11 s"]
    out = meshrun_here("plan", "--model", "gpt-124m", "--gpus-per-node", "1", "--gpu-mem", "80GiB", env=plan_env())
    steps = [row[-1] for row in _table_rows(out.stdout)]
    assert steps and all(re.fullmatch(r"[\d.]+ (µs|ms|s)", s) for s in steps), steps
    said = [line.strip() for line in out.stdout.splitlines()]
    assert ("step~: estimated seconds per optimizer step: the work at 989.4 TFLOP/s dense bf16 (assumed: an "
            "H100/H200 SXM's, the card is not known; --gpu NAME sets it)") in said


def _step_s(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def test_the_plan_for_llama3_8b_on_two_nodes_names_the_faster_deepspeed_row():
    out = meshrun_here("plan", *LLAMA3_8B_2X8, env=plan_env())
    said = [line.strip() for line in out.stdout.splitlines()]
    rows = _table_rows(out.stdout)
    zero1 = next(r for r in rows if r[0] == "zero1")
    assert _step_s(zero1[-1]) < 0.99 * _step_s(rows[0][-1])  # faster than the pick, and not torch's
    assert f"zero1 (deepspeed) shows {zero1[-1]}; not a --framework torch strategy (--framework any weighs it)" in said


def test_a_strategy_asked_for_always_gets_its_verdict():
    rows = {r[0].lstrip("*"): r for r in _table_rows(meshrun_here("plan", *LLAMA3_8B_2X8, env=plan_env()).stdout)}
    hybrid, grad_op = rows["fsdp-hybrid"], rows["fsdp-grad-op+ac"]  # the pick, and another that fits
    out = meshrun_here("plan", *LLAMA3_8B_2X8, "--strategy", "fsdp-grad-op+ac", env=plan_env())
    assert (f"--strategy fsdp-grad-op+ac: fits, 58.4 GiB per GPU at micro-batch 4 x accumulation 2, about "
            f"{grad_op[-1]} per step; the recommendation, fsdp-hybrid, needs 50.5 GiB and about {hybrid[-1]}"
            ) in out.stdout
    mine = meshrun_here("plan", *LLAMA3_8B_2X8, "--strategy", "fsdp-hybrid", env=plan_env())
    assert "--strategy fsdp-hybrid: fits, 50.5 GiB per GPU" in mine.stdout
    assert "; it is the recommendation" in mine.stdout
    no = meshrun_here("plan", *LLAMA3_8B_2X8, "--strategy", "ddp", env=plan_env())
    assert "--strategy ddp: does not fit, 197 GiB per GPU" in no.stdout


def test_nnodes_is_the_node_count_as_in_train_and_launch_and_nodes_is_the_same():
    a = meshrun_here("plan", *LLAMA3_8B_2X8, "--json", env=plan_env())
    b = meshrun_here("plan", *[("--nodes" if x == "--nnodes" else x) for x in LLAMA3_8B_2X8], "--json", env=plan_env())
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert json.loads(a.stdout)["cluster"]["nodes"] == 2


def test_the_guides_plan_examples_are_what_the_command_prints():
    guide = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide.md")).read()
    blocks = [part.split("\n```", 1)[0] for part in guide.split("```text\n$ meshrun plan ")[1:]]
    assert len(blocks) >= 2  # a full fine-tune's plan and a LoRA run's
    for block in blocks:
        command, shown = block.split("\n", 1)
        out = meshrun_here("plan", *command.split(), env=plan_env())
        assert out.returncode == 0, out.stderr
        assert [line.rstrip() for line in out.stdout.splitlines()] == shown.splitlines()
