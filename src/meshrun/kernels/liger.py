"""Liger Kernel's Triton kernels for Hugging Face models (``--kernels auto`` where it is
installed, the ``liger`` extra): RMSNorm, SwiGLU, rotary embeddings, and the fused linear
cross-entropy that takes the loss from the last hidden states chunk by chunk, never holding
the vocabulary-wide logits. Liger patches the model instance and the architecture's module
functions (``_apply_liger_kernel_to_instance``), for the model types it knows.

Applied on CUDA only, to a model that is not tensor- or pipeline-parallel: its kernels take
whole tensors, not DTensor shards, and its loss is the model's whole forward."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_applies(model: Any, device: torch.device, tp: int, pp: int) -> bool:
    """Whether Liger's kernels can patch ``model`` on ``device``: a model type Liger knows,
    on CUDA, neither tensor- nor pipeline-parallel, with Liger installed."""
    if device.type != "cuda" or tp > 1 or pp > 1:
        return False
    return liger_knows(model)


def liger_knows(model: Any) -> bool:
    """Whether Liger is installed and knows ``model``'s Hugging Face model type."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type or not liger_available():
        return False
    quiet_registry()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


def quiet_registry() -> None:
    """Liger tries a backend per op for other hardware (Ascend, CuTe DSL) and warns, per op and
    per rank, when one does not import: not this run's concern."""
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def mixture_of_experts(model: Any) -> bool:
    """Whether ``model``'s config names more than one routed expert."""
    config = getattr(model, "config", None)
    return any((getattr(config, key, None) or 0) > 1 for key in EXPERT_COUNT_KEYS)


# Liger's patch with its fused linear cross-entropy alone (each architecture's patch takes the
# keywords it has; Liger drops the others)
LOSS_ONLY = {"rope": False, "rms_norm": False, "layer_norm": False, "swiglu": False, "geglu": False,
             "cross_entropy": False, "fused_linear_cross_entropy": True}


def liger_options(model: Any, loss_only: bool = False) -> dict[str, bool]:
    """The keyword arguments meshrun gives Liger's patch for ``model`` (the trainer and the
    planner's trace alike); ``loss_only``: its fused linear cross-entropy alone, for a model
    whose blocks are compiled (Liger's other kernels do not compile). A Mixture-of-Experts model
    keeps its own experts (``swiglu=False``): Liger 0.8.5's fused MoE kernel failed to compile
    for Qwen3-MoE's experts (128 of 768, 8 per token; ``PassManager::run failed`` in its token
    aggregation), and ran minutes before its first step on a Mixtral shape. Without it the
    Qwen3-MoE shape trains with meshrun's defaults. The cost, where the kernel does compile: a
    Mixtral shape (8 experts of 3584, 2 per token) trains slower without it.
    docs/decisions.md#liger"""
    if loss_only:
        return dict(LOSS_ONLY)
    return {"swiglu": False} if mixture_of_experts(model) else {}


class _LigersCacheName(logging.Filter):
    """Liger 0.8.5's forwards pass and read ``past_key_values``, which transformers 5 renamed
    ``cache`` and logs as deprecated once per rank: a line about Liger's code, which the user
    cannot change, so it is dropped (every other line of that logger stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`past_key_values`/`cache_params` are deprecated")


def apply_liger(model: Any, loss_only: bool = False) -> list[str]:
    """Patch ``model`` (``liger_applies``) with Liger's kernels (``loss_only``: its fused
    linear cross-entropy alone); what was applied, for the run's strategy line."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    generic = logging.getLogger("transformers.utils.generic")
    if not any(isinstance(f, _LigersCacheName) for f in generic.filters):
        generic.addFilter(_LigersCacheName())

    options = liger_options(model, loss_only)
    _apply_liger_kernel_to_instance(model=model, **options)
    mlp = "the model's own experts" if options.get("swiglu") is False else "SwiGLU"
    # the fused loss replaces the model's forward; where it does not apply (Granite scales its
    # logits) Liger's cross-entropy takes the logits the model makes
    fused = getattr(getattr(model.forward, "__func__", None), "__module__", "").startswith("liger_kernel")
    loss = "fused linear cross-entropy" if fused else "cross-entropy"
    if loss_only:  # (a model whose logits Liger's fused loss does not take keeps its own loss)
        return [f"Liger's fused linear cross-entropy for {model.config.model_type}"] if fused else []
    return [f"Liger kernels for {model.config.model_type} (RMSNorm, {mlp}, rotary, {loss})"]
