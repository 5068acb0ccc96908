"""Low-rank adapters (LoRA), through PEFT: the frozen model keeps its modules and parameter
names, and each targeted linear layer becomes PEFT's ``lora.Linear`` in place, holding the
original layer as ``base_layer`` and the adapter as ``lora_A.default`` / ``lora_B.default``.

PEFT's ``inject_adapter_in_model`` is used rather than ``get_peft_model``: the model stays the
same object (a Hugging Face model is still one, its blocks where they were), so every layout,
the block finder and the weight loader see it as before; only ``base_layer.`` enters the frozen
parameters' paths, which ``weights.clean_name`` takes out again to find them in the weight
files. The adapters are the only trainable parameters.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config.sections import unmatched_target
from ..errors import bad_value
from ..vocab import LORA_ALL_LINEAR as ALL_LINEAR
from ..vocab import lora_target_matches

ADAPTER = "default"  # PEFT's adapter name: the one adapter a run trains


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora RANK`` and its options ask for."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_of(cfg: Any) -> LoraSpec:
    """The LoraSpec of a config whose --lora is set (config/sections.py checked its options)."""
    from ..config.sections import lora_targets

    rank = int(cfg.lora)
    alpha = float(cfg.lora_alpha) if cfg.lora_alpha is not None else float(2 * rank)
    return LoraSpec(rank, alpha, float(cfg.lora_dropout), lora_targets(cfg))


def is_adapter(name: str) -> bool:
    """Whether a parameter path (of any wrapper) is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def _linears(model: nn.Module) -> list[str]:
    """Every nn.Linear's path but the output head's (the layer that feeds the loss)."""
    getter = getattr(model, "get_output_embeddings", None)
    out = getter() if callable(getter) else None
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if module is out or name.rsplit(".", 1)[-1] in ("lm_head", "head"):
                continue
            names.append(name)
    return names


def target_modules(model: nn.Module, targets: tuple[str, ...], source: str = "--lora-targets") -> list[str]:
    """The paths of the linear layers that get adapters. ``targets``: ``all-linear`` (every
    linear layer but the output head), kinds (``q``, ``up``, ...), the last part of module
    names (``qkv``, ``proj``, as meshrun's GPT names them), or a layer's full path (as a
    snapshot records the layers it adapted). Each target must match a layer."""
    linears = _linears(model)
    if ALL_LINEAR in targets:
        if not linears:
            raise bad_value(source, ALL_LINEAR, "the model has no linear layer besides its output head")
        return linears
    chosen: list[str] = []
    for target in targets:
        matched = [n for n in linears if n == target or lora_target_matches(target, n.rsplit(".", 1)[-1])]
        if not matched:
            raise unmatched_target(source, target, [n.rsplit(".", 1)[-1] for n in linears])
        chosen += [n for n in matched if n not in chosen]
    return chosen


def add_adapters(model: nn.Module, spec: LoraSpec, source: str = "--lora-targets") -> nn.Module:
    """Freeze ``model`` and give the targeted layers adapters, in place (also on the meta
    device: a model whose weights are read once it is laid out gets its adapters there too,
    initialised with it by ``init_adapters``)."""
    from peft import LoraConfig, inject_adapter_in_model

    names = target_modules(model, spec.targets, source)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=names,
                        bias="none")
    on_meta = any(p.is_meta for p in model.parameters())
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation, the same whatever the layout: each ``lora_A`` drawn whole
    (Kaiming-uniform, as ``nn.Linear``), seeded by the run's seed and its own path, each
    ``lora_B`` zero (so the adapted model starts as the base model); each rank keeps its slice."""
    from .weights import _chunks, clean_name

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_adapter(name):
                continue
            if ".lora_B." in name or name.startswith("lora_B."):
                for _, local in _chunks(p):
                    local.zero_()
                continue
            gen = torch.Generator(device="cpu").manual_seed(_seed(seed, clean_name(name)))
            shape = tuple(p.shape)
            bound = 1 / math.sqrt(shape[1]) if len(shape) > 1 and shape[1] else 0.0
            whole = (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
            for slices, local in _chunks(p):
                local.copy_(whole[slices].to(local.dtype))


def counts(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))  # (DeepSpeed ZeRO-3's partitioned ones: their whole size)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def adapter_modules(model: nn.Module) -> list[str]:
    """The paths of the layers that hold an adapter."""
    return [name for name, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m.lora_A, nn.ModuleDict)]


def describe(spec: LoraSpec, model: nn.Module) -> str:
    """What trains, for the run's first lines: 'LoRA rank 16 (alpha 32) on 7 kinds of layer in
    224 places: 41.9M of 8.07B parameters (0.52%) train'."""
    from ..units import fmt_count as count

    trainable, total = counts(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in adapter_modules(model)})
    share = 100 * trainable / total if total else 0.0
    alpha = f"{spec.alpha:g}"
    return (f"LoRA rank {spec.rank} (alpha {alpha}) on {', '.join(leaves)} ({len(adapter_modules(model))} layers): "
            f"{count(trainable)} of {count(total)} parameters ({share:.2f}%) train, the rest frozen")


def model_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors, by parameter path: what a LoRA run's snapshots hold."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}
