"""The names meshrun's commands share, each defined once: frameworks, training strategies,
activation-checkpointing modes, precisions and meshrun's GPT presets.

Plain data with no imports, so that every layer (the CLI, the planner, the trainer, the
launchers and the job renderers) can take its choices from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# What `meshrun launch -f` starts, and what a rendered job spec's script runs under.
FRAMEWORKS = ("torch", "deepspeed", "accelerate", "jax", "tensorflow")

# Activation checkpointing: none; full, every block's activations recomputed in backward from
# its input; selective, each block keeps its matmuls' and attention's outputs and recomputes the
# cheap operations between them (norms, activations, rotary embeddings).
AC_MODES = ("none", "full", "selective")

# Training precisions: bf16 mixed precision (fp32 master weights), or fp32 throughout.
PRECISIONS = ("bf16", "fp32")
# meshrun train's float8: bf16, with the large linear layers' matmuls in float8 (torchao's
# tensorwise or rowwise scales; training/parallel/float8.py)
FLOAT8_PRECISIONS = ("fp8", "fp8-rowwise")

# Low-rank adapters (--lora RANK): the module kinds --lora-targets names, as the Hugging Face
# families meshrun trains (Llama, Mistral, Qwen2, Gemma) spell their linear layers, or every
# linear layer but the output head; and how the frozen base weights are stored (--quantize:
# as the run computes, or torchao's NF4). training/lora.py and the planner read the same names.
LORA_KINDS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}
LORA_ALL_LINEAR = "all-linear"
QUANTIZE_CHOICES = ("none", "nf4")


def lora_target_matches(target: str, leaf: str) -> bool:
    """Whether a --lora-targets name matches a linear layer by the last part of its path: a kind
    (``q``: ``q_proj``) or the name itself (meshrun's GPT names its MLP's layers ``up`` and ``down``)."""
    return leaf in (LORA_KINDS.get(target, target), target)


class Engine(str, Enum):
    """What runs a strategy: meshrun's own trainer (DDP, FSDP2), DeepSpeed, or Megatron-style
    tensor x pipeline parallelism (a layout the planner estimates). Compares equal to its
    name, which is how configs and JSON spell it."""

    TORCH = "torch"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


@dataclass(frozen=True)
class StrategyKind:
    """One data-parallel strategy, by the name the planner, `meshrun train --strategy` and the
    configs `meshrun plan --write` produces all use.

    ``shard`` is what the data-parallel group shards (the ZeRO paper's stages): ``none``
    (a replica per GPU), ``optimizer`` (ZeRO-1), ``grads`` (ZeRO-2, FSDP2 keeping parameters
    gathered from forward to backward), ``params`` (ZeRO-3, FSDP2 full shard)."""

    name: str
    engine: Engine
    shard: str
    about: str
    fsdp: str | None = None  # FSDP2's flavour: full | grad_op | hybrid | no_shard
    zero: int = 0  # DeepSpeed's ZeRO stage
    offload: str = "none"  # none | optimizer (DeepSpeed's CPU Adam; meshrun's moments on the host) | all (DeepSpeed)
    wrapper: str = "none"  # how meshrun's trainer runs it: none (one process) | ddp | fsdp | deepspeed
    composes: frozenset[str] = frozenset()  # the model-parallel dimensions meshrun train runs it with
    planned: bool = True  # the planner estimates it
    train: bool = True  # a choice of `meshrun train --strategy` (False: a layout only the planner plans)
    runs_as: str | None = None  # a planner-only layout: the --strategy `meshrun train` runs it with
    named_as: str = "{name}"  # a planned layout's name from its degrees (tp, pp, dp) when not the kind's own

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine(self.engine))  # its name as text is taken too

    @property
    def keep_gathered(self) -> bool:
        """FSDP2 reshard_after_forward=False: bf16 parameters live from forward to backward."""
        return self.fsdp == "grad_op"

    @property
    def hybrid(self) -> bool:
        """Sharded within a group (a node), replicated across groups (HSDP)."""
        return self.fsdp == "hybrid"

    @property
    def offload_optimizer(self) -> bool:
        return self.offload != "none"

    @property
    def offload_params(self) -> bool:
        return self.offload == "all"

    @property
    def one_process(self) -> bool:
        return self.wrapper == "none"

    @property
    def uses_ddp(self) -> bool:
        return self.wrapper == "ddp"

    @property
    def uses_fsdp(self) -> bool:
        return self.wrapper == "fsdp"


_ALL_MP = frozenset({"tp", "pp", "cp", "ep"})  # FSDP2 sharding over the data-parallel ranks composes with all
_EP = frozenset({"ep"})  # expert parallelism beside replicated (or hybrid) data parallelism

KINDS: dict[str, StrategyKind] = {k.name: k for k in (
    StrategyKind("single", Engine.TORCH, "none", "one process, one device"),
    StrategyKind("ddp", Engine.TORCH, "none", "DistributedDataParallel: a replica per GPU, gradients all-reduced",
                 wrapper="ddp", composes=_EP),
    StrategyKind("fsdp-grad-op", Engine.TORCH, "grads", "FSDP2, parameters kept gathered from forward to backward "
                 "(ZeRO-2)", fsdp="grad_op", wrapper="fsdp", composes=_ALL_MP),
    StrategyKind("fsdp-full", Engine.TORCH, "params", "FSDP2 full shard (ZeRO-3)", fsdp="full", wrapper="fsdp",
                 composes=_ALL_MP),
    StrategyKind("fsdp-offload", Engine.TORCH, "params", "FSDP2 full shard, AdamW's moments in host memory "
                 "(streamed through the GPU for each step)", fsdp="full", offload="optimizer", wrapper="fsdp",
                 composes=_ALL_MP),
    StrategyKind("fsdp-hybrid", Engine.TORCH, "params", "FSDP2 sharded within a group (a node), replicated across "
                 "groups (HSDP)", fsdp="hybrid", wrapper="fsdp", composes=_EP),
    StrategyKind("fsdp-no-shard", Engine.TORCH, "none", "FSDP2 on a (world, 1) mesh: every rank holds everything "
                 "(DDP's memory, for comparison)", fsdp="no_shard", wrapper="fsdp", composes=_EP, planned=False),
    StrategyKind("zero1", Engine.DEEPSPEED, "optimizer", "DeepSpeed ZeRO-1", zero=1, wrapper="deepspeed"),
    StrategyKind("zero2", Engine.DEEPSPEED, "grads", "DeepSpeed ZeRO-2", zero=2, wrapper="deepspeed"),
    StrategyKind("zero3", Engine.DEEPSPEED, "params", "DeepSpeed ZeRO-3", zero=3, wrapper="deepspeed"),
    StrategyKind("zero2-offload", Engine.DEEPSPEED, "grads", "DeepSpeed ZeRO-2, optimizer on the CPU", zero=2,
                 offload="optimizer", wrapper="deepspeed"),
    StrategyKind("zero3-offload", Engine.DEEPSPEED, "params", "DeepSpeed ZeRO-3, optimizer on the CPU", zero=3,
                 offload="optimizer", wrapper="deepspeed"),
    StrategyKind("zero3-offload-all", Engine.DEEPSPEED, "params", "DeepSpeed ZeRO-3, optimizer and parameters on "
                 "the CPU", zero=3, offload="all", wrapper="deepspeed"),
    # The planner's tensor x pipeline layouts (Megatron-style, a distributed optimizer), named by their
    # degrees; `meshrun train` runs them as FSDP2 full shard with --tp/--pp.
    StrategyKind("megatron", Engine.MEGATRON, "optimizer", "tensor x pipeline x data parallelism", train=False,
                 runs_as="fsdp-full", named_as="tp{tp}-pp{pp}-dp{dp}"),
)}

# What `meshrun train --strategy` takes by name (the planner-only layouts left out).
STRATEGIES: dict[str, StrategyKind] = {n: k for n, k in KINDS.items() if k.train}

# What `meshrun train --strategy` takes besides the strategies themselves: ``auto``, the
# planner's pick on GPUs (DDP on CPU); ``fsdp``, FSDP2 in the flavour the model's size calls
# for (fsdp-grad-op when a bf16 copy of the parameters is small, else fsdp-full).
POLICIES = ("auto", "fsdp")
AUTO, FSDP_POLICY = POLICIES

# The roles strategies play in meshrun's defaults.
ONE_PROCESS = "single"  # a world of one process
ONE_RANK_SHARDED = "fsdp-full"  # one GPU, when the one process's states and autocast's copies do not fit
REPLICATE = "ddp"  # several processes where memory is no constraint (the CPU), and beside expert parallelism
PIPELINE_DEFAULT = "fsdp-full"  # --strategy auto with --pp: FSDP2 over each stage's data-parallel ranks
FSDP_SMALL_MODEL = "fsdp-grad-op"  # --strategy fsdp when a bf16 copy of the parameters is small
FSDP_LARGE_MODEL = "fsdp-full"  # --strategy fsdp otherwise, and on the CPU
CONTEXT_PARALLEL = "fsdp-full"  # the planner's context-parallel layouts (fsdp-full-cpN)
EXPERT_PARALLEL = "ddp"  # the planner's expert-parallel layouts (ddp-epN)
MODEL_PARALLEL = "megatron"  # the planner's tensor x pipeline layouts (tpN-ppN-dpN)
# What `--strategy auto` chooses among on GPUs: the data-parallel strategies of meshrun's own
# trainer that the planner estimates (DeepSpeed's are run when named).
AUTO_CANDIDATES = tuple(n for n, k in STRATEGIES.items() if k.engine is Engine.TORCH and k.planned)
# The planner's data-parallel candidates, least communication and complexity first, then CPU offload.
PLAN_ORDER = ("ddp", "fsdp-grad-op", "zero1", "zero2", "fsdp-hybrid", "fsdp-full", "zero3")
PLAN_OFFLOAD = tuple(n for n, k in STRATEGIES.items() if k.planned and k.offload_optimizer)
# A replica per GPU and FSDP2 keeping the parameters gathered: memory close enough that the
# step-time estimate picks between them (plan/recommend.py), in this order for smaller models.
TWINS = ("ddp", "fsdp-grad-op")


def runs_with(dims: frozenset[str] | set[str]) -> tuple[str, ...]:
    """The --strategy names `meshrun train` runs with all of these model-parallel dimensions."""
    return tuple(sorted(n for n, k in STRATEGIES.items() if dims <= k.composes))


def strategy_hint(dims: frozenset[str] | set[str], policies: bool = True) -> str:
    """``--strategy a, b or c``: the choices that run with ``dims``; every FSDP2 flavour as
    ``fsdp-*`` (which takes in the fsdp policy)."""
    names = list(runs_with(dims))
    flavours = [n for n, k in STRATEGIES.items() if k.uses_fsdp]
    shown = [p for p in POLICIES if policies]
    if set(flavours) <= set(names):
        names = [n for n in names if n not in flavours] + [f"{FSDP_POLICY}-*"]
        shown = [p for p in shown if p != FSDP_POLICY]
    words = [*shown, *names]
    return "--strategy " + (", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0])


# Pipeline schedules (torch.distributed.pipelining): 1F1B, GPipe, interleaved 1F1B (two stages a rank).
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved")
# The Hugging Face families pipeline stages cut (their model_type): a causal LM that is
# embed_tokens -> decoder layers (rotary positions) -> norm -> lm_head and nothing more (no
# embedding scale, no logit cap), under ``model`` and ``lm_head``.
# The linear layers of meshrun's GPT blocks by name (models/gpt.py): attention's, and the MLP's,
# or with experts the router's (the experts themselves are parameter tensors, not layers)
GPT_ATTENTION_LINEARS = ("qkv", "proj")
GPT_MLP_LINEARS = ("up", "down")
GPT_EXPERT_LINEARS = ("router",)
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral"})


@dataclass(frozen=True)
class GPTPreset:
    """meshrun's GPT (learned positions, pre-LayerNorm blocks, a 4x GELU MLP, tied head)."""

    d_model: int
    n_layers: int
    n_heads: int
    context: int  # the sequence length `meshrun train` and `meshrun plan` default to


GPT_PRESETS: dict[str, GPTPreset] = {
    "gpt-tiny": GPTPreset(64, 2, 4, 256),
    "gpt-small": GPTPreset(256, 4, 4, 256),  # the default job's model (bytes of the Python library)
    "gpt-124m": GPTPreset(768, 12, 12, 1024),  # GPT-2 small's shape and context
    "gpt-350m": GPTPreset(1024, 24, 16, 1024),
    "gpt-1.3b": GPTPreset(2048, 24, 16, 1024),
}


# The words a yes/no value may be given as, in a flag's MESHRUN_<NAME> variable or a config file.
YES_WORDS = ("1", "true", "yes", "on")
NO_WORDS = ("0", "false", "no", "off")


def yes_no(text: str) -> bool | None:
    """``text`` as a yes/no word (any case, spaces around it ignored), or None when it is none."""
    word = text.strip().lower()
    return True if word in YES_WORDS else False if word in NO_WORDS else None
