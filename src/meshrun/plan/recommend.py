"""Evaluate every candidate, in the flowchart's order, and pick one (``choose``)."""

from __future__ import annotations

from ..errors import MeshrunError
from ..modelinfo.spec import ModelSpec
from ..units import fmt_bytes, fmt_seconds
from ..vocab import Engine
from .batch import Batch, check_divisible, micro_choices, solve
from .candidate import Candidate, Plan, fitting_twin
from .memory import Strategy, estimate
from .spec import ClusterSpec, TrainSpec, validate_cluster, validate_train
from .strategies import ENGINES, candidates, comm_bytes, model_parallel

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


def step_time(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, b: Batch, comm: float) -> float:
    """Compute at ASSUMED_MFU times the layout's measured efficiency (+1/3 recompute with AC,
    + the 1F1B bubble), plus the part of the data-parallel and TP traffic that backward
    cannot hide (assumed 80% overlap; TP's blocking all-reduces are in its measured
    efficiency), plus FSDP2's fixed cost per micro-step, plus the optimizer step over this
    GPU's share of the parameters (or offload's PCIe and CPU-Adam time)."""
    tokens = b.micro * b.accum * t.seq_len  # per data-parallel replica, which spans tp x pp x cp GPUs
    # full checkpointing runs each block's forward again (a third more); selective only its cheap,
    # memory-bound operations (assumed 2% more: not yet measured)
    recompute = 4 / 3 if s.ac else 1.02 if s.sac else 1
    flops = m.work_flops_per_token(t.seq_len) * tokens / (s.tp * s.pp * s.cp) * recompute
    compute = flops / (c.gpu_flops * work_efficiency() * layout_efficiency(s))
    if s.pp > 1:  # the 1F1B bubble: meshrun cuts each micro-batch into pp pieces (--pp-microbatches)
        compute *= 1 + (s.pp - 1) / (max(1, b.accum) * s.pp)
    if s.engine is Engine.TORCH and s.shard != "none":  # FSDP2's fixed cost per micro-step (calibration.json)
        from .memory import calibration

        compute += calibration().get("fsdp_microstep_s", 0.0) * max(1, b.accum)
    group = s.shard_group if s.shard != "none" else s.dp
    bw = c.intra_bw if (c.nodes == 1 or group <= c.gpus_per_node) else min(c.intra_bw, c.inter_bw)
    exposed = max(0.0, comm / bw - 0.8 * compute * 2 / 3)
    offload = optimizer = 0.0
    if s.offload_optimizer:
        shard = m.params / s.shard_group
        offload = 4 * shard / PCIE_BW + 16 * shard / CPU_ADAM_BW
    else:
        optimizer = OPTIMIZER_S_PER_PARAM * m.params / (s.tp * s.pp) / (s.shard_group if s.shard != "none" else 1)
    return compute + exposed + offload + optimizer


def _evaluate(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, limit: float) -> Candidate:
    tried: Candidate | None = None
    if t.micro_batch is not None:
        micros = [t.micro_batch]
    else:
        micros = micro_choices(t.global_batch, s.dp)
        if t.max_micro_batch is not None:  # the smallest stays, so a candidate always has one to try
            micros = [x for x in micros if x <= t.max_micro_batch] or micros[-1:]
        if not micros:
            return Candidate(s, None, None, False, f"global batch {t.global_batch} does not split over dp {s.dp}")
    for micro in micros:
        try:
            batch = solve(t.global_batch, micro, s.dp)
        except MeshrunError as exc:
            return Candidate(s, None, None, False, str(exc))
        mem = estimate(m, c, t, s, micro)
        comm, inter = comm_bytes(m, t, s, micro, batch.accum)
        time = step_time(m, c, t, s, batch, comm) + (inter / c.inter_bw if inter else 0.0)
        why = ""
        if mem.peak > limit:
            why = f"needs {fmt_bytes(mem.peak)} of {fmt_bytes(limit)} usable"
        elif c.cpu_mem is not None and mem.cpu_bytes_per_node > 0.9 * c.cpu_mem:
            why = f"offload needs {fmt_bytes(mem.cpu_bytes_per_node)} of CPU memory per node"
        cand = Candidate(s, batch, mem, not why, why, comm + inter, time)
        if cand.fits:
            return cand
        tried = cand  # none fits: report the smallest micro-batch tried
    return tried if tried is not None else Candidate(s, None, None, False, "no micro-batch to try")


def _faster_twin(pick: Candidate | None, cands: list[Candidate]) -> Candidate | None:
    """DDP or FSDP2 grad_op, whichever the step-time estimate says is faster when both fit
    with the same batch: the guide leaves this choice to measurement, and the measurements
    go both ways (FSDP2 faster without accumulation, its optimizer step sharded; DDP faster
    with 4-step accumulation, its one-graph model running no FSDP hooks;
    docs/decisions.md#strategy). The flowchart's order stands on a near-tie (within 1%)."""
    if pick is None:
        return pick
    twin = fitting_twin(pick, cands)
    if twin is not None and twin.step_time_s < 0.99 * pick.step_time_s:
        return twin
    return pick


# Matmul efficiency grows with a micro-batch's tokens and saturates: modelled as T / (T + T0).
# T0 fitted to two measurements of a doubled micro-batch (GPT 124M and GPT 1.3B), rounded to a
# value between the two fits. Past MAX_MICRO_TOKENS a bigger micro-batch only costs memory.
# docs/decisions.md#micro-batch
SATURATION_TOKENS = 4096
MAX_MICRO_TOKENS = 128 * 1024


