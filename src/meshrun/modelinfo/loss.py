"""How a model gives its training loss, for the trainer's step and the planner's tracer alike:
the model's forward signature decides whether it takes the targets, takes labels and shifts
them itself (a Hugging Face causal LM), or returns logits that are scored here.

Imports torch: callers that must stay torch-free import it inside the function that needs it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import MeshrunError

__all__ = ["LABELS_KWARGS", "loss_mode", "model_loss"]


def loss_mode(module: nn.Module) -> str:
    """How the loss is taken from a model: ``targets``, its forward(x, targets) returns the loss
    (meshrun's GPT); ``labels``, its forward takes ``labels`` and returns the loss among its
    outputs, shifting the labels itself (Hugging Face causal LMs); ``labels-nocache``, the same
    with ``use_cache=False`` (a Hugging Face model would otherwise fill a cache of every layer's
    keys and values, which training never reads: memory lost, and a recomputed layer under
    checkpointing would find the cache changed); ``labels-nocache-dict``, the same with
    ``return_dict=True`` for a forward that names it (Liger Kernel's: left None, it reads
    ``config.use_return_dict``, which transformers 5 logs as deprecated on every rank);
    ``logits``, anything else, whose output is scored here."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return "logits"
    if len(params) >= 2 and params[1] in ("targets", "target", "y"):
        return "targets"
    if "labels" in params:
        if "use_cache" not in params:
            return "labels"
        return "labels-nocache-dict" if "return_dict" in params else "labels-nocache"
    return "logits"


# The keyword arguments each labels mode adds to the model's call (loss_mode)
LABELS_KWARGS: dict[str, dict[str, bool]] = {"labels": {}, "labels-nocache": {"use_cache": False},
                                             "labels-nocache-dict": {"use_cache": False, "return_dict": True}}


def _field(out: Any, name: str) -> Any:
    """``name`` (loss, logits) of a model's output: a tensor as it is, a ModelOutput's or a
    dict's entry, a tuple's first element."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out.get(name) if hasattr(out, "get") else out[name]
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    return getattr(out, name, None)


def model_loss(model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor,
               extra: dict[str, Any] | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of one micro-batch: the model's own (``targets``: the next tokens ``y``;
    ``labels``: the inputs themselves, which the model shifts, so the loss is exactly its own;
    ``extra``: more keyword arguments for it), else cross-entropy over its logits (integer
    targets) or the mean squared error (float targets), in fp32. ``positions`` (document
    masking): each token's position in its document, for the model to attend within documents;
    ``y`` then ignores (-100) the targets across a document's end."""
    if mode == "targets":
        own: torch.Tensor = model(x, y) if positions is None else model(x, y, positions=positions)
        return own
    if positions is not None and mode.startswith("labels"):
        # transformers reads documents from position ids that restart; the targets come shifted
        extra = {"labels": y, "shift_labels": y, "position_ids": positions, **(extra or {})}
    elif positions is not None:
        raise MeshrunError(f"--document-mask: {type(model).__name__} takes no position ids "
                           "(hint: meshrun's GPT or a Hugging Face model, or drop --document-mask)")
    if mode.startswith("labels"):
        extra = {**(extra or {}), **LABELS_KWARGS[mode]}
        labels = extra.pop("labels", x)
        loss = _field(model(input_ids=x, labels=labels, **extra), "loss")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise MeshrunError(f"the model took labels but returned no scalar loss ({type(loss).__name__}) "
                               "(hint: a causal-LM model, e.g. transformers' *ForCausalLM)")
        return loss
    out = _field(model(x), "logits")
    if not isinstance(out, torch.Tensor):
        raise MeshrunError(f"the model returned {type(out).__name__}, not logits or a prediction "
                           "(hint: return a tensor, or a dict or ModelOutput with 'logits')")
    if not y.is_floating_point():
        return F.cross_entropy(out.float().view(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out.float(), y.float())
