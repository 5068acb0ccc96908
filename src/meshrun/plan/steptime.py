"""The step-time estimate of one candidate (pure): its work at the card's peak and the measured
efficiencies, the communication backward cannot hide, FSDP2's fixed cost per micro-step and
the optimizer step, by part (``StepTime``), as `meshrun plan`'s step~ shows it and the pick
ranks by it (plan/recommend.py)."""

from __future__ import annotations

from ..modelinfo.spec import ModelSpec, attention_flops
from ..vocab import Engine
from . import float8
from .adapters import AdapterLayout
from .adapters import of as adapters_of
from .batch import Batch
from .candidate import StepTime
from .memory import Strategy
from .spec import ClusterSpec, TrainSpec

# FSDP2's compute efficiency for the step-time estimate: as measured in the layouts benchmark
# that layout_efficiency is relative to, and about what meshrun's defaults reach.
# docs/decisions.md#assumed-mfu
ASSUMED_MFU = 0.50
PCIE_BW = 25e9  # host <-> GPU bytes/s per GPU, for offload
CPU_ADAM_BW = 10e9  # bytes of optimizer state per second a CPU Adam streams per GPU
# torch's fused AdamW's time per parameter, profiled at two model sizes
# (docs/decisions.md#optimizer-time), once per optimizer step over the parameters this GPU
# updates: what makes accumulation pay for DDP.
OPTIMIZER_S_PER_PARAM = 2.0e-11
# torchao's NF4 weight dequantized by its eager code (NF4Tensor.get_original_weight, torchao
# 0.18): both nibbles shifted out of the bytes and widened to int64 indices, looked up in the 16
# levels, scaled, interleaved: about 29 bytes read and written per weight (counted from those
# tensors, not measured); compiled, one fused pass reads 0.52 and writes 2.
# docs/decisions.md#lora-plan
NF4_DEQUANT_BYTES = {"eager": 29.0, "compiled": 2.5}
# A LoRA run's share of a full fine-tune's matmul work on its frozen weights: each still runs
# forward (2 FLOPs per weight per token) and passes the gradient to its input (2), but computes
# no gradient of its own (the other 2 of 6).
LORA_FROZEN_SHARE = 2 / 3


def layout_efficiency(s: Strategy) -> float:
    """Measured throughput of a layout relative to FSDP2 on the same GPUs (calibration.json;
    docs/decisions.md#layout-efficiency): tensor parallelism's smaller matmuls and blocking
    all-reduces, ZeRO-3's eager parameter fetches, pipeline losses beyond the bubble. Measured
    at GPT 1.3B: a wider model loses less to TP; unmeasured layouts count as 1."""
    from .memory import calibration

    eff = calibration().get("layout_efficiency", {})
    out = 1.0
    if s.tp > 1:
        out *= eff.get(f"tp{min(s.tp, 4)}", 1.0)
    if s.pp > 1:
        out *= eff.get("pp", 1.0)
    if s.engine is Engine.DEEPSPEED and not s.offload_optimizer:
        out *= eff.get(f"zero{s.kind.zero}", 1.0)  # measured: zero2, zero3
    if s.cp > 1:
        out *= eff.get("cp", 1.0)
    return out


def work_efficiency() -> float:
    """ASSUMED_MFU in the units of the work the kernels do: the measurement behind it (GPT
    1.3B, 1024 tokens) counted attention whole, as MFU does; causal kernels did half of that
    part, so the same run used this share of the peak on real work (0.482)."""
    from ..modelinfo.spec import PRESETS

    ref = PRESETS["gpt-1.3b"]
    return ASSUMED_MFU * ref.work_flops_per_token(1024) / ref.flops_per_token(1024)


# Matmul efficiency grows with a micro-batch's tokens and saturates, the sooner the wider the
# model: modelled as T / (T + T0), T0 = SATURATION_TOKEN_WIDTH / hidden. Fitted to two
# measurements of a doubled micro-batch (GPT 124M, width 768: T0 6.7K tokens; GPT 1.3B, width
# 2048: 2.8K), whose T0 x width agree within 6%; a narrower model takes the narrowest measured
# width's T0 (not extrapolated). Past MAX_MICRO_TOKENS a bigger micro-batch only costs memory.
# docs/decisions.md#micro-batch
SATURATION_TOKEN_WIDTH = 5.4e6
NARROWEST_MEASURED_WIDTH = 768
MAX_MICRO_TOKENS = 128 * 1024
# The model and micro-batch ASSUMED_MFU and the layout efficiencies were measured at (GPT 1.3B,
# width 2048, micro-batch 16 of 1024 tokens): a step's matmuls are as efficient as there at
# that size and width, and faster or slower as their own efficiency is above or below it.
MEASURED_MICRO_TOKENS = 16 * 1024
MEASURED_WIDTH = 2048


def saturation_tokens(hidden: int) -> float:
    """T0: the micro-batch tokens at which matmuls of this width reach half their best."""
    return SATURATION_TOKEN_WIDTH / max(NARROWEST_MEASURED_WIDTH, hidden)


def matmul_efficiency(tokens: float, hidden: int) -> float:
    """The share of their best that a model's matmuls over a micro-batch of ``tokens`` reach."""
    return tokens / (tokens + saturation_tokens(hidden))


def measured_matmul_efficiency() -> float:
    """``matmul_efficiency`` where ASSUMED_MFU was measured (86%)."""
    return matmul_efficiency(MEASURED_MICRO_TOKENS, MEASURED_WIDTH)


