"""The SkyPilot document's flowchart as sentences, and its common-mistakes table as warnings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..errors import bad_value
from ..modelinfo.spec import ModelSpec
from ..units import fmt_bytes, fmt_count, fmt_seconds
from ..vocab import Engine
from .candidate import Candidate, fitting_twin
from .memory import Strategy
from .spec import ClusterSpec, TrainSpec


def replica(s: Strategy) -> bool:
    """A full replica per GPU (one process, DDP)."""
    return s.shard == "none" and s.data_parallel_only


def sharded(s: Strategy, shard: str) -> bool:
    """The data-parallel ranks shard ``shard`` (grads: ZeRO-2 / FSDP2 grad_op; params: ZeRO-3 /
    FSDP2 full shard) over all of them, on the GPUs, with no other parallelism."""
    return s.shard == shard and s.data_parallel_only and not s.offload_optimizer and not s.kind.hybrid


def _first(cands: list[Candidate], pred: Callable[[Strategy], bool], ac: bool | None = False) -> Candidate | None:
    """The first candidate whose strategy is ``pred``'s (without checkpointing unless ac says
    otherwise; with it when only checkpointed ones were planned)."""
    found = next((x for x in cands if pred(x.strategy) and (ac is None or x.strategy.ac == ac)), None)
    return found or next((x for x in cands if pred(x.strategy)), None)


def _peak(x: Candidate | None) -> str:
    return fmt_bytes(x.memory.peak) if x and x.memory else "?"


def reasons_for(m: ModelSpec, c: ClusterSpec, t: TrainSpec, cands: list[Candidate], pick: Candidate | None,
                limit: float) -> list[str]:
    """Walk the flowchart: does a replica fit? with sharded optimizer and gradients? with
    everything sharded? with activation checkpointing? with offload? with TP x PP?"""
    out = [f"{m.name}: {fmt_count(m.params)} parameters; usable per GPU {fmt_bytes(limit)} "
           f"({fmt_bytes(c.gpu_mem)} less the safety margin)"]
    base = _first(cands, replica)
    zero2 = _first(cands, lambda s: sharded(s, "grads"))
    zero3 = _first(cands, lambda s: sharded(s, "params"))
    steps = [("a full replica per GPU (DDP)", base), ("sharded optimizer and gradients (ZeRO-2 / FSDP grad_op)", zero2),
             ("everything sharded (ZeRO-3 / FSDP full shard)", zero3)]
    for what, x in steps:
        if x is None:
            continue
        verdict = "fits" if x.fits else "does not fit"
        out.append(f"{what}: {_peak(x)} per GPU -> {verdict}")
        if x.fits:
            break
    if pick is None:
        out.append("nothing fits: more GPUs, a shorter sequence, a smaller micro-batch, or a smaller model")
        return out
    s = pick.strategy
    plain = without_checkpointing(pick, cands)
    if s.ac and (plain is None or not plain.fits):  # (else the +ac line says why it is checkpointed)
        more = "1/2" if t.adapters is not None else "1/3"  # of a LoRA step's 4 FLOPs per weight, of a full one's 6
        out.append(f"with activation checkpointing (each block recomputed in backward, about {more} more compute): "
                   f"{s.label} {_peak(pick)} per GPU -> fits")
    if s.offload_optimizer and s.engine is Engine.TORCH:
        out.append("CPU offload, the last resort the guide names: AdamW's moments in host memory cross PCIe "
                   "twice a step (counted in step~), the update stays on the GPU")
    elif s.offload_optimizer:
        out.append("CPU offload: the last resort the guide names; expect a 2-5x slower step")
    if s.tp * s.pp > 1:
        out.append(f"tensor x pipeline parallelism: TP={s.tp} within a node, PP={s.pp}, DP={s.dp}")
    twin = fitting_twin(pick, cands)
    if twin is not None:
        out.append(f"{s.label} over {twin.strategy.label}: about {fmt_seconds(pick.step_time_s)} vs "
                   f"{fmt_seconds(twin.step_time_s)} "
                   "per step (FSDP2 shards the optimizer step; DDP's one graph runs no FSDP hooks and accumulation "
                   "spreads its optimizer step; docs/benchmarks.md)")
    b = pick.batch
    if b is not None:
        out.append(f"batch: global {b.global_batch} = micro-batch {b.micro} x accumulation {b.accum} "
                   f"x data-parallel {b.dp}")
    out.append(f"recommended: {s.label} ({s.engine}), {_peak(pick)} per GPU, "
               f"about {fmt_seconds(pick.step_time_s)} per step (estimate)")
    return out


def without_checkpointing(x: Candidate, cands: list[Candidate]) -> Candidate | None:
    """The same layout as ``x`` without activation checkpointing, when planned."""
    if not x.strategy.ac:
        return None
    plain = replace(x.strategy, ac=False)
    return next((y for y in cands if y.strategy == plain), None)


def checkpointing_pays(m: ModelSpec, cands: list[Candidate], pick: Candidate | None, t: TrainSpec,
                       engines: tuple[Engine, ...]) -> list[str]:
    """Why a layout with activation checkpointing can take a shorter step than the same layout
    without, though it recomputes each block's forward: the memory it frees fits a larger
    micro-batch, whose matmuls run closer to their best, and whose fewer micro-steps
    communicate (FSDP2 and ZeRO gather parameters or reduce gradients in each) and pay FSDP2's
    fixed cost fewer times. Said of the pick when it is such a row, else of the row gaining
    most; nothing when no row does."""
    pairs: list[tuple[Candidate, Candidate]] = []
    for x in cands:
        plain = without_checkpointing(x, cands)
        if (x.fits and x.strategy.engine in engines and plain is not None and plain.fits
                and x.step_time_s < 0.99 * plain.step_time_s):
            pairs.append((x, plain))
    if not pairs:
        return []
    ac, plain = next(((x, y) for x, y in pairs if x is pick),
                     max(pairs, key=lambda xy: xy[1].step_time_s / xy[0].step_time_s))
    if ac.batch is None or plain.batch is None or ac.step is None or plain.step is None:
        return []
    from .steptime import matmul_efficiency

    a, b = ac.step, plain.step
    fewer = []
    if a.communication < 0.95 * b.communication:
        fewer.append(f"communicate (unhidden: {_seconds(a.communication)} against {_seconds(b.communication)})")
    if a.fsdp < 0.95 * b.fsdp:
        fewer.append(f"pay FSDP2's fixed cost ({_seconds(a.fsdp)} against {_seconds(b.fsdp)})")
    steps = f", so {plain.batch.accum / ac.batch.accum:g}x fewer micro-steps " + " and ".join(fewer) if fewer else ""
    mine, theirs = (matmul_efficiency(x.batch.micro * t.seq_len / x.strategy.cp, m.hidden) for x in (ac, plain)
                    if x.batch)
    return [f"+ac: {ac.strategy.label} takes {fmt_seconds(ac.step_time_s)} against {plain.strategy.label}'s "
            f"{fmt_seconds(plain.step_time_s)}: checkpointing frees the memory for micro-batch {ac.batch.micro} "
            f"instead of {plain.batch.micro}{steps}; compute {fmt_seconds(a.compute)} against "
            f"{fmt_seconds(b.compute)}: each block's forward recomputed (+1/3), on matmuls at {mine:.0%} of their best "
            f"instead of {theirs:.0%}"]


def _seconds(s: float) -> str:
    return fmt_seconds(s) if s > 0 else "none"


def warnings_for(m: ModelSpec, c: ClusterSpec, t: TrainSpec, cands: list[Candidate],
                 pick: Candidate | None) -> list[str]:
    out = []
    if c.nodes > 1 and c.inter_bw < 20e9:
        out.append("multi-node over ordinary Ethernet: inter-node traffic will bound the step "
                   "(SkyPilot: network_tier: best; elsewhere InfiniBand/EFA)")
    if pick is not None and pick.strategy.offload_optimizer and c.cpu_mem is None and pick.memory:
        out.append(f"offload needs {fmt_bytes(pick.memory.cpu_bytes_per_node)} of CPU memory per node; "
                   "give --cpu-mem to check it")
    base = _first(cands, replica)
    if base is not None and not base.fits and pick is not None:
        out.append("a full replica does not fit: FSDP NO_SHARD or plain DDP would run out of memory; shard instead")
    return out


def _per_sequence(c: Candidate) -> float:
    return c.step_time_s / (c.batch.global_batch if c.batch else 1)


def _pace(c: Candidate) -> str:
    n = c.batch.global_batch if c.batch else 1
    return f"about {fmt_seconds(c.step_time_s)} per step of {n} sequence{'s' if n != 1 else ''}"


def fused_loss_advice(m: ModelSpec, t: TrainSpec, pick: Candidate | None, fused: Candidate | None) -> list[str]:
    """One line when a chunked linear + cross-entropy (the logits never whole) would make a
    different, faster layout fit: at long sequences the loss's logits are most of the memory."""
    if fused is None or fused.memory is None:
        return []
    # per sequence: with only a micro-batch given, a layout's global batch is micro x its
    # data-parallel degree, so a context-parallel step trains fewer sequences than FSDP's
    if pick is not None and (pick.strategy.label == fused.strategy.label
                             or _per_sequence(pick) < 1.01 * _per_sequence(fused)):  # (a tie gains nothing)
        return []
    from dataclasses import replace

    from .memory import logits_bytes

    micro = fused.batch.micro if fused.batch else (t.micro_batch or 1)
    plain = logits_bytes(m, t, fused.strategy, micro)
    chunk = logits_bytes(replace(m, fused_loss=True), t, fused.strategy, micro)
    now = f"instead of {pick.strategy.label} ({_pace(pick)})" if pick else "where nothing fits now"
    return [f"the loss's logits take {fmt_bytes(plain)} per GPU: a chunked linear + cross-entropy that never holds "
            f"them whole (meshrun train --fused-loss for its GPT; Liger-Kernel's for Hugging Face models) would let "
            f"{fused.strategy.label} fit ({_peak(fused)} per GPU, {_pace(fused)}) {now}; "
            f"the loss then holds {fmt_bytes(chunk)} (one chunk of tokens)"]