def seconds_per_token(c: Candidate, seq_len: int) -> float:
    """The step-time estimate per token, slowed by the micro-batch's matmul efficiency."""
    micro_tokens = c.batch.micro * seq_len if c.batch else 1
    tokens = micro_tokens * (c.batch.accum if c.batch else 1)
    return c.step_time_s / tokens * (micro_tokens + SATURATION_TOKENS) / micro_tokens


def choose(cands: list[Candidate], t: TrainSpec) -> Candidate | None:
    """The pick among fitting candidates (in the flowchart's order): with the micro-batch the
    planner's to size (a global batch given, no micro-batch), the fastest per token, the
    flowchart's order breaking near-ties (within 1%): a sharded strategy that fits twice DDP's
    micro-batch is faster (docs/decisions.md#micro-batch), and one that needs activation
    checkpointing for a bigger micro-batch pays a third more compute for it. With the
    micro-batch fixed, the first that fits, DDP and FSDP2 grad_op swapped when the estimate says
    the other is faster (``_faster_twin``). docs/decisions.md#strategy"""
    fitting = [x for x in cands if x.fits]
    if not fitting:
        return None
    if t.micro_batch is None and t.global_batch is not None:
        cost = [seconds_per_token(x, t.seq_len) for x in fitting]
        return next(x for x, c in zip(fitting, cost) if c <= min(cost) * 1.01)
    return _faster_twin(fitting[0], cands)


def passed_over(cands: list[Candidate], pick: Candidate | None, t: TrainSpec, engines: tuple[Engine, ...],
                framework: str) -> list[str]:
    """Why the pick is not the row whose step~ is shortest among those that fit, when it is
    not: of --framework's strategies, then of the others."""
    if pick is None or pick.batch is None:
        return []
    out = []
    faster = [x for x in cands if x.fits and x.batch is not None and x.step_time_s < 0.99 * pick.step_time_s]
    ours = [x for x in faster if x.strategy.engine in engines]
    if ours:
        best = min(ours, key=lambda x: x.step_time_s)
        said = f"{best.strategy.label} shows a shorter step ({fmt_seconds(best.step_time_s)})"
        if t.micro_batch is not None or t.global_batch is None or best.batch is None:
            out.append(f"{said}; with the micro-batch given, the pick is the first that fits in the flowchart's order")
        else:
            mine, theirs = pick.batch.micro * t.seq_len, best.batch.micro * t.seq_len
            out.append(f"{said}, but {pick.strategy.label} is faster per token: micro-batches of {theirs:,} tokens "
                       f"run matmuls at about {theirs / (theirs + SATURATION_TOKENS):.0%} of their best, of "
                       f"{mine:,} at {mine / (mine + SATURATION_TOKENS):.0%} (step~ leaves this out)")
    others = [x for x in faster if x.strategy.engine not in engines]
    if others:
        best = min(others, key=lambda x: x.step_time_s)
        out.append(f"{best.strategy.label} ({best.strategy.engine}) shows {fmt_seconds(best.step_time_s)}; "
                   f"not a --framework {framework} strategy (--framework any weighs it)")
    return out


def float8_layouts(t: TrainSpec, layouts: list[Strategy]) -> list[Strategy]:
    """The layouts meshrun train runs float8 on: its own engine, no tensor parallelism
    (config/sections.py refuses the others)."""
    if not t.float8:
        return layouts
    return [s for s in layouts if s.engine is Engine.TORCH and s.tp == 1]


def check_inputs(m: ModelSpec, c: ClusterSpec, t: TrainSpec) -> None:
    """Every refusal the settings decide alone, without the model's trace: `meshrun plan`
    makes them before it traces the model (seconds on the CPU)."""
    validate_cluster(c)
    validate_train(t, m.max_seq)
    if t.global_batch is not None:  # refuse a batch no data-parallel layout can split
        if t.micro_batch is not None:
            solve(t.global_batch, t.micro_batch, c.world)
        elif (err := check_divisible(t.global_batch, c.world)) is not None:
            raise err


def make_plan(m: ModelSpec, c: ClusterSpec, t: TrainSpec, framework: str = "torch", margin: float = 0.1) -> Plan:
    check_inputs(m, c, t)
    m = m.at_seq(t.seq_len)
    limit = c.gpu_mem * (1 - margin)
    cands = [_evaluate(m, c, t, s, limit) for s in float8_layouts(t, candidates(m, c, t))]
    if not any(x.fits and not x.strategy.offload_optimizer for x in cands):
        cands += [_evaluate(m, c, t, s, limit) for s in float8_layouts(t, model_parallel(m, c))]
    engines = ENGINES[framework]
    pick = choose([x for x in cands if x.strategy.engine in engines], t)
    warnings: list[str] = []
    if pick is None:
        pick = next((x for x in cands if x.fits), None)
        if pick is not None:
            warnings.append(f"nothing {framework} runs fits; {pick.strategy.label} ({pick.strategy.engine}) does")
    from .advice import fused_loss_advice, reasons_for, warnings_for

    if not m.fused_loss:  # what a chunked loss would change (modelled in eager mode only)
        from dataclasses import replace

        alt = make_plan(replace(m, fused_loss=True), c, t, framework, margin)
        warnings += fused_loss_advice(m, t, pick, alt.recommended)
    reasons = reasons_for(m, c, t, cands, pick, limit)
    reasons[-1:-1] = passed_over(cands, pick, t, engines, framework)  # (before the "recommended:" line)
    return Plan(m, c, t, framework, margin, cands, pick, reasons,
                warnings + warnings_for(m, c, t, cands, pick))
