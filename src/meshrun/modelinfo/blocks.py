"""Find a model's list of repeated blocks: the unit FSDP2 shards, activation checkpointing
recomputes, compile compiles one at a time and tensor parallelism rewrites."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import bad_value

if TYPE_CHECKING:
    import torch.nn as nn

# Where common model families keep their list of repeated blocks.
BLOCK_PATHS = ("blocks", "layers", "h", "transformer.h", "transformer.blocks", "model.layers",
               "model.decoder.layers", "gpt_neox.layers", "decoder.layers", "encoder.layers")


def _attr_path(model: nn.Module, path: str) -> object:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_blocks(model: nn.Module, override: str | None = None) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """(attribute path, the block list) of the model, or None. ``override`` names the path
    (``--blocks model.layers``); otherwise the usual paths are tried, then the largest
    ModuleList of more than one module."""
    import torch.nn as nn

    if override:
        blocks = _attr_path(model, override)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise bad_value("--blocks", override, "does not name a non-empty ModuleList of the model",
                            "give the attribute path of the block list, e.g. model.layers")
        return override, blocks
    for path in BLOCK_PATHS:
        blocks = _attr_path(model, path)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return path, blocks
    lists = [(sum(p.numel() for p in m.parameters()), name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1]
    if lists:
        _, name, m = max(lists, key=lambda t: t[0])
        return name, m
    return None
