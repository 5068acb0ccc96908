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


def apply_liger(model: Any) -> list[str]:
    """Patch ``model`` (``liger_applies``) with Liger's kernels; what was applied, for the
    run's first line."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return [f"Liger kernels for {model.config.model_type} (RMSNorm, SwiGLU, rotary, fused linear cross-entropy)"]
