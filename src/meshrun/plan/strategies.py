"""The candidate strategies, in the order the SkyPilot document's flowchart prefers them: the
least communication and complexity first (DDP; shard the optimizer; also the gradients; also
the parameters), then the same with activation checkpointing, then CPU offload, then tensor x
pipeline parallelism."""

from __future__ import annotations

from dataclasses import replace

from ..modelinfo.spec import ModelSpec
from ..vocab import (
    CONTEXT_PARALLEL,
    EXPERT_PARALLEL,
    KINDS,
    MODEL_PARALLEL,
    ONE_PROCESS,
    ONE_RANK_SHARDED,
    PLAN_OFFLOAD,
    PLAN_ORDER,
    STRATEGIES,
    TWINS,
    Engine,
)
from . import float8
from .adapters import AdapterLayout
from .adapters import of as adapters_of
from .memory import Strategy
from .spec import ClusterSpec, TrainSpec

# What each engine can run; meshrun train runs the torch ones.
ENGINES: dict[str, tuple[Engine, ...]] = {"torch": (Engine.TORCH, Engine.MEGATRON), "deepspeed": (Engine.DEEPSPEED,),
                                          "any": tuple(Engine)}
# From here FSDP2 keeping parameters gathered beat DDP without accumulation even when a
# replica fits (docs/decisions.md#strategy), so it ranks first among torch
# strategies; when both fit, the step-time estimate has the last word (recommend._faster_twin).
FSDP_FIRST_FROM_PARAMS = 1_000_000_000


def named(name: str, dp: int, shard_group: int, ac: bool, sac: bool = False) -> Strategy:
    """A data-parallel strategy of vocab.STRATEGIES over ``dp`` ranks, its states sharded
    over ``shard_group`` of them."""
    return Strategy(STRATEGIES[name], dp, shard_group, ac=ac, sac=sac)


def _dp_family(c: ClusterSpec, ac: bool, m: ModelSpec) -> list[Strategy]:
    w, g = c.world, c.gpus_per_node
    if w == 1:  # one process; FSDP2 on one rank only where it does not fit (recommend.choose)
        return [named(ONE_PROCESS, 1, 1, ac), named(ONE_RANK_SHARDED, 1, 1, ac)]
    order = list(PLAN_ORDER)
    if m.params >= FSDP_FIRST_FROM_PARAMS:  # the twins the other way round
        i, j = (order.index(n) for n in TWINS)
        order[i], order[j] = order[j], order[i]
    out = []
    for name in order:
        kind = STRATEGIES[name]
        if not kind.hybrid:
            out.append(named(name, w, 1 if kind.shard == "none" else w, ac))
        elif c.nodes > 1 and g > 1:  # sharded within a node, replicated across nodes
            out.append(named(name, w, g, ac))
    return out


def sharded_on_one_rank(s: Strategy) -> bool:
    """FSDP2 over a data-parallel group of one rank (one GPU): no communication to save, only
    memory. Its fp32 parameters, gradients and optimizer state are one process's, but the bf16
    weights the matmuls use are gathered one block at a time and freed after it, where one
    process under autocast holds a bf16 copy of every weight from its first use in forward to
    its backward (plan/memory.cast_copies): 2 bytes per parameter less at the peak."""
    return s.kind.uses_fsdp and s.shard_group == 1 and s.dp == 1 and s.data_parallel_only


def _offload(c: ClusterSpec) -> list[Strategy]:
    w = c.world
    return [named(name, w, w, ac) for ac in (False, True)
            for name in PLAN_OFFLOAD]


def _tp_pp(m: ModelSpec, c: ClusterSpec) -> list[Strategy]:
    """TP within a node (it needs NVLink), PP across; fewest model-parallel GPUs first."""
    out = []
    tps = [t for t in (1, 2, 4, 8) if t <= c.gpus_per_node and c.gpus_per_node % t == 0 and m.heads % t == 0
           and m.kv_heads % t == 0 or t == 1]
    for tp in tps:
        pp = 1
        while tp * pp <= c.world:
            if (tp, pp) != (1, 1) and c.world % (tp * pp) == 0 and pp <= m.layers:
                dp = c.world // (tp * pp)
                out.append(Strategy(KINDS[MODEL_PARALLEL], dp, dp, tp=tp, pp=pp, ac=True))
            pp *= 2
    return sorted(out, key=lambda s: (s.tp * s.pp, s.pp))


def candidates(m: ModelSpec, c: ClusterSpec, t: TrainSpec) -> list[Strategy]:
    """Without checkpointing, then with it (full), when the mode is open; else in the mode
    given (selective checkpointing only when asked for)."""
    acs = [False, True] if t.activation_checkpointing is None else [t.activation_checkpointing == "full"]
    out: list[Strategy] = []
    for ac in acs:
        # A mixture of experts: sharding the experts (all-to-all of activations) first; their
        # weights are most of the model and FSDP would gather them all every step.
        out += (expert_parallel(m, c, [ac]) if m.experts else []) + _dp_family(c, ac, m)
    out += [s for s in _offload(c) if t.activation_checkpointing is None or s.ac == acs[0]]
    if t.activation_checkpointing == "selective":
        out = [replace(s, sac=True) for s in out]
    return out


