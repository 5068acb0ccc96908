"""Evaluate every candidate and pick the first, in the flowchart's order, that fits."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MeshrunError
from .batch import Batch, check_divisible, micro_choices, solve
from .memory import Memory, Strategy, estimate
from .modelspec import ModelSpec
from .spec import ClusterSpec, TrainSpec, validate_cluster, validate_train
from .strategies import ENGINES, candidates, comm_bytes, model_parallel
from .units import fmt_bytes

ASSUMED_MFU = 0.50  # FSDP2's compute efficiency for the step-time estimate (meshrun measured 44-58%, 50.6% in
# the layouts benchmark that layout_efficiency is relative to)
PCIE_BW = 25e9  # host <-> GPU bytes/s per GPU, for offload
CPU_ADAM_BW = 10e9  # bytes of optimizer state per second a CPU Adam streams per GPU
# torch's fused AdamW on an H200: 2.5 ms for GPT 124M, 26 ms for GPT 1.3B (profiled, docs/benchmarks.md),
# once per optimizer step over the parameters this GPU updates: what makes accumulation pay for DDP.
OPTIMIZER_S_PER_PARAM = 2.0e-11


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    batch: Batch | None
    memory: Memory | None
    fits: bool
    why_not: str = ""
    comm_bytes: float = 0.0
    step_time_s: float = 0.0

    def to_dict(self) -> dict:
        s = self.strategy
        out = {"strategy": s.label, "engine": s.engine, "activation_checkpointing": s.ac,
               "dp": s.dp, "tp": s.tp, "pp": s.pp, "fits": self.fits}
        if self.batch:
            out.update(micro_batch=self.batch.micro, accumulation=self.batch.accum,
                       global_batch=self.batch.global_batch)
        if self.memory:
            out.update(peak_bytes=self.memory.peak, allocator_peak_bytes=self.memory.allocator_peak,
                       breakdown=dict(self.memory.breakdown), cpu_bytes_per_node=self.memory.cpu_bytes_per_node)
        out.update(comm_bytes_per_step=int(self.comm_bytes), step_time_s=round(self.step_time_s, 4))
        if self.why_not:
            out["why_not"] = self.why_not
        return out


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    framework: str
    margin: float
    candidates: list[Candidate]
    recommended: Candidate | None
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        m, c = self.model, self.cluster
        return {
            "model": {"name": m.name, "params": m.params, "layers": m.layers, "hidden": m.hidden,
                      "vocab": m.vocab, "block_params": m.block_params, "source": m.source},
            "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu_mem_bytes": c.gpu_mem,
                        "cpu_mem_bytes_per_node": c.cpu_mem, "sources": dict(c.sources)},
            "train": {"seq_len": self.train.seq_len, "precision": self.train.precision,
                      "optimizer": self.train.optimizer, "compile": self.train.compile},
            "framework": self.framework, "margin": self.margin,
            "candidates": [x.to_dict() for x in self.candidates],
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "reasons": self.reasons, "warnings": self.warnings,
        }


def layout_efficiency(s: Strategy) -> float:
    """Measured throughput of a layout relative to FSDP2 on the same GPUs (calibration.json,
    from the issue-8 benchmark: tensor parallelism's smaller matmuls and blocking all-reduces,
    ZeRO-3's eager parameter fetches, pipeline losses beyond the bubble). Measured at GPT 1.3B:
    a wider model loses less to TP; unmeasured layouts count as 1."""
    from .memory import calibration

    eff = calibration().get("layout_efficiency", {})
    out = 1.0
    if s.tp > 1:
        out *= eff.get(f"tp{min(s.tp, 4)}", 1.0)
    if s.pp > 1:
        out *= eff.get("pp", 1.0)
    if s.engine == "deepspeed" and not s.offload_optimizer:
        out *= eff.get({"grads": "zero2", "params": "zero3"}.get(s.shard, ""), 1.0)
    if s.cp > 1:
        out *= eff.get("cp", 1.0)
    return out


def work_efficiency() -> float:
    """ASSUMED_MFU in the units of the work the kernels do: the measurement behind it (GPT
    1.3B, 1024 tokens) counted attention whole, as MFU does; causal kernels did half of that
    part, so the same run used this share of the peak on real work (0.482)."""
    from .modelspec import PRESETS

    ref = PRESETS["gpt-1.3b"]
    return ASSUMED_MFU * ref.work_flops_per_token(1024) / ref.flops_per_token(1024)


def step_time(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, b: Batch, comm: float) -> float:
    """Compute at ASSUMED_MFU times the layout's measured efficiency (+1/3 recompute with AC,
    + the 1F1B bubble), plus the part of the data-parallel and TP traffic that backward
    cannot hide (assumed 80% overlap; TP's blocking all-reduces are in its measured
    efficiency), plus FSDP2's fixed cost per micro-step, plus the optimizer step over this
    GPU's share of the parameters (or offload's PCIe and CPU-Adam time)."""
    tokens = b.micro * b.accum * t.seq_len  # per data-parallel replica, which spans tp x pp x cp GPUs
    flops = m.work_flops_per_token(t.seq_len) * tokens / (s.tp * s.pp * s.cp) * (4 / 3 if s.ac else 1)
    compute = flops / (c.gpu_flops * work_efficiency() * layout_efficiency(s))
    if s.pp > 1:  # the 1F1B bubble: meshrun cuts each micro-batch into pp pieces (--pp-microbatches)
        compute *= 1 + (s.pp - 1) / (max(1, b.accum) * s.pp)
    if s.engine == "torch" and s.shard != "none":  # FSDP2's fixed cost per micro-step (calibration.json)
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
    return tried  # type: ignore[return-value]  # micros is never empty here


TWINS = {"ddp": "fsdp-grad-op", "fsdp-grad-op": "ddp"}


def fitting_twin(pick: Candidate, cands: list[Candidate]) -> Candidate | None:
    """The other of DDP / FSDP2 grad_op, when it fits with the same batch and checkpointing."""
    if pick.strategy.name not in TWINS:
        return None
    return next((x for x in cands if x.strategy.name == TWINS[pick.strategy.name]
                 and x.strategy.ac == pick.strategy.ac and x.fits and x.batch == pick.batch), None)


def _faster_twin(pick: Candidate | None, cands: list[Candidate]) -> Candidate | None:
    """DDP or FSDP2 grad_op, whichever the step-time estimate says is faster when both fit
    with the same batch: the guide leaves this choice to measurement, and the measurements
    go both ways (GPT 1.3B on 4 x H200: FSDP2 2.3% faster without accumulation, its
    optimizer step sharded; DDP 2.9% faster with 4-step accumulation, its one-graph model
    running no FSDP hooks). The flowchart's order stands on a near-tie (within 1%)."""
    if pick is None:
        return pick
    twin = fitting_twin(pick, cands)
    if twin is not None and twin.step_time_s < 0.99 * pick.step_time_s:
        return twin
    return pick


def make_plan(m: ModelSpec, c: ClusterSpec, t: TrainSpec, framework: str = "torch", margin: float = 0.1) -> Plan:
    validate_cluster(c)
    validate_train(t, m.max_seq)
    m = m.at_seq(t.seq_len)
    limit = c.gpu_mem * (1 - margin)
    if t.global_batch is not None:  # refuse a batch no data-parallel layout can split
        if t.micro_batch is not None:
            solve(t.global_batch, t.micro_batch, c.world)
        elif (err := check_divisible(t.global_batch, c.world)) is not None:
            raise err
    cands = [_evaluate(m, c, t, s, limit) for s in candidates(m, c, t)]
    if not any(x.fits and not x.strategy.offload_optimizer for x in cands):
        cands += [_evaluate(m, c, t, s, limit) for s in model_parallel(m, c)]
    engines = ENGINES[framework]
    pick = _faster_twin(next((x for x in cands if x.fits and x.strategy.engine in engines), None), cands)
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
    return Plan(m, c, t, framework, margin, cands, pick, reasons_for(m, c, t, cands, pick, limit),
                warnings + warnings_for(m, c, t, cands, pick))
