"""meshrun trainer (see trainer.py)."""
