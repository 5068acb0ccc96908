"""`--strategy auto` on GPUs: ask the planner which strategy meshrun's trainer should use."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import ClusterSpec, ModelSpec, TrainSpec, make_plan
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


TRAINER = {"single": ("single", None), "ddp": ("ddp", None), "fsdp-grad-op": ("fsdp", "grad_op"),
           "fsdp-full": ("fsdp", "full"), "fsdp-hybrid": ("fsdp", "hybrid")}


def decide(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> Decision:
    """The planner's first fitting torch strategy that meshrun's trainer runs (data parallel;
    TP and PP are not in the trainer); when none fits, the one with the smallest predicted
    peak, flagged, so the run can say so before it starts."""
    plan = make_plan(model, cluster, train, framework="torch")
    ours = [x for x in plan.candidates if x.strategy.name in TRAINER and x.memory is not None]
    pick = next((x for x in ours if x.fits), None)
    fits = pick is not None
    if pick is None:
        pick = min(ours, key=lambda x: x.memory.peak)  # type: ignore[union-attr]
    strategy, fsdp = TRAINER[pick.strategy.name]
    peak = fmt_bytes(pick.memory.peak) if pick.memory else "?"
    usable = fmt_bytes(cluster.gpu_mem * (1 - plan.margin))
    reason = (f"planner: {pick.strategy.label} predicted {peak} per GPU of {usable} usable"
              if fits else f"planner: nothing fits; {pick.strategy.label} needs the least, {peak} of {usable}")
    return Decision(strategy, fsdp, pick.strategy.ac, reason, fits)


def for_trainer(model, cfg: TrainConfig, world: int, local_world: int, gpu_mem: int, bf16: bool) -> Decision:
    """The decision for a live model and a TrainConfig. Activation checkpointing is the
    planner's to choose only when the user did not set it (a flag or config key)."""
    spec = from_module(model, type(model).__name__, "the model")
    cluster = ClusterSpec(nodes=max(1, world // max(1, local_world)), gpus_per_node=max(1, local_world),
                          gpu_mem=gpu_mem)
    ac_set = "activation_checkpointing" in cfg.sources
    train = TrainSpec(seq_len=cfg.seq_len, micro_batch=cfg.micro, global_batch=cfg.global_batch,
                      precision="bf16" if bf16 else "fp32", compile=cfg.compile,
                      activation_checkpointing=cfg.activation_checkpointing if ac_set else None)
    d = decide(spec, cluster, train)
    if d.activation_checkpointing and not ac_set:
        return Decision(d.strategy, d.fsdp, True, d.reason + "; activation checkpointing on to fit", d.fits)
    return d