def verdict(name: str, cands: list[Candidate], pick: Candidate | None) -> str:
    """The line ``meshrun plan --strategy NAME`` always prints: does it fit, with what, how
    fast, and how it stands against the recommendation."""
    mine = named(name, cands)
    if mine.memory is None or mine.batch is None:
        return f"--strategy {name}: no batch to run it with ({mine.why_not})"
    said = (f"--strategy {name}: {'fits' if mine.fits else 'does not fit'}, {_peak(mine)} per GPU at micro-batch "
            f"{mine.batch.micro} x accumulation {mine.batch.accum}, about {fmt_seconds(mine.step_time_s)} per step")
    if pick is None:
        return said + "; nothing fits"
    if pick is mine:
        return said + "; it is the recommendation"
    return (said + f"; the recommendation, {pick.strategy.label}, needs {_peak(pick)} and about "
            f"{fmt_seconds(pick.step_time_s)}")


def named(name: str, cands: list[Candidate]) -> Candidate:
    """The candidate ``--strategy NAME`` names; an unknown name is an error listing the
    names there are. The names depend on the cluster's shape, not on memory figures: a plan
    of the untraced model refuses a wrong name before the trace (seconds on a large model)."""
    mine = next((x for x in cands if x.strategy.label == name), None)
    if mine is None:
        names = list(dict.fromkeys(x.strategy.label for x in cands))
        raise bad_value("--strategy", name, "not a strategy of this plan", f"one of {', '.join(names)}")
    return mine


def check_choice(name: str, cands: list[Candidate], pick: Candidate | None) -> list[str]:
    """Warnings for a strategy the user chose (``meshrun plan --strategy``); a name that is
    not in the table is an error listing the names that are."""
    mine = named(name, cands)
    out = []
    if not mine.fits:
        out.append(f"--strategy {name}: {mine.why_not}")
    zero2 = _first(cands, lambda s: sharded(s, "grads"), ac=None)
    if mine.strategy.offload_optimizer and zero2 is not None and zero2.fits:
        out.append(f"--strategy {name}: CPU offload although {zero2.strategy.label} fits on the GPUs "
                   "(start with ZeRO-2; offload is the last resort, 2-5x slower)")
    elif sharded(mine.strategy, "params") and zero2 is not None and zero2.fits and not zero2.strategy.ac:
        out.append(f"--strategy {name}: full sharding although {zero2.strategy.label} fits (it communicates less)")
    if mine.strategy.kind.uses_ddp and mine.strategy.data_parallel_only and not mine.fits:
        out.append("NO_SHARD / DDP does not save memory; use FULL_SHARD (fsdp-full) or ZeRO-3")
    return out
