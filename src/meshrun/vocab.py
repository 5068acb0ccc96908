"""The names meshrun's commands share, each defined once: frameworks, training strategies,
activation-checkpointing modes, precisions and meshrun's GPT presets.

Plain data with no imports, so that every layer (the CLI, the planner, the trainer, the
launchers and the job renderers) can take its choices from here.
"""

from __future__ import annotations

from dataclasses import dataclass

# What `meshrun launch -f` starts, and what a rendered job spec's script runs under.
FRAMEWORKS = ("torch", "deepspeed", "accelerate", "jax", "tensorflow")

# Activation checkpointing: none; full, every block's activations recomputed in backward from
# its input; selective, each block keeps its matmuls' and attention's outputs and recomputes the
# cheap operations between them (norms, activations, rotary embeddings).
AC_MODES = ("none", "full", "selective")

# Training precisions: bf16 mixed precision (fp32 master weights), or fp32 throughout.
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class StrategyKind:
    """One data-parallel strategy, by the name the planner, `meshrun train --strategy` and the
    configs `meshrun plan --write` produces all use.

    ``shard`` is what the data-parallel group shards (the ZeRO paper's stages): ``none``
    (a replica per GPU), ``optimizer`` (ZeRO-1), ``grads`` (ZeRO-2, FSDP2 keeping parameters
    gathered from forward to backward), ``params`` (ZeRO-3, FSDP2 full shard)."""

    name: str
    engine: str  # "torch" (meshrun's own trainer: DDP, FSDP2) or "deepspeed"
    shard: str
    about: str
    fsdp: str | None = None  # FSDP2's flavour: full | grad_op | hybrid | no_shard
    zero: int = 0  # DeepSpeed's ZeRO stage
    offload: str = "none"  # DeepSpeed: none | optimizer | all (optimizer and parameters)


STRATEGIES: dict[str, StrategyKind] = {k.name: k for k in (
    StrategyKind("single", "torch", "none", "one process, one device"),
    StrategyKind("ddp", "torch", "none", "DistributedDataParallel: a replica per GPU, gradients all-reduced"),
    StrategyKind("fsdp-grad-op", "torch", "grads", "FSDP2, parameters kept gathered from forward to backward "
                 "(ZeRO-2)", fsdp="grad_op"),
    StrategyKind("fsdp-full", "torch", "params", "FSDP2 full shard (ZeRO-3)", fsdp="full"),
    StrategyKind("fsdp-hybrid", "torch", "params", "FSDP2 sharded within a group (a node), replicated across "
                 "groups (HSDP)", fsdp="hybrid"),
    StrategyKind("fsdp-no-shard", "torch", "none", "FSDP2 on a (world, 1) mesh: every rank holds everything "
                 "(DDP's memory, for comparison)", fsdp="no_shard"),
    StrategyKind("zero1", "deepspeed", "optimizer", "DeepSpeed ZeRO-1", zero=1),
    StrategyKind("zero2", "deepspeed", "grads", "DeepSpeed ZeRO-2", zero=2),
    StrategyKind("zero3", "deepspeed", "params", "DeepSpeed ZeRO-3", zero=3),
    StrategyKind("zero2-offload", "deepspeed", "grads", "DeepSpeed ZeRO-2, optimizer on the CPU", zero=2,
                 offload="optimizer"),
    StrategyKind("zero3-offload", "deepspeed", "params", "DeepSpeed ZeRO-3, optimizer on the CPU", zero=3,
                 offload="optimizer"),
    StrategyKind("zero3-offload-all", "deepspeed", "params", "DeepSpeed ZeRO-3, optimizer and parameters on "
                 "the CPU", zero=3, offload="all"),
)}

# What `meshrun train --strategy` takes besides the strategies themselves: ``auto``, the
# planner's pick on GPUs (DDP on CPU); ``fsdp``, FSDP2 in the flavour the model's size calls
# for (fsdp-grad-op when a bf16 copy of the parameters is small, else fsdp-full).
POLICIES = ("auto", "fsdp")

# Pipeline schedules (torch.distributed.pipelining): 1F1B, GPipe, interleaved 1F1B (two stages a rank).
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved")


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
