"""Per-process helpers that training scripts call (each imports its framework lazily)."""
