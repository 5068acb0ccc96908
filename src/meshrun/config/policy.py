"""The run policy: what a `meshrun train` run does with what the user left to meshrun, decided
in one place for the ranks (parallel/auto.decide), `meshrun plan` and `meshrun train
--dry-run`: its strategy, activation checkpointing, micro-batch and global batch, whether and
how the model is compiled, whose kernels it runs, its precision, and what is refused.

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
- Compiled on GPUs (``defaults.compile_enabled``; float8 runs too); a Hugging Face model Liger
  Kernel knows takes Liger's fused loss after its compiled blocks (every Liger kernel, eager,
  with ``--compile off``); a Hugging Face model, and every FSDP2 or pipelined layout, is
  compiled block by block (parallel/apply.py). A Hugging Face model Liger does not know gets
  meshrun's tanh GELU and head loss where they apply (kernels/hf.py), its blocks compiled.

Torch-free: what only torch or the machine can tell comes in as plain values: ``Facts`` (the
processes, one GPU's memory, bf16, whether Liger applies, the kind of model) and the model as
a ModelSpec, with a ``Tracer`` the caller gives to trace it for the planner once the compile
and kernel settings are known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..defaults import GLOBAL_BATCH_TOKENS, compile_choice, compile_enabled, global_batch_for, liger_runs
from ..errors import MeshrunError, bad_value
from ..modelinfo.spec import ModelSpec
from ..plan import ClusterSpec, TrainSpec, make_plan
from ..plan.adapters import Adapters
from ..plan.candidate import Candidate
from ..plan.cards import Card
from ..plan.recommend import choose
from ..plan.steptime import MAX_MICRO_TOKENS
from ..units import fmt_bytes
from ..vocab import (
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
from . import TrainConfig

# FSDP2 keeps the parameters gathered from forward to backward (fsdp-grad-op) when a bf16
# copy of them takes under this share of the GPU: one all-gather per block per step less, a
# faster step than full sharding, at the cost of that copy. docs/decisions.md#fsdp2-flavour
GATHERED_COPY_SHARE = 0.1

# What Choice.kernels and Choice.compile_mode say (the dry run's and the plan's words)
# meshrun's own (its GPT's, or kernels/hf.py's), Liger Kernel's, Liger's loss alone, torch's modules only
KERNEL_WORDS = ("meshrun", "liger", "liger-loss", "plain")
COMPILE_WORDS = ("off", "on", "per-block")  # eager, the model in one graph, each block in its own
CHOSEN_BY = ("planner", "rules", "user")  # the planner's memory model, the rules above, the options given

# (compiled, Liger's kernels, Liger's loss only, meshrun's kernels for a Hugging Face model) ->
# the model's spec with what it keeps for backward traced so
Tracer = Callable[[bool, bool, bool, bool], ModelSpec]


@dataclass(frozen=True)
class Facts:
    """What the policy cannot read from the config: where the run goes and what the model is."""

    world: int  # processes in all
    local_world: int  # processes per node
    dp: int  # data-parallel ranks (what --tp/--pp/--cp leave of the world)
    gpu_mem: int | None  # one GPU's bytes; None: the ranks run on the CPU
    bf16: bool  # the run computes in bf16 (asked, or --precision auto on GPUs that have it)
    liger: bool = False  # Liger Kernel can patch the model here (a type it knows, on GPUs, no --tp/--pp)
    # meshrun's tanh GELU or head loss can patch the Hugging Face model here (one Liger does not
    # know, on GPUs, no --tp/--pp: kernels/hf.py hf_kernels_apply)
    hf_kernels: bool = False
    hf: bool = False  # a Hugging Face model: compiled block by block on every layout
    experts: bool = False  # a Mixture-of-Experts model (its config names routed experts)
    blocks: bool = True  # the planner can read the model's block list
    own_kernels: bool = False  # meshrun's GPT, whose own GPU kernels --kernels auto runs
    params: int | None = None  # the live model's parameters, counted (None: the ModelSpec's)
    card: Card | None = None  # the GPU model, whose peaks the step-time estimate uses (None: not known)
    cpu_mem: int | None = None  # a node's host memory, which the optimizer state offloaded to it must fit


@dataclass(frozen=True)
class Choice:
    kind: StrategyKind  # one of vocab.STRATEGIES
    activation_checkpointing: str  # none | full | selective (vocab.AC_MODES)
    micro_batch: int
    global_batch: int | None  # None: micro-batch x data-parallel ranks
    reasons: tuple[str, ...] = ()  # what was chosen and why, for the run's strategy line
    compile: bool = False  # torch.compile the model (per block under FSDP2)
    liger: bool = False  # Liger Kernel's kernels patched into a Hugging Face model (eager)
    liger_loss: bool = False  # Liger's fused linear cross-entropy only (the blocks compiled)
    hf_kernels: bool = False  # meshrun's tanh GELU and head loss patched into a Hugging Face model
    predicted_peak: int | None = None  # the planner's peak bytes per GPU for this choice
    largest_micro: int | None = None  # the largest micro-batch the planner thinks fits
    precision: str = "fp32"  # bf16 | fp32 | fp8 | fp8-rowwise: what the run computes in
    kernels: str = "plain"  # one of KERNEL_WORDS
    compile_mode: str = "off"  # one of COMPILE_WORDS
    accumulation: int = 1  # micro-steps per optimizer step
    strategy_from: str = "rules"  # who chose the strategy: one of CHOSEN_BY
    micro_from: str = "rules"  # who chose the micro-batch: one of CHOSEN_BY

    @property
    def strategy(self) -> str:
        return self.kind.name

    def summary(self) -> dict[str, Any]:
        """The decisions as the dry run's and the plan's JSON keys."""
        return {"strategy": self.strategy, "micro_batch": self.micro_batch, "global_batch": self.global_batch,
                "accumulation": self.accumulation, "activation_checkpointing": self.activation_checkpointing,
                "compile": self.compile_mode, "kernels": self.kernels, "precision": self.precision,
                "strategy_from": self.strategy_from, "micro_batch_from": self.micro_from,
                "reasons": list(self.reasons)}

    def lines(self) -> list[str]:
        """The decisions as the dry run's short block."""
        accumulation = f" x {self.accumulation} accumulation" if self.accumulation > 1 else ""
        batch = "micro-batch x data-parallel ranks" if self.global_batch is None else str(self.global_batch)
        return [f"strategy: {self.strategy} ({self.strategy_from})",
                f"micro-batch: {self.micro_batch}{accumulation} ({self.micro_from})", f"global batch: {batch}",
                f"activation checkpointing: {self.activation_checkpointing}", f"compile: {self.compile_mode}",
                f"kernels: {self.kernels}", f"precision: {self.precision}"]


