"""What ``--precision fp8`` changes in a step's memory, from the model's shape (pure).

meshrun train converts the linear layers torchao's rule picks (training/parallel/float8.py;
docs/decisions.md#float8) and never the head or embeddings. This module applies the same rule
to the shape's block matrices (attention's q, k, v, o and the MLP's two or three; a mixture of
experts keeps its experts in bf16: they are not linear layers) so the planner counts:

* the float8 copies a converted matmul casts: its input's and its weight's, and in backward
  their transposes: 1 byte an element, one layer's at a time (a transient);
* the weights FSDP2 gathers: the converted ones in float8 under ``fp8`` (1 byte instead of
  bf16's 2), all in bf16 under ``fp8-rowwise``;
* the scales: one fp32 scale per cast tensor (tensorwise) or per row (rowwise). torchao's
  recipes scale dynamically from the tensor in hand: there is no amax history to hold.

The master weights, gradients and optimizer state stay as ``bf16`` keeps them."""

from __future__ import annotations

from ..modelinfo.spec import ModelSpec
from ..vocab import FLOAT8_PRECISIONS


def converts(n: int, k: int, precision: str) -> bool:
    """torchao's rule (0.13-0.18, ``_auto_filter_for_recipe``, from its H100 measurements) for
    a linear layer of weight N x K: both dimensions multiples of 16, and large enough to gain."""
    if n % 16 or k % 16:
        return False
    if precision == "fp8":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def block_matrices(m: ModelSpec) -> list[tuple[int, int]]:
    """(N, K) of each linear weight in one block: as the built module has them, else from the
    shape."""
    if m.linears is not None:
        return list(m.linears)
    h, kv = m.hidden, m.kv_dim
    attention = [(h, h), (kv, h), (kv, h), (h, h)]
    if m.experts:
        return attention
    mlp = [(m.ffn, h), (m.ffn, h), (h, m.ffn)] if m.gated_mlp else [(m.ffn, h), (h, m.ffn)]
    return attention + mlp


def converted(m: ModelSpec, precision: str) -> list[tuple[int, int]]:
    """The block's matrices that compute in float8 (none unless ``precision`` is a float8 one)."""
    if precision not in FLOAT8_PRECISIONS:
        return []
    return [(n, k) for n, k in block_matrices(m) if converts(n, k, precision)]


def converted_block_params(m: ModelSpec, precision: str) -> int:
    return sum(n * k for n, k in converted(m, precision))


def cast_bytes(m: ModelSpec, precision: str, tokens: float, tp: int = 1) -> int:
    """One block's float8 casts alive at once in its backward: each converted weight and its
    transpose, the inputs and the incoming gradients of its largest matmul and their
    transposes, 1 byte an element, and their scales."""
    mats = converted(m, precision)
    if not mats:
        return 0
    weights = 2 * sum(n * k for n, k in mats) / tp
    widest = max(max(n, k) for n, k in mats) / tp
    scales = 4 * (len(mats) * 4 if precision == "fp8" else 2 * sum(n + k for n, k in mats))
    return int(weights + 4 * tokens * widest + scales)


def gathered_saving(m: ModelSpec, precision: str, tp: int = 1) -> float:
    """Bytes FSDP2's float8 all-gather saves on one gathered block (tensorwise only)."""
    return converted_block_params(m, precision) / tp if precision == "fp8" else 0.0


# The step time (plan/steptime.py): a converted matmul runs at the card's float8 peak times a
# share of the efficiency bf16 matmuls reach of the bf16 peak, fitted to what float8 gained on
# four of Llama-3-8B's blocks (seq 8192, compiled; one H200, torch 2.11, torchao 0.18;
# docs/decisions.md#float8): tensorwise 1.31x bf16's tokens/s, rowwise 1.06x. The casts and
# scales are in that share. Measured on an H200, whose float8 peak is twice its bf16 peak.
MEASURED_BLOCK_SPEEDUP = {"fp8": 1.31, "fp8-rowwise": 1.06}
MEASURED_SEQ = 8192
MEASURED_PEAK_RATIO = 1978.9 / 989.4  # the H200's dense fp8 / bf16 peaks (plan/cards.py)


def converted_share(m: ModelSpec, precision: str, seq: int) -> float:
    """The share of one block's work (6 FLOPs per parameter per token, and causal attention's
    6·h·s) its float8 matmuls do."""
    block = 6 * m.block_params + 6 * m.hidden * seq
    return 6 * converted_block_params(m, precision) / block


def matmul_efficiency(precision: str) -> float:
    """A float8 matmul's share of the card's float8 peak, relative to the share a bf16 matmul
    reaches of the bf16 peak: the measured block speedup, less the block's unconverted work,
    over the measuring card's peak ratio (tensorwise 0.70, rowwise 0.54)."""
    from ..modelinfo.spec import PRESETS

    share = converted_share(PRESETS["llama3-8b"], precision, MEASURED_SEQ)
    converted_speedup = share / (1 / MEASURED_BLOCK_SPEEDUP[precision] - (1 - share))
    return converted_speedup / MEASURED_PEAK_RATIO
