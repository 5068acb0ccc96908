"""What the parallel layouts need to know of a Hugging Face causal LM beyond its block list:
whether it is one, and whether its attention is plain causal attention over the whole prefix
(the one that context parallelism and pipeline stages compute without transformers' masks)."""

from __future__ import annotations

import torch.nn as nn

from ...errors import MeshrunError
from ...modelinfo.hf import is_transformers_model as is_transformers_model  # (the layouts read it here)


def model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def check_whole_prefix(model: nn.Module, seq_len: int, flag: str) -> None:
    """Refuse, in one line, a model whose attention is not causal over the whole prefix at
    ``seq_len`` (a sliding window shorter than it, capped logits)."""
    config, kind = model.config, model_type(model)  # type: ignore[attr-defined]
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < seq_len:
        raise MeshrunError(f"{flag}: this {kind} model attends within a sliding window of {window} tokens, shorter "
                           f"than --seq-len {seq_len}; {flag} attends to the whole prefix "
                           f"(hint: --seq-len {window} or less, or FSDP2 without {flag})")
    if getattr(config, "attn_logit_softcapping", None):
        raise MeshrunError(f"{flag}: this {kind} model caps its attention logits, which SDPA does not "
                           f"(hint: FSDP2 without {flag})")