@dataclass(frozen=True)
class Settings:
    """What the run decides before any planning: compiled, Liger's kernels (and why), meshrun's
    kernels for a Hugging Face model, and the global batch a GPU run gets when no batch size is given."""

    compile: bool
    liger: bool
    why: tuple[str, ...]
    global_batch: int | None
    liger_loss: bool = False  # Liger's fused linear cross-entropy only, the blocks compiled
    hf_kernels: bool = False  # meshrun's tanh GELU and head loss (kernels/hf.py)


class Kernels(NamedTuple):
    """What ``compile_and_kernels`` decides: compiled, Liger's kernels (eager), why, and
    Liger's fused loss alone (with compiled blocks)."""

    compile: bool
    liger: bool
    why: list[str]
    liger_loss: bool = False


def settings(cfg: TrainConfig, facts: Facts) -> Settings:
    """The compile and kernel settings and the default global batch of ``cfg`` on ``facts``:
    what the planner's trace needs before it can run (`meshrun plan` traces with them)."""
    kind = STRATEGIES.get(cfg.strategy)
    zero3 = kind is not None and kind.engine is Engine.DEEPSPEED and kind.zero == 3
    liger = facts.liger and not zero3
    # (ZeRO-3's partitioned weights take the plain paths, parallel/apply.py: planned so)
    k = compile_and_kernels(cfg, facts.gpu_mem is not None, liger, facts.experts)
    hf_kernels = (facts.hf_kernels and not k.liger and not k.liger_loss and not zero3 and cfg.kernels == "auto"
                  and facts.gpu_mem is not None and cfg.tp == 1 and cfg.pp == 1)
    global_batch = cfg.global_batch
    if facts.gpu_mem is not None and cfg.micro_batch is None and global_batch is None:
        global_batch = global_batch_for(cfg.seq, facts.dp)
    return Settings(k.compile, k.liger, tuple(k.why), global_batch, liger_loss=k.liger_loss, hf_kernels=hf_kernels)


