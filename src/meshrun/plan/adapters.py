"""Low-rank adapters (LoRA) as the planner counts them (pure): which linear layers of a model's
shape get an adapter, how many parameters train, and how many bytes the frozen base weights
take, in the run's precision or in torchao's NF4 (``--quantize nf4``, QLoRA).

An adapter of rank r on a linear layer of ``in`` inputs and ``out`` outputs is two matrices,
A (r x in) and B (out x r): r·(in + out) parameters, no bias (PEFT's ``bias="none"``, as
training/lora.py makes them). They are the only parameters that train: they alone have
gradients and optimizer state, kept as the run keeps trainable parameters. Every other
parameter is frozen: stored, never updated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from ..errors import bad_value
from ..modelinfo.spec import ModelSpec
from ..vocab import LORA_ALL_LINEAR, LORA_KINDS, QUANTIZE_CHOICES, lora_target_matches

# torchao's NF4 (torchao.quantization.to_nf4 with its defaults, NF4Tensor.from_tensor; torchao
# 0.18): each weight a 4-bit index into 16 levels, two to a byte; one int8 scaler per NF4_BLOCK
# weights (the block's absmax, its mean taken out, quantized); one factor per NF4_SCALER_BLOCK
# scalers, in the weight's dtype; per tensor the scalers' mean (one value) and the 16 levels, in
# the weight's dtype (tests/test_plan_lora.py checks the count against the tensors torchao holds).
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
NF4_LEVELS = 16


def nf4_bytes(numel: int, dtype_bytes: int = 2) -> float:
    """The bytes of one weight of ``numel`` elements stored as torchao's NF4, quantized from a
    tensor of ``dtype_bytes`` per element (2: bf16): numel/2 of indices, numel/64 of int8
    scalers, numel/16384 factors and 17 values in that dtype: 0.5157 bytes (4.13 bits) a
    weight from bf16."""
    return (numel / 2 + numel / NF4_BLOCK + numel / (NF4_BLOCK * NF4_SCALER_BLOCK) * dtype_bytes
            + (1 + NF4_LEVELS) * dtype_bytes)


@dataclass(frozen=True)
class Adapters:
    """What ``--lora RANK`` asks the planner for: adapters of ``rank`` on the layers
    ``targets`` names (``all-linear``, kinds ``q,k,v,o,gate,up,down``, or module names), the
    frozen base weights stored as ``quantize`` says (none: in the run's precision; nf4), and
    ``dropout`` on the adapters' inputs (PEFT's lora_dropout: a dropped copy of each adapted
    layer's input and its mask are kept for backward)."""

    rank: int
    targets: tuple[str, ...] = (LORA_ALL_LINEAR,)
    quantize: str = "none"
    dropout: float = 0.0

    @property
    def nf4(self) -> bool:
        return self.quantize == "nf4"


def block_layers(m: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, out, in) of each linear layer in one block: as the built module has them, else
    from the shape with the names of the models meshrun knows (a gated MLP: a Llama-style
    block, q_proj ... down_proj; else meshrun's GPT, qkv, proj, up, down)."""
    if m.linears is not None and m.linear_names is not None:
        return [(name, out, inp) for name, (out, inp) in zip(m.linear_names, m.linears)]
    h, kv, f = m.hidden, m.kv_dim, m.ffn
    if m.gated_mlp:
        return [("q_proj", h, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, h),
                ("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)]
    return [("qkv", 3 * h, h), ("proj", h, h), ("up", f, h), ("down", h, f)]


@dataclass(frozen=True)
class AdapterLayout:
    """The adapted layers of one model: ``block`` (name, out, in) in each of its blocks,
    ``outer`` outside them, at ``rank``."""

    spec: Adapters
    layers: int  # blocks
    block: tuple[tuple[str, int, int], ...]
    outer: tuple[tuple[str, int, int], ...] = ()

    @property
    def rank(self) -> int:
        return self.spec.rank

    @cached_property
    def block_params(self) -> int:
        """Adapter parameters in one block: r·(in + out) per adapted layer."""
        return sum(self.rank * (inp + out) for _, out, inp in self.block)

    @cached_property
    def params(self) -> int:
        """Adapter parameters in the whole model: what trains."""
        return self.layers * self.block_params + sum(self.rank * (inp + out) for _, out, inp in self.outer)

    @cached_property
    def block_adapted(self) -> int:
        """Base weights of one block's adapted layers (what NF4 stores)."""
        return sum(out * inp for _, out, inp in self.block)

    @cached_property
    def adapted(self) -> int:
        """Base weights of every adapted layer."""
        return self.layers * self.block_adapted + sum(out * inp for _, out, inp in self.outer)

    @cached_property
    def block_inputs(self) -> int:
        """The widths of one block's adapted layers' inputs, summed (what dropout copies)."""
        return sum(inp for _, _, inp in self.block)

    @cached_property
    def largest(self) -> int:
        """The largest adapted weight's elements (NF4: the one dequantized at a time)."""
        return max((out * inp for _, out, inp in (*self.block, *self.outer)), default=0)

    @property
    def kinds(self) -> list[str]:
        """The adapted layers' names, each once, in the block's order."""
        return list(dict.fromkeys(name for name, _, _ in (*self.block, *self.outer)))

    def frozen_bytes(self, base_params: int, block: bool, dtype_bytes: int) -> float:
        """Bytes of ``base_params`` frozen parameters (one block's when ``block``, else the
        whole model's) stored as the run keeps them: ``dtype_bytes`` each, the adapted layers'
        weights in NF4 under --quantize nf4."""
        if not self.spec.nf4:
            return dtype_bytes * base_params
        shapes = self.block if block else (*(x for x in self.block for _ in range(self.layers)), *self.outer)
        adapted = self.block_adapted if block else self.adapted
        return dtype_bytes * (base_params - adapted) + sum(nf4_bytes(out * inp, dtype_bytes) for _, out, inp in shapes)


def layout(m: ModelSpec, spec: Adapters, source: str = "--lora-targets") -> AdapterLayout:
    """The layers ``spec.targets`` names in the model's shape (training/lora.py's rule:
    all-linear is every linear layer but the output head; a kind is its module name; another
    name matches layers whose last part it is); a target that matches no layer is refused."""
    block, outer = block_layers(m), list(m.outer_linears)
    if LORA_ALL_LINEAR in spec.targets:
        if not block and not outer:
            raise bad_value(source, LORA_ALL_LINEAR, "the model has no linear layer besides its output head")
        return AdapterLayout(spec, m.layers, tuple(block), tuple(outer))
    chosen: set[str] = set()
    for target in spec.targets:
        matched = {name for name, _, _ in (*block, *outer) if lora_target_matches(target, name)}
        if not matched:
            names = sorted({name for name, _, _ in (*block, *outer)})
            raise bad_value(source, target, f"matches no linear layer of {m.name}",
                            f"its linear layers are {', '.join(names[:12]) or 'none'}; kinds "
                            f"{','.join(LORA_KINDS)}; or {LORA_ALL_LINEAR}")
        chosen |= matched
    return AdapterLayout(spec, m.layers, tuple(x for x in block if x[0] in chosen),
                         tuple(x for x in outer if x[0] in chosen))


def check(spec: Adapters, m: ModelSpec) -> AdapterLayout:
    """``spec`` checked against the model (one-line errors naming the option): the layout."""
    if spec.rank < 1:
        raise bad_value("--lora", spec.rank, "must be >= 1", "an adapter's rank, e.g. --lora 16")
    if spec.quantize not in QUANTIZE_CHOICES:
        raise bad_value("--quantize", spec.quantize, "unknown", f"one of {', '.join(QUANTIZE_CHOICES)}")
    if not 0 <= spec.dropout < 1:
        raise bad_value("--lora-dropout", spec.dropout, "must be in [0, 1)", "e.g. 0.05")
    if not spec.targets:
        raise bad_value("--lora-targets", "", "names no layer", f"e.g. q,v or {LORA_ALL_LINEAR}")
    return layout(m, spec)


@lru_cache(maxsize=64)
def of(m: ModelSpec, spec: Adapters | None) -> AdapterLayout | None:
    """The layout of ``spec`` on ``m`` (None: no adapters), for the memory and time terms."""
    return None if spec is None else layout(m, spec)
