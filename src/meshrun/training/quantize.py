"""QLoRA's frozen base (--quantize nf4): each adapted layer's frozen weight stored in torchao's
4-bit NF4 (a quarter of bf16's bytes), the adapters kept as the run keeps its parameters (fp32,
computed in bf16 under autocast on GPUs). F.linear takes the NF4 weight as it is: torchao
dequantizes it to the input's dtype in the forward and the backward (which needs no gradient
of the weight). FSDP2 and DeepSpeed, which shard or partition the weights, are refused.

A weight is cut into blocks of 64 values, each with its own scale (torchao's default), and the
scales in turn into blocks of 256, each with a scale of its own. ``to_nf4`` needs the weight's
blocks to divide into scaler blocks: a layer whose 64-value blocks do not divide by 256 gets the
largest power of two that divides them (a tiny model's 64 x 64 layer: 64); a layer whose size
is not a multiple of 64, or whose blocks are odd, stays unquantized (said in the layout's line).
"""

from __future__ import annotations

import torch
import torch.nn as nn

BLOCK = 64  # values per scale (torchao's default)
SCALER_BLOCK = 256  # scales per scale of the scales (torchao's default)


def scaler_block(numel: int) -> int | None:
    """The scaler block size for a weight of ``numel`` values (the module's rule); None: the
    weight stays unquantized."""
    if numel % BLOCK:
        return None
    blocks = numel // BLOCK
    size = SCALER_BLOCK
    while size >= 2 and blocks % size:
        size //= 2
    return size if size >= 2 else None


def quantize_base(model: nn.Module) -> tuple[int, int]:
    """Every LoRA layer's frozen base weight to NF4, in place; returns (layers quantized, layers
    left unquantized)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    done = kept = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Linear) or not hasattr(module, "lora_A"):
            continue
        weight = base.weight
        size = scaler_block(weight.numel())
        if size is None:
            kept += 1
            continue
        with torch.no_grad():
            nf4 = to_nf4(weight.detach().to(torch.bfloat16), BLOCK, size)
        base.weight = nn.Parameter(nf4, requires_grad=False)
        done += 1
    return done, kept


def describe(done: int, kept: int) -> str:
    return f"NF4 base in {done} layers" + (f" ({kept} left unquantized: not in blocks of {BLOCK})" if kept else "")


def frozen_linears_to_bf16(model: nn.Module) -> int:
    """A LoRA run computing in bf16 under autocast: every frozen linear layer's fp32 weight (and
    bias) stored in bf16, in place; returns how many. Autocast casts them to bf16 at every use
    anyway, with the same rounding, so the matmuls see the same values bit for bit, while the
    base holds half the memory (an 8B model: 15 GiB less) and the per-step casts go away. Only
    linear layers: an embedding or a norm runs in its weight's dtype, so theirs stay, and so
    does a head tied to the input embedding."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    done = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, nn.Linear) or not isinstance(weight, nn.Parameter) or weight.requires_grad
                or weight.dtype != torch.float32 or id(weight) in embeddings or type(weight.data) is not torch.Tensor):
            continue
        with torch.no_grad():
            module.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
            if module.bias is not None and not module.bias.requires_grad:
                module.bias = nn.Parameter(module.bias.detach().to(torch.bfloat16), requires_grad=False)
        done += 1
    return done

