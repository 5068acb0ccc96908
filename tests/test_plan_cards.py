"""The card a plan is for: --gpu sets the peaks and the memory, an unknown card's peaks are
said to be assumed, float8's step time comes from the card's float8 peak and the measured
float8 speedup, and the micro-batch's matmul efficiency follows the measured doublings."""

from __future__ import annotations

import json

import pytest
from helpers import meshrun_here, require

from meshrun.modelinfo.spec import PRESETS
from meshrun.plan import ClusterSpec, TrainSpec, make_plan
from meshrun.plan.cards import CARDS, card_of_device

GiB = 2**30


def _json(*args: str, env: dict[str, str] | None = None) -> dict:
    out = meshrun_here("plan", *args, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _said(*args: str) -> list[str]:
    out = meshrun_here("plan", *args)
    assert out.returncode == 0, out.stderr
    return [line.strip() for line in out.stdout.splitlines()]


@pytest.mark.parametrize("name,card", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10", "a10"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA L40", None), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 3090", None), ("Tesla V100-SXM2-16GB", None),
])
def test_a_device_name_is_the_card_it_names(name, card):
    """The names CUDA reports, to the cards the planner knows (or none: its peaks are then
    assumed, and said to be)."""
    found = card_of_device(name)
    assert (found.name if found else None) == card