def compile_and_kernels(cfg: TrainConfig, cuda: bool, liger: bool, experts: bool = False) -> Kernels:
    """Compiled or not, and which of Liger Kernel's kernels, for a model Liger can patch here
    (``liger``) or not; ``experts``: a Mixture-of-Experts model, which keeps its measured path,
    eager with Liger's kernels, unless compiling is asked for. Liger's kernels run eager: Liger
    0.8.5's RMSNorm kernel does not compile under Inductor (a scalar argument made a constant,
    then ``.to()`` called on it), which under DDP's graph split ended the run. A compiled model
    (``--compile on``, float8) gets torch.compile's kernels in its blocks and Liger's fused
    linear cross-entropy alone for its loss, which runs after the blocks, outside their graphs:
    the vocabulary-wide logits are never held. docs/decisions.md#liger"""
    asked = compile_choice(cfg.compile, cfg.precision)
    compiled = compile_enabled(asked, cuda) or cfg.compile_tune
    if not liger or cfg.kernels != "auto":
        return Kernels(compiled, False, [])
    if cfg.lora is not None and cfg.quantize == "none" and asked == "auto" and cuda:
        # A LoRA step is a third lighter in matmuls, so the adapters' small matmuls and the
        # elementwise work around them weigh more, and compiling fuses them: Llama-3-8B's shape,
        # LoRA rank 16 on every linear layer, 2 x 4,096 tokens on one H200 (torch 2.11): 16,379
        # tokens/s compiled per block against 13,083 eager with Liger, in one call.
        return Kernels(True, False, ["LoRA: compiled per block (+25% over Liger's eager kernels on an 8B model; "
                                     "docs/decisions.md#lora-compile)"])
    if liger_runs(cfg.kernels, asked, cfg.compile_tune, liger):  # --compile off
        return Kernels(False, True, [])
    if not cuda:
        return Kernels(compiled, False, [])
    if experts and asked == "auto" and not cfg.compile_tune:
        # Qwen3-30B-A3B's shape cut to 4 layers trained at 31,144 tokens/s eager with Liger on one
        # H200 (torch 2.11); its routed experts compiled per block were never measured
        return Kernels(False, True, ["a Mixture-of-Experts model: eager with Liger Kernel's kernels (its experts "
                                     "compiled are not measured; --compile on to compile them)"])
    if asked == "auto" and not cfg.compile_tune:
        # Same call, one H200 (torch 2.11, Liger 0.8.5): Llama-3.2-1B 63,285 tokens/s against
        # 59,123 with every Liger kernel eager; Gemma-2-2B 21,926 against 20,370
        why = ("compiled per block, with Liger Kernel's fused linear cross-entropy for the loss (+7% over "
               "Liger's eager kernels; --compile off for those)")
    else:
        why = (f"{cfg.source('compile' if asked == 'on' else 'compile_tune')}: torch.compile's kernels per block, "
               "Liger Kernel's fused linear cross-entropy for the loss")
    return Kernels(True, False, [why], True)


def fsdp_flavour(n_params: int, gpu_mem: int | None, world: int) -> tuple[str, str]:
    """(fsdp-grad-op or fsdp-full, why) for ``--strategy fsdp`` on ``world`` processes."""
    if gpu_mem is None:
        return FSDP_LARGE_MODEL, "FSDP2 on the CPU: full shard"
    if world == 1:  # keeping them gathered holds what autocast's copies hold under single
        return FSDP_LARGE_MODEL, ("one GPU: FSDP2 saves memory there only by freeing each block's bf16 weights "
                                  "after its use")
    if 2 * n_params < GATHERED_COPY_SHARE * gpu_mem:
        return FSDP_SMALL_MODEL, f"a bf16 copy of the parameters takes under {GATHERED_COPY_SHARE:.0%} of the GPU"
    return FSDP_LARGE_MODEL, "the parameters are too large to keep gathered"


def adapters_of(cfg: TrainConfig) -> Adapters | None:
    """The adapters a run of ``cfg`` trains as the planner counts them (None: no --lora)."""
    if cfg.lora is None:
        return None
    from .sections import lora_targets

    return Adapters(int(cfg.lora), lora_targets(cfg), cfg.quantize, float(cfg.lora_dropout))