def peak_flops(c: ClusterSpec, t: TrainSpec) -> float:
    """The card's peak for the precision the matmuls run in: bf16 (fp8's unconverted ones
    too), or fp32 without tensor cores."""
    return c.gpu_fp32_flops if t.dtype == "fp32" else c.gpu_flops


def compute_time(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, b: Batch) -> float:
    """The step's work at the card's peak (``peak_flops``) x the work efficiency x the layout's
    measured efficiency. The matmuls (6 FLOPs per active parameter per token) are slowed or sped
    by the micro-batch's matmul efficiency against the measured micro-batch's (a mixture of
    experts' counted as dense ones over the micro-batch), the float8 layers' run at the card's
    float8 peak (plan/float8.py); causal attention (6·L·h·s per token) runs as measured; +1/3
    with checkpointing (the recomputed forward), + the 1F1B bubble."""
    tokens = b.micro * b.accum * t.seq_len  # per data-parallel replica, which spans tp x pp x cp GPUs
    attention = attention_flops(m.layers, m.hidden, t.seq_len) / 2  # the causal half the kernels compute
    matmuls = m.work_flops_per_token(t.seq_len) - attention
    converted = 0.0
    if t.float8 and c.gpu_fp8_flops:
        fp8_speed = c.gpu_fp8_flops / c.gpu_flops * float8.matmul_efficiency(t.precision)
        converted = 6 * float8.converted_block_params(m, t.precision) * m.layers
        matmuls += converted / fp8_speed - converted
    slower = measured_matmul_efficiency() / matmul_efficiency(b.micro * t.seq_len / s.cp, m.hidden)
    lo = adapters_of(m, t.adapters)
    # full checkpointing runs each block's forward again (a third of a full fine-tune's work,
    # half of a LoRA run's); selective only its cheap, memory-bound operations (assumed 2% more:
    # not yet measured)
    forward = matmuls / 3  # (what checkpointing runs again)
    if lo is not None:  # the frozen weights' forward and input gradients, the adapters' whole work
        matmuls = matmuls * LORA_FROZEN_SHARE + 6 * lo.params
        forward += 2 * lo.params
    work = matmuls * slower + attention
    forward = forward * slower + attention / 3
    recompute = (work + forward) / work if s.ac else 1.02 if s.sac else 1
    flops = work * tokens / (s.tp * s.pp * s.cp) * recompute
    compute = flops / (peak_flops(c, t) * work_efficiency() * layout_efficiency(s))
    if lo is not None and lo.spec.nf4:
        compute += dequant_time(c, t, s, lo) * max(1, b.accum)
    if s.pp > 1:  # the 1F1B bubble: meshrun cuts each micro-batch into pp pieces (--pp-microbatches)
        compute *= 1 + (s.pp - 1) / (max(1, b.accum) * s.pp)
    return compute


def dequant_time(c: ClusterSpec, t: TrainSpec, s: Strategy, lo: AdapterLayout) -> float:
    """Seconds one micro-step spends dequantizing the NF4 weights: every adapted weight in
    forward and again in backward (torchao's linear keeps the NF4 weight, not the bf16 one),
    once more under full checkpointing, at NF4_DEQUANT_BYTES per weight (eager, or compiled
    with the blocks under meshrun's torch engine) and the card's memory bandwidth (datasheet)."""
    passes = 3 if s.ac else 2
    mode = "compiled" if t.compile and s.engine is Engine.TORCH else "eager"
    return passes * lo.adapted * NF4_DEQUANT_BYTES[mode] / c.gpu_bandwidth


def step_parts(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, b: Batch, comm: float) -> StepTime:
    """Compute (``compute_time``), plus the part of the data-parallel and TP traffic that
    backward cannot hide (assumed 80% overlap; TP's blocking all-reduces are in its measured
    efficiency), plus FSDP2's fixed cost per micro-step, plus the optimizer step over this
    GPU's share of the parameters (or offload's PCIe and CPU-Adam time)."""
    compute = compute_time(m, c, t, s, b)
    fsdp = 0.0
    if s.engine is Engine.TORCH and s.shard != "none":  # FSDP2's fixed cost per micro-step (calibration.json)
        from .memory import calibration

        fsdp = calibration().get("fsdp_microstep_s", 0.0) * max(1, b.accum)
    group = s.shard_group if s.shard != "none" else s.dp
    bw = c.intra_bw if (c.nodes == 1 or group <= c.gpus_per_node) else min(c.intra_bw, c.inter_bw)
    exposed = max(0.0, comm / bw - 0.8 * (compute + fsdp) * 2 / 3)
    lo = adapters_of(m, t.adapters)
    trained = m.params if lo is None else lo.params  # what the optimizer steps over
    if s.offload_optimizer and s.engine is Engine.TORCH:  # the moments across PCIe and back, the step on the GPU
        shard = trained / s.shard_group / (s.tp * s.pp)
        optimizer = 2 * t.optimizer_bytes * shard / PCIE_BW + OPTIMIZER_S_PER_PARAM * shard
    elif s.offload_optimizer:
        shard = trained / s.shard_group
        optimizer = 4 * shard / PCIE_BW + 16 * shard / CPU_ADAM_BW
    else:
        optimizer = OPTIMIZER_S_PER_PARAM * trained / (s.tp * s.pp) / (s.shard_group if s.shard != "none" else 1)
    return StepTime(compute, fsdp, exposed, optimizer)


def step_time(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, b: Batch, comm: float) -> float:
    """The step-time estimate in seconds (``step_parts``' sum)."""
    return step_parts(m, c, t, s, b, comm).total