def model_parallel(m: ModelSpec, c: ClusterSpec) -> list[Strategy]:
    """TP x PP x DP combinations and context parallelism (FSDP x CP, for sequences whose
    activations no sharding of the states can make room for): the flowchart's last branch,
    planned only when no data-parallel strategy fits on the GPUs."""
    w = c.world
    cps = [Strategy(STRATEGIES[CONTEXT_PARALLEL], w // cp, w, ac=True, cp=cp)
           for cp in (2, 4, 8, 16) if cp <= w and w % cp == 0]
    return cps + _tp_pp(m, c)


def expert_parallel(m: ModelSpec, c: ClusterSpec, acs: list[bool]) -> list[Strategy]:
    """A mixture of experts: experts over ep ranks, everything else replicated (meshrun
    train --ep); the fewest ep ranks first."""
    w = c.world
    return [Strategy(STRATEGIES[EXPERT_PARALLEL], w, 1, ac=ac, ep=ep)
            for ac in acs for ep in (2, 4, 8, 16, 32, 64) if ep <= w and w % ep == 0 and m.experts % ep == 0]


def comm_bytes(m: ModelSpec, t: TrainSpec, s: Strategy, micro: int, accum: int) -> tuple[float, float]:
    """(bytes each GPU moves per optimizer step inside a node, across nodes), ring collectives:
    an all-reduce of B bytes over n ranks moves 2(n-1)/n·B, all-gather / reduce-scatter (n-1)/n·B."""
    p = m.params / (s.tp * s.pp)
    n = s.shard_group if s.shard != "none" else s.dp
    ring = (n - 1) / n if n > 1 else 0.0
    g = 2 if t.dtype == "bf16" else 4  # bytes of a gathered parameter
    lo = adapters_of(m, t.adapters)
    if lo is not None:
        return adapter_comm(m, t, s, lo, accum)
    if s.engine is Engine.DEEPSPEED:
        vol = {"none": 2 * ring * g * p, "optimizer": ring * 2 * g * p,
               "grads": ring * g * p * accum + ring * g * p,
               "params": ring * 3 * g * p * accum}[s.shard]
    elif s.engine is Engine.MEGATRON:
        vol = 2 * ring * 4 * p  # distributed optimizer: reduce-scatter fp32 grads + all-gather
        tp_ring = 2 * (s.tp - 1) / s.tp
        act = 2 * micro * t.seq_len * m.hidden  # bf16 activation slab
        vol += accum * (m.layers / s.pp) * 4 * tp_ring * act + (accum * 2 * act if s.pp > 1 else 0)
    else:
        # FSDP2 all-gathers tensorwise float8 weights in float8: 1 byte each instead of 2
        gathered = g * p - float8.gathered_saving(m, t.precision, s.tp) * m.layers / s.pp
        vol = {"none": 2 * ring * 4 * p,
               "grads": ring * (gathered * accum + 4 * p),
               "params": ring * (2 * gathered * accum + 4 * p)}[s.shard]
        if s.kind.hybrid and s.dp > s.shard_group:
            reps = s.dp // s.shard_group
            return vol, 2 * (reps - 1) / reps * 4 * p / s.shard_group
    tokens = micro * t.seq_len * accum
    if s.ep > 1:  # dispatch and combine, forward and backward, of each token's top-k copies
        vol += 4 * (s.ep - 1) / s.ep * tokens * m.top_k * m.hidden * g * m.layers
    if s.cp > 1:  # keys and values gathered in forward, their gradients reduced in backward
        vol += 3 * (s.cp - 1) / s.cp * 2 * tokens * m.kv_dim * g * m.layers
    return vol, 0.0


def adapter_comm(m: ModelSpec, t: TrainSpec, s: Strategy, lo: AdapterLayout, accum: int) -> tuple[float, float]:
    """comm_bytes() of a LoRA run: only the adapters have gradients to all-reduce or
    reduce-scatter (and, sharded, updated weights to gather: ZeRO-1/2); FSDP2 and ZeRO-3
    still all-gather every weight each micro-step, the frozen ones as stored (bf16, or NF4)."""
    n = s.shard_group if s.shard != "none" else s.dp
    ring = (n - 1) / n if n > 1 else 0.0
    g = 2 if t.dtype == "bf16" else 4
    a = lo.params
    gathered = lo.frozen_bytes(m.params, False, g) + g * a  # one whole copy, as all-gathered
    if s.engine is Engine.DEEPSPEED:
        vol = {"none": 2 * ring * g * a, "optimizer": ring * 2 * g * a,
               "grads": ring * g * a * accum + ring * g * a,
               "params": ring * (2 * gathered + g * a) * accum}[s.shard]
        return vol, 0.0
    vol = {"none": 2 * ring * 4 * a, "grads": ring * (gathered * accum + 4 * a),
           "params": ring * (2 * gathered * accum + 4 * a)}[s.shard]
    if s.kind.hybrid and s.dp > s.shard_group:
        reps = s.dp // s.shard_group
        return vol, 2 * (reps - 1) / reps * 4 * a / s.shard_group
    return vol, 0.0
