"""What the planner and the trainer both need to know about a model, read in one place.

A model's shape (parameters, blocks, widths, vocabulary, context) comes from a preset, a
Hugging Face ``config.json`` or a live ``nn.Module``; the block list (the unit that FSDP
shards and activation checkpointing recomputes) is found the same way for both. The planner
(``meshrun.plan``) and the trainer (``meshrun.training``) import this package; it imports
neither, and torch only when a live model is read.
"""

from .spec import PRESETS, ModelSpec, gpt_spec, llama_spec

__all__ = ["ModelSpec", "PRESETS", "gpt_spec", "llama_spec"]
