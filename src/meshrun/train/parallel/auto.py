"""What a run gets that the user left to meshrun: its strategy, activation checkpointing,
micro-batch and global batch. One policy for every layout, asked once, before anything is
built; its reasons become the run's first line.

- Composite layouts (``--tp/--pp/--cp``) run FSDP2 over the data-parallel rest; expert
  parallelism (``--ep``) runs beside DDP (or FSDP2 when asked). Their batches are the user's,
  else micro-batch 8 without accumulation.
- On the CPU: one process trains alone (``single``), several with DDP; memory is not the
  constraint there, and the batches are the user's or micro-batch 8 (32 for the toy model).
- On GPUs: the planner's pick (``meshrun plan``'s memory model and step-time estimate over
  the strategies the trainer runs), with activation checkpointing when it is needed to fit
  and the user did not set it. With no batch size given the global batch is
  ``defaults.GLOBAL_BATCH_TOKENS`` of sequences, and with no micro-batch given the planner
  sizes the largest that fits (``plan.recommend.choose``). A strategy the user named is
  planned too, for its micro-batch. docs/decisions.md#strategy
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...defaults import GLOBAL_BATCH_TOKENS, global_batch_for, liger_runs
from ...errors import MeshrunError, bad_value
from ...modelinfo.blocks import find_blocks
from ...modelinfo.read import from_module
from ...plan import ClusterSpec, TrainSpec, make_plan
from ...plan.candidate import Candidate
from ...plan.recommend import MAX_MICRO_TOKENS, choose
from ...units import fmt_bytes
from ...vocab import (
    AUTO_CANDIDATES,
    FLOAT8_PRECISIONS,
    FSDP_LARGE_MODEL,
    FSDP_POLICY,
    FSDP_SMALL_MODEL,
    ONE_PROCESS,
    PIPELINE_DEFAULT,
    REPLICATE,
    STRATEGIES,
    Engine,
    StrategyKind,
)
from ..config import TrainConfig

# FSDP2 keeps the parameters gathered from forward to backward (fsdp-grad-op) when a bf16
# copy of them takes under this share of the GPU: one all-gather per block per step less
# (+5% at GPT 1.3B on 4 x H200, torch 2.11), at the cost of that copy. docs/decisions.md#fsdp-flavour
GATHERED_COPY_SHARE = 0.1


@dataclass(frozen=True)
class Choice:
    kind: StrategyKind  # one of vocab.STRATEGIES
    activation_checkpointing: str  # none | full | selective (vocab.AC_MODES)
    micro_batch: int
    global_batch: int | None  # None: micro-batch x data-parallel ranks
    reasons: tuple[str, ...] = ()  # what was chosen and why, for the run's first line
    compile: bool = False  # torch.compile the model (per block under FSDP2)
    liger: bool = False  # Liger Kernel's kernels patched into a Hugging Face model
    predicted_peak: int | None = None  # the planner's peak bytes per GPU for this choice
    largest_micro: int | None = None  # the largest micro-batch the planner thinks fits

    @property
    def strategy(self) -> str:
        return self.kind.name


def compile_and_kernels(cfg: TrainConfig, cuda: bool, liger: bool) -> tuple[bool, bool, list[str]]:
    """(compile, Liger's kernels, why) for a model Liger Kernel can patch here (``liger``) or
    not. Liger's kernels run eager: with them, compiling adds no speed and costs a minute or
    more of start-up (Llama-3.2-1B, DDP, 2 x H200, torch 2.11: 61,510 tokens/s per GPU eager
    with Liger, 49,468 compiled without), and Liger 0.8.5's RMSNorm kernel does not compile
    under Inductor (a scalar argument made a constant, then ``.to()`` called on it), which
    under DDP's graph split ended the run. So compiling and Liger never go together:
    ``--compile on`` gets torch.compile's own fused kernels instead. docs/decisions.md#liger"""
    compiled = cfg.compiles(cuda)
    if not liger or cfg.kernels != "auto":
        return compiled, False, []
    if liger_runs(cfg.kernels, cfg.compile, cfg.compile_tune, liger):
        why = [] if cfg.compile == "off" else ["eager with Liger Kernel's fused kernels (compiling adds nothing on "
                                               "top of them; --compile on for torch.compile's kernels instead)"]
        return False, True, why
    return True, False, [f"{cfg.source('compile' if cfg.compile == 'on' else 'compile_tune')}: torch.compile's "
                         "own kernels, not Liger Kernel's (they do not compile together)"]


def fsdp_flavour(n_params: int, gpu_mem: int | None) -> tuple[str, str]:
    """(fsdp-grad-op or fsdp-full, why) for ``--strategy fsdp``."""
    if gpu_mem is None:
        return FSDP_LARGE_MODEL, "FSDP2 on the CPU: full shard"
    if 2 * n_params < GATHERED_COPY_SHARE * gpu_mem:
        return FSDP_SMALL_MODEL, f"a bf16 copy of the parameters takes under {GATHERED_COPY_SHARE:.0%} of the GPU"
    return FSDP_LARGE_MODEL, "the parameters are too large to keep gathered"


def decide(model: Any, cfg: TrainConfig, world: int, local_world: int, dp: int, gpu_mem: int | None,
           bf16: bool, liger: bool = False) -> Choice:
    """The choice for ``model`` trained with ``cfg`` on ``world`` processes (``local_world``
    per node) whose data-parallel size is ``dp``; ``gpu_mem`` is one GPU's memory (None on
    the CPU); ``liger``: Liger Kernel can patch the model here. Pure: no process group, no
    device (the model may live on the meta device)."""
    kind = STRATEGIES.get(cfg.strategy)
    if kind is not None and kind.engine is Engine.DEEPSPEED and kind.zero == 3:
        liger = False  # ZeRO-3's partitioned weights take the plain paths (parallel/apply.py): planned so
    compiled, use_liger, why = compile_and_kernels(cfg, gpu_mem is not None, liger)
    choice = _decide(model, cfg, world, local_world, dp, gpu_mem, bf16, compiled, use_liger)
    return dataclasses.replace(choice, compile=compiled, liger=use_liger, reasons=(*choice.reasons, *why))


def _decide(model: Any, cfg: TrainConfig, world: int, local_world: int, dp: int, gpu_mem: int | None,
            bf16: bool, compiled: bool, liger: bool) -> Choice:
    kind = STRATEGIES.get(cfg.strategy)
    if kind is not None and kind.one_process and world > 1:
        raise bad_value(cfg.source("strategy"), cfg.strategy, f"runs one process, but the world has {world}",
                        "use --nproc 1, or --strategy ddp/fsdp")
    ac = cfg.activation_checkpointing
    n_params = sum(p.numel() for p in model.parameters())
    named = cfg.strategy if kind is not None else None
    if cfg.strategy == FSDP_POLICY:
        named, why = fsdp_flavour(n_params, gpu_mem)
        reasons = [f"--strategy fsdp: {named} ({why})"]
    else:
        reasons = []
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or cfg.ep > 1:
        if named is None:  # auto
            if cfg.ep > 1:
                named = REPLICATE
            elif cfg.pp > 1:
                named = PIPELINE_DEFAULT
            else:
                named, why = fsdp_flavour(n_params, gpu_mem)
                reasons.append(f"{named}: {why}")
        return Choice(STRATEGIES[named], ac, cfg.micro, cfg.global_batch, tuple(reasons))
    if gpu_mem is None or find_blocks(model, cfg.blocks) is None:  # the CPU, or nothing the planner can read
        if named is None:
            named = ONE_PROCESS if world == 1 else REPLICATE
            reasons.append("one process" if world == 1 else "DDP: on the CPU memory is not the constraint"
                           if gpu_mem is None else "DDP: the model has no block list for the planner to read")
        return Choice(STRATEGIES[named], ac, cfg.micro, cfg.global_batch, tuple(reasons))
    global_batch = cfg.global_batch
    if cfg.micro_batch is None and global_batch is None:
        global_batch = global_batch_for(cfg.seq, dp)
        reasons.append(f"global batch {global_batch} x {cfg.seq} tokens (about {GLOBAL_BATCH_TOKENS // 1024}K "
                       "tokens, the default on GPUs; set --global-batch or --micro-batch to change it)")
    names = (named,) if named else AUTO_CANDIDATES  # (DeepSpeed's strategies run when named)
    pick, usable, largest = _planned(model, cfg, world, local_world, gpu_mem, bf16, global_batch, names, compiled,
                                     liger,
                                     ac_open=named is None and "activation_checkpointing" not in cfg.sources)
    if pick is None or pick.batch is None:  # a strategy the planner does not plan (fsdp-no-shard)
        named = named or (ONE_PROCESS if world == 1 else REPLICATE)
        return Choice(STRATEGIES[named], ac, cfg.micro, global_batch, tuple(reasons))
    peak = fmt_bytes(pick.memory.peak) if pick.memory else "?"
    if not pick.fits and named is None and cfg.micro_batch is None and "activation_checkpointing" not in cfg.sources:
        # Nothing left to the planner fits: refused here, not out of memory at the first step
        # (Llama-3-8B and Mistral-7B on one H200: 140 and 126 GiB predicted, 138 GiB reached)
        raise MeshrunError(
            f"the model ({n_params / 1e9:.2f}B parameters) does not fit {world} GPU(s) of {fmt_bytes(gpu_mem)}: "
            f"the planner's least, {pick.strategy.name} at micro-batch {pick.batch.micro}"
            f"{' with activation checkpointing' if pick.strategy.ac else ''}, needs {peak} per GPU of "
            f"{fmt_bytes(usable)} usable (hint: more GPUs (--nproc, --nnodes), a shorter "
            "--seq-len, or to try anyway: --strategy, --micro-batch and --activation-checkpointing set by hand)")
    if pick.fits:
        reasons.insert(0, f"planner: {pick.strategy.name} predicted {peak} per GPU of {fmt_bytes(usable)} usable "
                          f"({fmt_bytes(gpu_mem)} less a {1 - usable / gpu_mem:.0%} safety margin)")
    else:
        reasons.insert(0, f"planner: nothing fits; {pick.strategy.name} needs the least, {peak} of "
                          f"{fmt_bytes(usable)} (hint: --activation-checkpointing full, a smaller batch, more GPUs)")
    micro = cfg.micro_batch
    if micro is None:
        micro = pick.batch.micro
        reasons.append(f"micro-batch {micro} x {pick.batch.accum} accumulation (the largest that fits; "
                       "--micro-batch to set it)")
    if pick.strategy.ac and ac != "full":
        reasons.append("activation checkpointing on to fit (--activation-checkpointing none to refuse it)")
        ac = "full"
    return Choice(STRATEGIES[pick.strategy.name], ac, micro, global_batch, tuple(reasons),
                  predicted_peak=pick.memory.peak if pick.memory else None, largest_micro=largest)


def _planned(model: Any, cfg: TrainConfig, world: int, local_world: int, gpu_mem: int, bf16: bool,
             global_batch: int | None, names: tuple[str, ...], compiled: bool, liger: bool,
             ac_open: bool) -> tuple[Candidate | None, float, int | None]:
    """The planner's pick among ``names`` (the smallest predicted peak when none fits), the
    usable bytes per GPU, and the largest micro-batch the pick fits with (None: unknown). With
    ``ac_open`` the planner may turn on checkpointing; ``liger``: the model runs Liger
    Kernel's kernels, traced as they keep tensors."""
    from ..models.hf import is_transformers_model
    from .trace import with_trace  # (torch: imported when a GPU run plans)

    # what the model keeps for backward, traced on the meta device
    spec = with_trace(from_module(model, type(model).__name__, "the model"), model, cfg.seq,
                      ("autocast", "bf16") if bf16 else ("fp32",), cfg.blocks, compiled, liger)
    cluster = ClusterSpec(nodes=max(1, world // max(1, local_world)), gpus_per_node=max(1, local_world),
                          gpu_mem=gpu_mem)
    train = TrainSpec(seq_len=cfg.seq, micro_batch=cfg.micro_batch, global_batch=global_batch,
                      max_micro_batch=max(1, MAX_MICRO_TOKENS // cfg.seq),
                      precision=(cfg.precision if cfg.precision in FLOAT8_PRECISIONS else "bf16") if bf16 else "fp32",
                      compile=compiled, whole_compile=not is_transformers_model(model),
                      activation_checkpointing=None if ac_open else cfg.activation_checkpointing)
    plan = make_plan(spec, cluster, train, framework="any")
    ours = [x for x in plan.candidates if x.strategy.name in names and x.memory is not None]
    usable = gpu_mem * (1 - plan.margin)
    pick = choose(ours, train)
    if pick is None and ours:
        pick = min(ours, key=lambda x: x.memory.peak)  # type: ignore[union-attr]
    largest = None
    if pick is not None and pick.batch is not None and cfg.micro_batch is None and pick.fits:
        largest = pick.batch.micro  # the planner sized it: the largest that fits
    elif pick is not None and cfg.micro_batch is not None:  # the user's: what the planner would have sized
        free = dataclasses.replace(train, micro_batch=None)
        same = [x for x in make_plan(spec, cluster, free, framework="any").candidates
                if x.strategy.name == pick.strategy.name and x.memory is not None]
        alt = choose(same, free)
        largest = alt.batch.micro if alt is not None and alt.batch is not None and alt.fits else None
    return pick, usable, largest
