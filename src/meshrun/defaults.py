"""Defaults that `meshrun train` and `meshrun plan` must agree on, each decided here once.

A plan is only as good as its assumptions: if the planner assumed compiled training while the
trainer ran eager, or another sequence length or batch, its memory figures would describe a
different job. Both commands resolve these settings through the functions below. The rules
and the measurements behind them: docs/decisions.md.
"""

from __future__ import annotations

from .vocab import FLOAT8_PRECISIONS

COMPILE_CHOICES = ("auto", "on", "off")
# the built-in GPT's own kernels (Liger's for a Hugging Face model) where they run, or none
KERNELS = ("auto", "plain")

# The global batch a GPU run gets when the user gives no batch size: half a million tokens,
# the batch GPT-3 trained its 125M-350M models with, and what meshrun's throughput
# benchmarks use (512 sequences of 1024 tokens). docs/decisions.md#global-batch
GLOBAL_BATCH_TOKENS = 512 * 1024

# The longest sequence length taken from a model's context by default: a model that allows
# 8K or 128K positions is usually trained shorter first, and activations grow with it.
MAX_DEFAULT_SEQ_LEN = 4096

# Where nothing says otherwise (a model of the user's that states no context).
FALLBACK_SEQ_LEN = 1024


def compile_enabled(choice: str, cuda: bool) -> bool:
    """``auto`` compiles on GPUs, where a minute of compilation pays back within a few dozen
    steps (a compiled step is much faster than an eager one), and stays
    eager on the CPU, where compiling takes longer than the short jobs it would speed up.
    docs/decisions.md#compile"""
    return choice == "on" or (choice == "auto" and cuda)


def compile_choice(choice: str, precision: str) -> str:
    """``--compile`` as a run takes it: ``auto`` is ``on`` for float8 precisions, whose casts
    and scales pay only fused into their neighbours (eager float8 is for debugging); else as
    given."""
    return "on" if choice == "auto" and precision in FLOAT8_PRECISIONS else choice


def liger_runs(kernels: str, compile: str, compile_tune: bool, applies: bool) -> bool:
    """Whether a run patches its model with every Liger Kernel kernel (eager) on a GPU:
    ``--kernels auto``, a model Liger can patch here (``applies``), and ``--compile off``: a
    compiled run takes Liger's fused loss alone (its other kernels do not compile), which
    trained faster than every Liger kernel eager (docs/decisions.md#liger)."""
    return applies and kernels == "auto" and compile == "off" and not compile_tune


def seq_len_for(context: int | None) -> int:
    """The model's context, at most MAX_DEFAULT_SEQ_LEN; FALLBACK_SEQ_LEN when it states none."""
    if not context or context < 1:
        return FALLBACK_SEQ_LEN
    return min(context, MAX_DEFAULT_SEQ_LEN)


def global_batch_for(seq_len: int, dp: int) -> int:
    """GLOBAL_BATCH_TOKENS of sequences, rounded up to a whole number per data-parallel rank."""
    per_rank = -(-GLOBAL_BATCH_TOKENS // (seq_len * dp))
    return max(1, per_rank) * dp


FINISH_TIMEOUT_S = 300  # a rank still running this long after another finished is stopped


# Validation runs the model in eval mode, where a Hugging Face model computes its whole logits
# (Liger's fused loss, which never holds them, is for training only): 8 x 4096 tokens of a
# 128,256-word vocabulary are 25 GiB in bf16 with their fp32 copy: validation became the run's
# peak, far above training's (docs/decisions.md#validation-logits). Such a model is validated in
# micro-batches whose logits stay under this many bytes, reading as many samples as the run's
# micro-batches would.
EVAL_LOGITS_BYTES = 4 * 2**30


def val_micro(micro: int, seq: int | None, vocab: int | None, loss_mode: str) -> int:
    """The validation micro-batch of a run at ``micro``: the same, or smaller for a model
    whose loss is taken from its logits (not meshrun's GPT, whose loss is chunked)."""
    if loss_mode == "targets" or not seq or not vocab:
        return micro
    return max(1, min(micro, EVAL_LOGITS_BYTES // (seq * vocab * 6)))  # bf16 logits and an fp32 copy
