"""Float8 training (``--precision fp8``, ``fp8-rowwise``) through torchao: the model's linear
layers compute their matmuls in float8 (e4m3 forward, e5m2 gradients) with dynamic scales,
everything else in bf16 as ``--precision bf16`` runs it.

``fp8`` is torchao's tensorwise recipe (one scale a tensor); under FSDP2 its weights are
all-gathered in float8 (half the bytes of bf16), their scales computed for all layers at once
after each optimizer step. ``fp8-rowwise`` scales each row (more accurate, slower).

Which linear layers (docs/decisions.md#float8): torchao's own rule for the recipe (both
dimensions multiples of 16; tensorwise skips layers with K <= 4096 and N <= 1024, rowwise those
with N <= 2048, K <= 1024, or N <= 4096 and K <= 2048, from its H100 measurements), and never
the output head (its logits feed the loss in full precision) or a weight tied to an embedding.
On Llama-3-8B's blocks ``fp8`` (tensorwise) is faster than ``fp8-rowwise``, and both faster
than bf16 (docs/decisions.md#float8)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ...errors import MeshrunError
from ..models.hooks import FusedBlock

RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}
HEAD_NAMES = ("lm_head", "head", "output")  # a model's output projection, by its attribute name


def is_float8(precision: str) -> bool:
    return precision in RECIPES


def check_device(precision: str, device: torch.device, where: str) -> None:
    """Refuse, in one line, a device without float8 matmuls (compute capability below 8.9:
    anything before Ada and Hopper, and the CPU) or a missing torchao. The hint is bf16 on a GPU;
    on the CPU, where bf16 is refused too, what trains there. `meshrun train` refuses the CPU's
    case before any rank starts, in the same words (job/prelaunch.py)."""
    hint = "--precision bf16"
    if device.type != "cuda":
        raise MeshrunError(f"{where}={precision!r}: float8 matmuls need a GPU of compute capability 8.9 or newer "
                           f"(Ada, Hopper, Blackwell); this run is on the {device.type.upper()} "
                           "(hint: --precision auto or fp32)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise MeshrunError(f"{where}={precision!r}: {torch.cuda.get_device_name(device)} (compute capability "
                           f"{major}.{minor}) has no float8 matmuls; they need 8.9 or newer (hint: {hint})")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise MeshrunError(f"{where}={precision!r}: needs torchao, which is not installed "
                           "(hint: pip install 'meshrun[fp8]')") from None


def layer_rule(model: nn.Module, precision: str) -> Callable[[nn.Module, str], bool]:
    """Whether the linear layer ``module`` named ``name`` computes in float8 (the module's
    docstring says which)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    torchao_rule = _auto_filter_for_recipe(RECIPES[precision], filter_fqns=[])
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in HEAD_NAMES}
    output = getattr(model, "get_output_embeddings", None)
    if callable(output) and output() is not None:
        heads.add(id(output()))

    def converts(module: nn.Module, name: str) -> bool:
        if id(module) in heads or id(getattr(module, "weight", None)) in embedded:
            return False
        return bool(torchao_rule(module, name))

    return converts


def convert(model: nn.Module, precision: str, fsdp: bool) -> tuple[str, Callable[[nn.Module], None] | None]:
    """Swap the chosen linear layers for torchao's Float8Linear, in place (parameter names and
    snapshots stay those of the bf16 model). Returns what was done, for the run's strategy line,
    and what to call after each optimizer step (the float8 all-gather's scales), if anything."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = RECIPES[precision]
    gather = fsdp and recipe == "tensorwise"
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if gather \
        else Float8LinearConfig.from_recipe_name(recipe)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=layer_rule(model, precision), config=config)
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    if not converted:
        raise MeshrunError(f"--precision={precision!r}: none of the model's {linears} linear layers is large "
                           "enough to gain from float8 (hint: --precision bf16)")
    for m in model.modules():  # the fused MLP reads its weights without calling the float8 layers
        if isinstance(m, FusedBlock) and m.fused_mlp and any(c in converted for c in m.children()):
            m.fused_mlp = False
    what = f"float8 {recipe} in {len(converted)} of {linears} linear layers"
    if not gather:
        return what, None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return what + " (all-gathered in float8)", precompute_float8_dynamic_scale_for_fsdp