def resolve(model: ModelSpec | None, cfg: TrainConfig, facts: Facts, traced: Tracer | None = None,
            adapters: Adapters | None = None) -> Choice:
    """What the run of ``cfg`` does on ``facts``: the model's shape ``model`` (None on the CPU,
    where nothing reads it), traced for the planner by ``traced`` (None: the shape's estimate);
    ``adapters``: a LoRA run's (the planner counts the frozen weights without gradients or
    optimizer state; None: ``cfg``'s own, ``adapters_of``). Raises MeshrunError for what the run
    refuses. Pure: no process group, no device."""
    s = settings(cfg, facts)
    choice = _decide(model, cfg, facts, s, traced, adapters if adapters is not None else adapters_of(cfg))
    kind = choice.kind
    zero3 = kind.engine is Engine.DEEPSPEED and kind.zero == 3
    cuda = facts.gpu_mem is not None
    own = cuda and facts.own_kernels and cfg.kernels == "auto" and cfg.tp == 1 and not zero3
    kernels = ("liger" if s.liger else "liger-loss" if s.liger_loss else "meshrun" if own or s.hf_kernels
               else "plain")
    per_block = facts.hf or kind.uses_fsdp or cfg.pp > 1 or cfg.ep > 1
    precision = cfg.precision if cfg.precision != "auto" else "bf16" if facts.bf16 else "fp32"
    micro = choice.micro_batch
    accumulation = 1 if choice.global_batch is None else cfg.replace(
        micro_batch=micro, global_batch=choice.global_batch).accumulation(facts.dp)
    return dataclasses.replace(choice, compile=s.compile, liger=s.liger, liger_loss=s.liger_loss,
                               hf_kernels=s.hf_kernels, reasons=(*choice.reasons, *s.why), precision=precision,
                               kernels=kernels, accumulation=accumulation,
                               compile_mode="off" if not s.compile else "per-block" if per_block else "on")


def _decide(model: ModelSpec | None, cfg: TrainConfig, facts: Facts, s: Settings, traced: Tracer | None,
            adapters: Adapters | None = None) -> Choice:
    kind = STRATEGIES.get(cfg.strategy)
    world, gpu_mem = facts.world, facts.gpu_mem
    if kind is not None and kind.one_process and world > 1:
        raise bad_value(cfg.source("strategy"), cfg.strategy, f"runs one process, but the world has {world}",
                        "use --nproc 1, or --strategy ddp/fsdp")
    ac = cfg.activation_checkpointing
    named = cfg.strategy if kind is not None else None
    strategy_from = "user" if named else "rules"
    micro_from = "rules" if cfg.micro_batch is None else "user"
    reasons = []
    if cfg.strategy == FSDP_POLICY:
        named, why = fsdp_flavour(_params(model, facts), gpu_mem, world)
        reasons.append(f"--strategy fsdp: {named} ({why})")
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or cfg.ep > 1:
        if named is None:  # auto
            if cfg.ep > 1:
                named = REPLICATE
            elif cfg.pp > 1:
                named = PIPELINE_DEFAULT
            else:
                named, why = fsdp_flavour(_params(model, facts), gpu_mem, world)
                reasons.append(f"{named}: {why}")
        return Choice(STRATEGIES[named], ac, cfg.micro_for(facts.dp), cfg.global_batch, tuple(reasons),
                      strategy_from=strategy_from, micro_from=micro_from)
    if gpu_mem is None or not facts.blocks or model is None:  # the CPU, or nothing the planner can read
        if named is None:
            named = ONE_PROCESS if world == 1 else REPLICATE
            reasons.append("one process" if world == 1 else "DDP: on the CPU memory is not the constraint"
                           if gpu_mem is None else "DDP: the model has no block list for the planner to read")
        return Choice(STRATEGIES[named], ac, cfg.micro_for(facts.dp), cfg.global_batch, tuple(reasons),
                      strategy_from=strategy_from, micro_from=micro_from)
    global_batch = s.global_batch
    if cfg.micro_batch is None and cfg.global_batch is None:
        reasons.append(f"global batch {global_batch} x {cfg.seq} tokens (about {GLOBAL_BATCH_TOKENS // 1024}K "
                       "tokens, the default on GPUs; set --global-batch or --micro-batch to change it)")
    names = (named,) if named else AUTO_CANDIDATES  # (DeepSpeed's strategies run when named)
    spec = traced(s.compile, s.liger, s.liger_loss, s.hf_kernels) if traced is not None else model
    pick, usable, largest = _planned(spec, cfg, facts, global_batch, names, s.compile,
                                     ac_open=named is None and "activation_checkpointing" not in cfg.sources,
                                     adapters=adapters)
    if pick is None or pick.batch is None:  # a strategy the planner does not plan (fsdp-no-shard)
        named = named or (ONE_PROCESS if world == 1 else REPLICATE)
        return Choice(STRATEGIES[named], ac, cfg.micro_for(facts.dp), global_batch, tuple(reasons),
                      strategy_from=strategy_from, micro_from=micro_from)
    peak = fmt_bytes(pick.memory.peak) if pick.memory else "?"
    if not pick.fits and named is None and cfg.micro_batch is None and "activation_checkpointing" not in cfg.sources:
        over = not pick.memory or pick.memory.peak > usable  # (else the host's memory refused an offload)
        # Nothing left to the planner fits: refused here, not out of memory at the first step
        # (models predicted over the usable memory ran out of it: docs/decisions.md#oom-fallback)
        raise MeshrunError(
            f"the model ({_params(model, facts) / 1e9:.2f}B parameters) does not fit {world} GPU(s) of "
            f"{fmt_bytes(gpu_mem)}: "
            f"the planner's least, {pick.strategy.name} at micro-batch {pick.batch.micro}"
            f"{' with activation checkpointing' if pick.strategy.ac else ''}, "
            f"{f'needs {peak} per GPU of {fmt_bytes(usable)} usable' if over else pick.why_not}"
            f" (hint: more GPUs (--nproc, --nnodes), a shorter "
            f"--seq-len, or to try anyway: --strategy {pick.strategy.kind.name} --micro-batch {pick.batch.micro} "
            f"--activation-checkpointing {'full' if pick.strategy.ac else 'none'})")
    if pick.fits:
        reasons.insert(0, f"planner: {pick.strategy.name} predicted {peak} per GPU of {fmt_bytes(usable)} usable "
                          f"({fmt_bytes(gpu_mem)} less a {1 - usable / gpu_mem:.0%} safety margin)")
    else:
        reasons.insert(0, f"planner: nothing fits; {pick.strategy.name} needs the least, {peak} of "
                          f"{fmt_bytes(usable)} (hint: --activation-checkpointing full, a smaller batch, more GPUs)")
    micro = cfg.micro_batch
    if named is None:
        strategy_from = "planner"
    if micro is None:
        micro, micro_from = pick.batch.micro, "planner"
        reasons.append(f"micro-batch {micro} x {pick.batch.accum} accumulation (the largest that fits; "
                       "--micro-batch to set it)")
    if pick.strategy.ac and ac != "full":
        reasons.append("activation checkpointing on to fit (--activation-checkpointing none to refuse it)")
        ac = "full"
    if pick.strategy.offload_optimizer and pick.memory:
        host = (f"of the node's {fmt_bytes(facts.cpu_mem)}" if facts.cpu_mem is not None
                else "(the nodes' memory not known here: not checked)")
        reasons.append(f"the optimizer state offloaded: {fmt_bytes(pick.memory.cpu_bytes_per_node)} of host memory "
                       f"per node {host}")
    return Choice(STRATEGIES[pick.strategy.name], ac, micro, global_batch, tuple(reasons),
                  predicted_peak=pick.memory.peak if pick.memory else None, largest_micro=largest,
                  strategy_from=strategy_from, micro_from=micro_from)


