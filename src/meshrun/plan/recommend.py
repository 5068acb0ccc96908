"""Evaluate every candidate, in the flowchart's order, and pick one (``choose``)."""

from __future__ import annotations

from dataclasses import replace

from ..errors import MeshrunError, bad_value
from ..modelinfo.spec import ModelSpec
from ..units import fmt_bytes, fmt_count, fmt_seconds
from ..vocab import Engine
from .adapters import check as check_adapters
from .adapters import of as adapters_of
from .batch import check_divisible, micro_choices, solve
from .candidate import Candidate, Plan, fitting_twin
from .memory import Strategy, estimate
from .spec import ClusterSpec, TrainSpec, validate_cluster, validate_train
from .steptime import step_parts
from .strategies import ENGINES, candidates, comm_bytes, model_parallel, sharded_on_one_rank


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
        time = step_parts(m, c, t, s, batch, comm)
        if inter:  # the hybrid replicas' all-reduce across nodes, after backward
            time = replace(time, communication=time.communication + inter / c.inter_bw)
        why = ""
        if mem.peak > limit:
            why = f"needs {fmt_bytes(mem.peak)} of {fmt_bytes(limit)} usable"
        elif c.cpu_mem is not None and mem.cpu_bytes_per_node > 0.9 * c.cpu_mem:
            why = (f"offload needs {fmt_bytes(mem.cpu_bytes_per_node)} of CPU memory per node, of "
                   f"{fmt_bytes(c.cpu_mem)} there")
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


def seconds_per_token(c: Candidate, seq_len: int) -> float:
    """The step-time estimate per token of the step's global batch."""
    return c.step_time_s / ((c.batch.global_batch if c.batch else 1) * seq_len)


def by_step_time(t: TrainSpec) -> bool:
    """Whether ``choose`` takes the shortest step~ (the planner sizes the micro-batch for a
    global batch, the same in every row) or the first row that fits in the flowchart's order
    (the micro-batch given)."""
    return t.micro_batch is None and t.global_batch is not None


def one_process_first(fitting: list[Candidate]) -> list[Candidate]:
    """On one GPU the one process wherever it fits: FSDP2 on one rank (``sharded_on_one_rank``)
    is for a model whose one-process states and autocast's weight copies do not fit, and takes
    part only where the one process does not fit with the same checkpointing. Where both fit the
    step-time estimate has no say between them: its FSDP2 cost per micro-step was measured over
    several ranks, and the one process is what meshrun's measured one-GPU defaults ran
    (docs/decisions.md#strategy). Against the one process with checkpointing, FSDP2 without it
    is weighed by the estimate (the recomputation's third more compute, measured, against
    FSDP2's cost)."""
    single = {(x.strategy.ac, x.strategy.sac) for x in fitting if x.strategy.kind.one_process}
    return [x for x in fitting if not (sharded_on_one_rank(x.strategy) and (x.strategy.ac, x.strategy.sac) in single)]


def choose(cands: list[Candidate], t: TrainSpec) -> Candidate | None:
    """The pick among fitting candidates (in the flowchart's order): with the micro-batch the
    planner's to size (``by_step_time``), the shortest step per token, which counts each
    micro-batch's matmul efficiency (``compute_time``), the flowchart's order breaking near-ties
    (within 1%): a sharded strategy that fits twice DDP's micro-batch is faster
    (docs/decisions.md#micro-batch), and one that needs activation checkpointing for a bigger
    micro-batch pays a third more compute for it. With the micro-batch fixed, the first that
    fits, DDP and FSDP2 grad_op swapped when the estimate says the other is faster
    (``_faster_twin``). On one GPU, either way, FSDP2 on the one rank only where the one
    process does not fit with the same checkpointing (``one_process_first``). The optimizer's
    state offloaded to the host only where nothing else fits: the guide's last resort, whose
    cost the estimate knows only roughly (PCIe's and the host's speed). docs/decisions.md#strategy"""
    fitting = one_process_first([x for x in cands if x.fits])
    fitting = [x for x in fitting if not x.strategy.offload_optimizer] or fitting
    if not fitting:
        return None
    if by_step_time(t):
        cost = [seconds_per_token(x, t.seq_len) for x in fitting]
        return next(x for x, c in zip(fitting, cost) if c <= min(cost) * 1.01)
    return _faster_twin(fitting[0], cands)


def passed_over(cands: list[Candidate], pick: Candidate | None, engines: tuple[Engine, ...],
                framework: str) -> list[str]:
    """The row of another engine than --framework's whose step~ is shorter than the pick's,
    when there is one (the pick's own rule, which the table states, covers the others)."""
    if pick is None or pick.batch is None or pick.strategy.engine not in engines:
        return []
    faster = [x for x in cands if x.fits and x.batch is not None and x.step_time_s < 0.99 * pick.step_time_s
              and x.strategy.engine not in engines]
    if not faster:
        return []
    best = min(faster, key=lambda x: x.step_time_s)
    return [f"{best.strategy.label} ({best.strategy.engine}) shows {fmt_seconds(best.step_time_s)}; "
            f"not a --framework {framework} strategy (--framework any weighs it)"]


