"""A planned candidate (one strategy at one batch, its memory and time) and the plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..modelinfo.spec import ModelSpec
from ..vocab import TWINS as PAIR
from .batch import Batch
from .memory import Memory, Strategy
from .spec import ClusterSpec, TrainSpec


@dataclass(frozen=True)
class StepTime:
    """An optimizer step's estimated seconds, by what they are spent on (plan/steptime.py)."""

    compute: float  # the work at the card's peak x the efficiencies (recomputation and bubble included)
    fsdp: float = 0.0  # FSDP2's fixed cost per micro-step
    communication: float = 0.0  # what backward does not hide, and the hybrid replicas' all-reduce
    optimizer: float = 0.0  # the optimizer step over this GPU's parameters, or offload's PCIe and CPU Adam

    @property
    def total(self) -> float:
        return self.compute + self.fsdp + self.communication + self.optimizer


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    batch: Batch | None
    memory: Memory | None
    fits: bool
    why_not: str = ""
    comm_bytes: float = 0.0
    step: StepTime | None = None

    @property
    def step_time_s(self) -> float:
        return self.step.total if self.step is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        s = self.strategy
        out: dict[str, Any] = {"strategy": s.label, "engine": s.engine,
               "activation_checkpointing": "full" if s.ac else "selective" if s.sac else "none",
               "dp": s.dp, "tp": s.tp, "pp": s.pp, "fits": self.fits}
        if self.batch:
            out.update(micro_batch=self.batch.micro, accumulation=self.batch.accum,
                       global_batch=self.batch.global_batch)
        if self.memory:
            out.update(peak_bytes=self.memory.peak, allocator_peak_bytes=self.memory.allocator_peak,
                       breakdown=dict(self.memory.breakdown), cpu_bytes_per_node=self.memory.cpu_bytes_per_node)
        out.update(comm_bytes_per_step=int(self.comm_bytes), step_time_s=round(self.step_time_s, 4))
        if self.step is not None:
            out["step_time_parts_s"] = {k: round(v, 4) for k, v in vars(self.step).items()}
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

    def to_dict(self) -> dict[str, Any]:
        m, c = self.model, self.cluster
        return {
            "model": {"name": m.name, "params": m.params, "layers": m.layers, "hidden": m.hidden,
                      "vocab": m.vocab, "block_params": m.block_params, "source": m.source},
            "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu_mem_bytes": c.gpu_mem,
                        "cpu_mem_bytes_per_node": c.cpu_mem, "gpu": c.card.name if c.card else None,
                        "peak_flops": {"bf16": c.gpu_flops, "fp8": c.gpu_fp8_flops, "fp32": c.gpu_fp32_flops},
                        "peak_assumed": c.card is None, "sources": dict(c.sources)},
            "train": {"seq_len": self.train.seq_len, "precision": self.train.precision,
                      "optimizer": self.train.optimizer, "compile": self.train.compile, "lora": self.lora()},
            "framework": self.framework, "margin": self.margin,
            "candidates": [x.to_dict() for x in self.candidates],
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "reasons": self.reasons, "warnings": self.warnings,
        }


    def lora(self) -> dict[str, Any] | None:
        """What a LoRA plan trains (None: every parameter): the adapters' settings and counts."""
        from .adapters import of

        lo = of(self.model, self.train.adapters)
        if lo is None:
            return None
        wide = 2 if self.train.dtype == "bf16" else 4
        return {"rank": lo.rank, "targets": list(lo.spec.targets), "quantize": lo.spec.quantize,
                "dropout": lo.spec.dropout, "adapted_layers": lo.kinds, "adapted_count": len(lo.block) * lo.layers
                + len(lo.outer), "adapter_params": lo.params, "frozen_params": self.model.params,
                "frozen_bytes": int(lo.frozen_bytes(self.model.params, False, wide))}


TWINS = dict(zip(PAIR, reversed(PAIR)))  # each of vocab.TWINS to the other


def fitting_twin(pick: Candidate, cands: list[Candidate]) -> Candidate | None:
    """The other of DDP / FSDP2 grad_op, when it fits with the same batch and checkpointing."""
    if pick.strategy.name not in TWINS:
        return None
    return next((x for x in cands if x.strategy.name == TWINS[pick.strategy.name]
                 and x.strategy.ac == pick.strategy.ac and x.fits and x.batch == pick.batch), None)