def _params(model: ModelSpec | None, facts: Facts) -> int:
    """The model's parameters, where a GPU's memory makes them matter (the CPU reads none)."""
    if facts.params is not None:
        return facts.params
    if model is None:
        if facts.gpu_mem is not None:
            raise MeshrunError("the run policy needs the model's shape to decide for GPUs (hint: pass its ModelSpec)")
        return 0
    return model.params


def _planned(spec: ModelSpec, cfg: TrainConfig, facts: Facts, global_batch: int | None, names: tuple[str, ...],
             compiled: bool, ac_open: bool,
             adapters: Adapters | None = None) -> tuple[Candidate | None, float, int | None]:
    """The planner's pick among ``names`` (the smallest predicted peak when none fits), the
    usable bytes per GPU, and the largest micro-batch the pick fits with (None: unknown). With
    ``ac_open`` the planner may turn on checkpointing; with ``adapters``, planned as that LoRA run."""
    gpu_mem = facts.gpu_mem or 0
    cluster = ClusterSpec(nodes=max(1, facts.world // max(1, facts.local_world)),
                          gpus_per_node=max(1, facts.local_world), gpu_mem=gpu_mem, card=facts.card,
                          cpu_mem=facts.cpu_mem)
    bf16 = cfg.precision in FLOAT8_PRECISIONS or facts.bf16
    train = TrainSpec(seq_len=cfg.seq, micro_batch=cfg.micro_batch, global_batch=global_batch,
                      max_micro_batch=max(1, MAX_MICRO_TOKENS // cfg.seq),
                      precision=(cfg.precision if cfg.precision in FLOAT8_PRECISIONS else "bf16") if bf16 else "fp32",
                      compile=compiled, whole_compile=not facts.hf, adapters=adapters,
                      activation_checkpointing=None if ac_open else cfg.activation_checkpointing)
    plan = make_plan(spec, cluster, train, framework="any")
    ours = [x for x in plan.candidates if x.strategy.name in names and x.memory is not None]
    usable = gpu_mem * (1 - plan.margin)
    pick = choose(ours, train)
    if pick is None and ours:
        pick = min(ours, key=lambda x: x.memory.peak if x.memory else 0)
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