def test_gpu_sets_the_peak_and_the_memory():
    l4 = _json("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "l4")
    assert l4["cluster"]["gpu"] == "l4" and l4["cluster"]["gpu_mem_bytes"] == 24 * GiB
    assert l4["cluster"]["peak_flops"]["bf16"] == 121e12 and not l4["cluster"]["peak_assumed"]
    smaller = _json("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "L4", "--gpu-mem", "20GiB")
    assert smaller["cluster"]["gpu_mem_bytes"] == 20 * GiB and smaller["cluster"]["peak_flops"]["bf16"] == 121e12
    h100 = _json("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "h100", "--gpu-mem", "24GiB")
    # the same memory, the same layouts: the L4's step is its peak's share longer, give or take what it hides
    mine, theirs = ({c["strategy"]: c for c in p["candidates"]} for p in (l4, h100))
    for name, c in mine.items():
        if c["fits"] and theirs[name]["fits"] and c["micro_batch"] == theirs[name]["micro_batch"]:
            assert c["step_time_parts_s"]["compute"] == pytest.approx(
                theirs[name]["step_time_parts_s"]["compute"] * 989.4 / 121, rel=1e-3)
    said = _said("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "l4")
    assert "llama3-8b (8.03B params) on 1 x 8 GPUs of 24 GiB, seq 4096, bf16; memory in GiB per GPU" in said
    assert "step~: estimated seconds per optimizer step: the work at 121 TFLOP/s dense bf16 (the L4's)" in said


def test_an_unknown_card_is_said_to_be_assumed_once():
    """--gpu-mem alone: step~ assumes an H100/H200 SXM's peak, and the output says so in one
    place; with a card named, it says whose peak it is."""
    text = "\n".join(_said("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu-mem", "24GiB"))
    assert text.count("assumed") == 1 and text.count("989.4 TFLOP/s") == 1
    assert ("the work at 989.4 TFLOP/s dense bf16 (assumed: an H100/H200 SXM's, the card is not known; "
            "--gpu NAME sets it)") in text
    named = "\n".join(_said("--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "a100"))
    assert "assumed" not in named and "312 TFLOP/s dense bf16 (the A100 80GB's)" in named
    assert _json("--model", "llama3-8b", "--gpu-mem", "24GiB")["cluster"]["peak_assumed"] is True


@pytest.mark.parametrize("args,env,message", [
    (["--gpu", "a10g"], {}, "--gpu='a10g': not a GPU meshrun plan knows (hint: one of h100, h100-pcie, h100-nvl, "
                            "h200, h200-nvl, a100, a100-40gb, a10, l4, l40s, rtx4090;"),
    (["--gpu", ""], {}, "--gpu='': not a GPU meshrun plan knows"),
    ([], {"MESHRUN_GPU": "b300"}, "env MESHRUN_GPU='b300': not a GPU meshrun plan knows"),
    (["--gpu", "a100", "--precision", "fp8"], {},
     "--precision='fp8': the A100 80GB has no float8 matmuls (they need compute capability 8.9 or newer"),
    (["--gpu", "a10", "--precision", "fp8-rowwise"], {}, "--precision='fp8-rowwise': the A10 has no float8 matmuls"),
])
def test_a_card_that_cannot_be_planned_is_refused_in_one_line(args, env, message):
    out = meshrun_here("plan", "--model", "llama3-8b", *args, env=env or None)
    assert out.returncode == 2, out.stdout
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("card", ["h100", "h200", "l4", "rtx4090", None])
def test_fp8_steps_are_shorter_than_bf16s_on_a_card_with_float8(card):
    """The float8 layers' matmuls at the card's float8 peak: every layout fp8 plans takes a
    shorter step~ than in bf16; the footnote names fp8 and its peak; the ZeRO rows left out
    are said to be, with why."""
    where = ["--gpu", card] if card else ["--gpu-mem", "80GiB"]
    args = ["--model", "llama3-8b", "--gpus-per-node", "8", "--micro-batch", "1", *where]
    bf16, fp8 = (_json(*args, "--precision", p) for p in ("bf16", "fp8"))
    plain = {c["strategy"]: c for c in bf16["candidates"]}
    assert len(fp8["candidates"]) >= 4
    for c in fp8["candidates"]:
        assert c["engine"] == "torch", c["strategy"]
        assert c["step_time_s"] < plain[c["strategy"]]["step_time_s"], c["strategy"]
    said = _said(*args, "--precision", "fp8")
    peak = CARDS[card or "h100"].fp8_tflops
    assert any(line.startswith("fp8: the float8 matmuls (") and f"at {peak:g} TFLOP/s dense x 70% of bf16's "
               "efficiency (measured: 1.31x bf16 on Llama-3-8B's blocks, one H200)" in line for line in said), said
    assert ("fp8: no DeepSpeed (zero*) or tensor-parallel rows: meshrun train refuses float8 with DeepSpeed's engine "
            "and with --tp (its sharded linear layers are not converted)") in said
    assert not any("dense bf16" in line and "fp8" in line for line in said)


def test_fp8_speedup_follows_the_measured_8b_run():
    """Llama-3-8B's shape, FSDP2 full shard, full checkpointing, seq 8192, micro-batch 2 on 2 x
    H200 (torch 2.11, torchao 0.18; docs/benchmarks.md#float8-training): fp8 trained 1.32x the
    tokens/s of bf16 with Liger's eager kernels; at 1B, 1.09x compiled bf16's. The planner,
    which counts compiled and eager bf16 alike, falls between the two; rowwise (1.06x on the
    same blocks) between bf16 and fp8."""
    def step(precision: str) -> float:
        plan = make_plan(PRESETS["llama3-8b"], ClusterSpec(1, 2, 141 * GiB, card=CARDS["h200"]),
                         TrainSpec(8192, 2, 4, precision=precision, activation_checkpointing="full"))
        return next(x for x in plan.candidates if x.strategy.label == "fsdp-full+ac").step_time_s

    bf16, fp8, rowwise = step("bf16"), step("fp8"), step("fp8-rowwise")
    assert 1.09 < bf16 / fp8 < 1.32
    assert fp8 < rowwise < bf16


@pytest.mark.parametrize("model,small,large,label,measured", [
    ("gpt-124m", 64, 128, "ddp", 1.050),  # 64K -> 128K tokens
    ("gpt-1.3b", 16, 32, "fsdp-full", 1.084),  # 16K -> 32K tokens
])
def test_a_doubled_micro_batch_gains_what_it_gained_measured(model, small, large, label, measured):
    """tokens/s of a micro-batch twice as large, no accumulation, 4 x H200, torch 2.11
    (docs/benchmarks/strategy-choice_4xH200_2026-11-26.md): the planner's within 3 points,
    from the width-scaled matmul efficiency T / (T + 5.4M / width)."""
    rate = []
    for micro in (small, large):
        plan = make_plan(PRESETS[model], ClusterSpec(1, 4, 10**4 * GiB, card=CARDS["h200"]),
                         TrainSpec(1024, micro, None, activation_checkpointing="none"))
        c = next(x for x in plan.candidates if x.strategy.label == label)
        rate.append(c.batch.global_batch / c.step_time_s)
    assert rate[1] / rate[0] == pytest.approx(measured, abs=0.03)


def test_train_decides_with_the_card_plan_plans_for():
    """`meshrun train` on a card asks the run policy with that card's peaks, as `meshrun plan
    --gpu` plans: the same strategy and micro-batch."""
    require("torch")
    import torch

    from meshrun.config import TrainConfig, validate
    from meshrun.training.models.gpt import gpt
    from meshrun.training.parallel.auto import decide

    cfg = validate(TrainConfig(model_size="gpt-350m"))
    with torch.device("meta"):
        live = gpt("gpt-350m", cfg.seq, head_loss=True, fused_mlp="auto")
    d = _json("--model", "gpt-350m", "--gpus-per-node", "4", "--gpu", "l4")
    choice = decide(live, cfg, 4, 4, 4, 24 * GiB, True, card=CARDS["l4"])
    r = d["recommended"]
    assert (r["strategy"], r["micro_batch"]) == (choice.strategy, choice.micro_batch)
    assert d["run"]["strategy"] == choice.strategy