def float8_layouts(t: TrainSpec, layouts: list[Strategy]) -> list[Strategy]:
    """The layouts meshrun train runs float8 on: its own engine, no tensor parallelism
    (config/sections.py refuses the others: ``FLOAT8_LEFT_OUT``)."""
    if not t.float8:
        return layouts
    return [s for s in layouts if s.engine is Engine.TORCH and s.tp == 1]


def adapter_layouts(t: TrainSpec, layouts: list[Strategy]) -> list[Strategy]:
    """The layouts a LoRA run is planned on: data-parallel ones (DDP, FSDP2, ZeRO, offload),
    whose every rank holds whole adapted layers; no tensor, pipeline, context or expert
    parallelism."""
    if t.adapters is None:
        return layouts
    return [s for s in layouts if s.data_parallel_only]


def what_trains(m: ModelSpec, t: TrainSpec) -> str:
    """The plan's line on a LoRA run: what trains and how the frozen weights are kept."""
    lo = adapters_of(m, t.adapters)
    if lo is None:
        return ""
    wide = 2 if t.dtype == "bf16" else 4
    stored = fmt_bytes(lo.frozen_bytes(m.params, False, wide))
    dtype = "bf16" if wide == 2 else "fp32"
    kept = f"the adapted layers' weights in NF4, 4.13 bits a weight; the rest {dtype}" if lo.spec.nf4 else dtype
    total = m.params + lo.params
    return (f"LoRA rank {lo.rank} on {', '.join(lo.kinds)} ({len(lo.block) * lo.layers + len(lo.outer)} layers): "
            f"{fmt_count(lo.params)} of {fmt_count(total)} parameters ({100 * lo.params / total:.2f}%) train, with "
            f"gradients and optimizer state; the {fmt_count(m.params)} frozen take {stored} ({kept}), without; "
            "planned on data-parallel layouts only (no TP x PP, context or expert parallelism)")


FLOAT8_LEFT_OUT = ("no DeepSpeed (zero*) or tensor-parallel rows: meshrun train refuses float8 with DeepSpeed's "
                   "engine and with --tp (its sharded linear layers are not converted)")


def check_inputs(m: ModelSpec, c: ClusterSpec, t: TrainSpec) -> None:
    """Every refusal the settings decide alone, without the model's trace: `meshrun plan`
    makes them before it traces the model (seconds on the CPU)."""
    validate_cluster(c)
    validate_train(t, m.max_seq)
    if t.adapters is not None:
        check_adapters(t.adapters, m)
    if t.float8 and c.gpu_fp8_flops is None and c.card is not None:
        raise bad_value("--precision", t.precision, f"the {c.card.title} has no float8 matmuls (they need compute "
                        "capability 8.9 or newer, as meshrun train does)",
                        "--precision bf16, or plan for a card that has them: --gpu h100, h200, l4, l40s, rtx4090")
    if t.global_batch is not None:  # refuse a batch no data-parallel layout can split
        if t.micro_batch is not None:
            solve(t.global_batch, t.micro_batch, c.world)
        elif (err := check_divisible(t.global_batch, c.world)) is not None:
            raise err


def make_plan(m: ModelSpec, c: ClusterSpec, t: TrainSpec, framework: str = "torch", margin: float = 0.1) -> Plan:
    check_inputs(m, c, t)
    m = m.at_seq(t.seq_len)
    limit = c.gpu_mem * (1 - margin)
    cands = [_evaluate(m, c, t, s, limit) for s in adapter_layouts(t, float8_layouts(t, candidates(m, c, t)))]
    if not any(x.fits and not x.strategy.offload_optimizer for x in cands):
        cands += [_evaluate(m, c, t, s, limit) for s in adapter_layouts(t, float8_layouts(t, model_parallel(m, c)))]
    engines = ENGINES[framework]
    pick = choose([x for x in cands if x.strategy.engine in engines], t)
    warnings: list[str] = []
    if pick is None:  # by the same rule among every engine's
        pick = choose(cands, t)
        if pick is not None:
            warnings.append(f"nothing {framework} runs fits; {pick.strategy.label} ({pick.strategy.engine}) does")
    from .advice import checkpointing_pays, fused_loss_advice, reasons_for, warnings_for

    if not m.fused_loss:  # what a chunked loss would change (modelled in eager mode only)
        from dataclasses import replace

        alt = make_plan(replace(m, fused_loss=True), c, t, framework, margin)
        warnings += fused_loss_advice(m, t, pick, alt.recommended)
    reasons = reasons_for(m, c, t, cands, pick, limit)
    notes = passed_over(cands, pick, engines, framework) + checkpointing_pays(m, cands, pick, t, engines)
    if t.float8:
        notes.append(f"{t.precision}: {FLOAT8_LEFT_OUT}")
    if t.adapters is not None:  # (after the model's line)
        reasons.insert(1, what_trains(m, t))
    reasons[-1:-1] = notes  # (before the "recommended:" line)
    return Plan(m, c, t, framework, margin, cands, pick, reasons,
                warnings + warnings_for(m, c, t, cands, pick))
