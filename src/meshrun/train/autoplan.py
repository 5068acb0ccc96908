"""`--strategy auto` on GPUs: ask the planner which strategy meshrun's trainer should use."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..plan import ClusterSpec, ModelSpec, TrainSpec, make_plan
from ..plan.recommend import Candidate
from ..plan.modelspec import from_module
from ..plan.units import fmt_bytes
from .config import TrainConfig


@dataclass(frozen=True)
class Decision:
    strategy: str  # single | ddp | fsdp
    fsdp: str | None  # full | grad_op | hybrid, for fsdp
    activation_checkpointing: bool
    reason: str
    fits: bool
    micro: int | None = None  # the micro-batch the planner chose, when the user left it to auto


# Matmul efficiency grows with a micro-batch's tokens and saturates: modelled as T / (T + T0).
# T0 fitted to two measurements on H200 (docs/benchmarks.md): GPT 124M 64K -> 128K tokens gave
# +5% (T0 = 6.7K), GPT 1.3B 16K -> 32K gave +8% (T0 = 2.8K). Past MAX_MICRO_TOKENS a bigger
# micro-batch only costs memory.
SATURATION_TOKENS = 4096
MAX_MICRO_TOKENS = 128 * 1024


TRAINER = {"single": ("single", None), "ddp": ("ddp", None), "fsdp-grad-op": ("fsdp", "grad_op"),
           "fsdp-full": ("fsdp", "full"), "fsdp-hybrid": ("fsdp", "hybrid")}


def decide(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> Decision:
    """The planner's first fitting torch strategy that meshrun's trainer runs (data parallel;
    TP and PP are not in the trainer); when none fits, the one with the smallest predicted
    peak, flagged, so the run can say so before it starts.

    With the micro-batch left open (``train.micro_batch`` None, a global batch given) the
    planner sizes each strategy's largest fitting micro-batch (at most ``max_micro_batch``)
    and the fastest by ``seconds_per_token`` wins, the flowchart's order breaking near-ties:
    a sharded strategy that fits twice DDP's micro-batch is faster (measured at GPT 1.3B on 4
    x H200: FSDP2 grad_op at micro-batch 32 beat DDP at 16 by 10%); at the same micro-batch
    DDP wins once accumulation spreads its whole-model optimizer step over several micro-steps
    (1.3B, 32 x 4: +2.9%), FSDP2 without accumulation; one that needs activation
    checkpointing for a bigger micro-batch pays a third more compute for it."""
    plan = make_plan(model, cluster, train, framework="torch")
    ours = [x for x in plan.candidates if x.strategy.name in TRAINER and x.memory is not None]
    fitting = [x for x in ours if x.fits]
    pick = next(iter(fitting), None)
    if train.micro_batch is None and fitting:
        cost = [seconds_per_token(x, train.seq_len) for x in fitting]
        pick = next(x for x, c in zip(fitting, cost) if c <= min(cost) * 1.01)
    fits = pick is not None
    if pick is None:
        pick = min(ours, key=lambda x: x.memory.peak)  # type: ignore[union-attr]
    strategy, fsdp = TRAINER[pick.strategy.name]
    peak = fmt_bytes(pick.memory.peak) if pick.memory else "?"
    usable = fmt_bytes(cluster.gpu_mem * (1 - plan.margin))
    reason = (f"planner: {pick.strategy.label} predicted {peak} per GPU of {usable} usable"
              if fits else f"planner: nothing fits; {pick.strategy.label} needs the least, {peak} of {usable}")
    micro = pick.batch.micro if (train.micro_batch is None and pick.batch) else None
    if micro is not None:
        reason += f", micro-batch {micro} x {pick.batch.accum} accumulation"  # type: ignore[union-attr]
    return Decision(strategy, fsdp, pick.strategy.ac, reason, fits, micro)


def seconds_per_token(c: Candidate, seq_len: int) -> float:
    """The planner's step time per token, slowed by the micro-batch's matmul efficiency."""
    micro_tokens = c.batch.micro * seq_len if c.batch else 1
    tokens = micro_tokens * (c.batch.accum if c.batch else 1)
    return c.step_time_s / tokens * (micro_tokens + SATURATION_TOKENS) / micro_tokens


def for_trainer(model, cfg: TrainConfig, world: int, local_world: int, gpu_mem: int, bf16: bool) -> Decision:
    """The decision for a live model and a TrainConfig. Activation checkpointing is the
    planner's to choose only when the user did not set it (a flag or config key)."""
    spec = from_module(model, type(model).__name__, "the model")
    cluster = ClusterSpec(nodes=max(1, world // max(1, local_world)), gpus_per_node=max(1, local_world),
                          gpu_mem=gpu_mem)
    ac_set = "activation_checkpointing" in cfg.sources
    # The micro-batch is the planner's to choose when the user gave a global batch but no micro-batch.
    open_micro = cfg.micro_batch is None and cfg.global_batch is not None
    train = TrainSpec(seq_len=cfg.seq_len, micro_batch=None if open_micro else cfg.micro,
                      global_batch=cfg.global_batch, max_micro_batch=max(1, MAX_MICRO_TOKENS // cfg.seq_len),
                      precision="bf16" if bf16 else "fp32", compile=cfg.compile,
                      activation_checkpointing=cfg.activation_checkpointing if ac_set else None)
    d = decide(spec, cluster, train)
    if d.activation_checkpointing and not ac_set:
        return replace(d, activation_checkpointing=True, reason=d.reason + "; activation checkpointing on to fit")
    return d
